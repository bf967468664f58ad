//! `skewless-bench`: the side-by-side proxy benchmark (issue 4), on 127.0.0.1 only.
//!
//! Starts 5 `skewless-echo` pods (the 5th one slowed down by the run's delay), then for every
//! delay and client connection count loads, with `skewless-loadgen run --json` in closed loop:
//! one healthy pod directly, the slow pod directly (the two outcomes of an L4 coin flip, never
//! averaged), an L4 per-connection balancer (HAProxy `mode tcp`, with more than one connection
//! or beside connection mode), HAProxy (h2, leastconn), nginx (grpc_pass, least_conn) and
//! `skewless-proxy` (request mode, and connection mode when it has one).
//! Then an open-loop section: direct-healthy and the three L7 proxies at one fixed offered rate
//! (by default 60% of HAProxy's closed-loop median RPS at one connection), where latency
//! counts from each call's intended send time.
//!
//! Cells are repeated (`--repeats`, for the connection counts in `--repeat-connections`) and
//! the repeats are interleaved: each pass runs every cell once, with the target order rotated
//! from pass to pass, so machine noise lands on every target alike rather than on whichever
//! proxy happened to run during a burst. The tables report medians and ranges.
//!
//! Each proxy is started fresh for its run; its CPU comes from `/proc/<pid>/stat` over the
//! measured window and its peak RSS from `VmHWM`, both summed over its processes. Every process
//! started here is ended by its pid when its run ends, also on errors.

mod counting;
mod h2load;
mod procs;
mod rotation;

use std::fmt::Write as _;
use std::io::Read as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use skewless_bench::chart::skew_chart_svg;
use skewless_bench::counted::counted_table;
use skewless_bench::sampling::{clk_tck, cpu_ticks, peak_rss_kib, tree};
use skewless_bench::{
    Pod, Row, Summary, bar_chart_svg, builds_table, connection_targets_table, haproxy_config,
    interleave, low_load_table, markdown_table, nginx_config, open_table, open_targets_table,
    replace_section, summarize, targets_table,
};
use skewless_loadgen::Report;

use crate::procs::{Proc, find_tool, free_addr, set_delay};

const PODS: usize = 5;
const SECTION: &str = "## Proxies side by side";
const H2LOAD_SECTION: &str = "## h2load: request mode against HAProxy h2 (third-party load)";

/// Seconds a run costs beyond its warm-up and measured window (starting and stopping the
/// proxy and the load generator, connecting), for the time estimate only.
const RUN_OVERHEAD_S: f64 = 0.5;

/// File name, title, unit, value of a cell, log scale, open-loop cells (else closed).
type Chart = (
    &'static str,
    &'static str,
    &'static str,
    fn(&Summary) -> f64,
    bool,
    bool,
);

#[derive(Debug, Parser)]
#[command(about = "Side-by-side gRPC balancing benchmark: direct, L4, HAProxy, nginx, skewless")]
struct Args {
    /// Delays of the 5th pod, ms.
    #[arg(long, value_delimiter = ',', default_value = "0,50,200")]
    delays: Vec<u64>,
    /// Client HTTP/2 connection counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    connections: Vec<usize>,
    /// Closed loop: calls in flight per connection.
    #[arg(long, default_value_t = 200)]
    in_flight: usize,
    /// Warm-up seconds per run (not measured).
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 4.0)]
    duration: f64,
    /// Runs per cell for the connection counts in --repeat-connections (the others run once);
    /// tables show the median and the min–max range, verdicts use the median.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Connection counts whose cells are repeated (and the open-loop cells, when they use one
    /// of them).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    repeat_connections: Vec<usize>,
    /// Skip the open-loop section.
    #[arg(long)]
    no_open: bool,
    /// Open loop: offered calls per second (default: --open-fraction of HAProxy's closed-loop
    /// median RPS at --open-delay and --open-connections).
    #[arg(long)]
    open_rate: Option<f64>,
    /// Open loop: fraction of HAProxy's closed-loop RPS to offer.
    #[arg(long, default_value_t = 0.6)]
    open_fraction: f64,
    /// Open loop: delay of the slow pod, ms.
    #[arg(long, default_value_t = 50)]
    open_delay: u64,
    /// Open loop: client HTTP/2 connections.
    #[arg(long, default_value_t = 1)]
    open_connections: usize,
    /// Worker threads/processes of every proxy (HAProxy nbthread, nginx worker_processes,
    /// skewless-proxy data-plane workers).
    #[arg(long, default_value_t = 2)]
    proxy_threads: usize,
    /// Directory with skewless-echo, skewless-loadgen and skewless-proxy (default: this
    /// binary's).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Markdown file whose "Proxies side by side" section gets the results.
    #[arg(long)]
    write: Option<PathBuf>,
    /// The command shown in the written section.
    #[arg(long, default_value = "cargo xtask bench --proxies-only")]
    command: String,
    /// The heading of the section of --write that gets the results (replaced, or appended).
    #[arg(long, default_value = SECTION)]
    section: String,
    /// File names of the charts written beside --write: PREFIX-p99.svg, PREFIX-rps.svg,
    /// PREFIX-open-p99.svg.
    #[arg(long, default_value = "bench")]
    chart_prefix: String,
    /// Another build of skewless-proxy to run beside this one, as LABEL=PATH (repeat for
    /// more): the target `skewless@LABEL`, in every cell skewless runs in, interleaved with the
    /// others, and compared with `skewless` run by run (`cargo xtask bench --baseline REV`
    /// builds one from a git revision).
    #[arg(long = "skewless-build", value_parser = parse_build)]
    builds: Vec<(String, PathBuf)>,
    /// Run only these targets (comma-separated names as in the tables, e.g.
    /// `skewless,skewless@ae9ca9d`); default: all.
    #[arg(long, value_delimiter = ',')]
    targets: Vec<String>,
    /// Low load: the runs with one call in flight on one connection (no slow pod), where the
    /// latency a proxy adds shows; skip them.
    #[arg(long)]
    no_low_load: bool,
    /// Whether this tree's skewless-proxy runs connection mode (its `--help` offers `--mode`):
    /// then `skewless-connection` runs beside `skewless`.
    #[arg(skip)]
    connection_mode: bool,
    /// Whether this tree's skewless-proxy has request mode's experimental data path on the
    /// frame codec (its `--help` offers `--data-path`): then `skewless-codec` runs beside
    /// `skewless`.
    #[arg(skip)]
    codec_path: bool,
    /// Also run the rotation-convergence figure: pick_first grpcio clients (the venv of
    /// `cargo xtask setup`) through skewless-proxy while its endpoint set grows from 2 to 10
    /// pods (seed 001), timed until the skew stays under 1.5.
    #[arg(long)]
    convergence: bool,
    /// Only the rotation-convergence figure (no closed- or open-loop grid).
    #[arg(long)]
    convergence_only: bool,
    /// Convergence: client channels, each one HTTP/2 connection.
    #[arg(long, default_value_t = 10)]
    convergence_channels: usize,
    /// Convergence: calls in flight per channel.
    #[arg(long, default_value_t = 2)]
    convergence_concurrency: usize,
    /// Convergence: seconds before the scale-up.
    #[arg(long, default_value_t = 5.0)]
    convergence_before: f64,
    /// Convergence: seconds after the scale-up (with the defaults connection mode holds 30 s,
    /// then rotates at most 6 connections a minute: 8 moves take about 110 s).
    #[arg(long, default_value_t = 150.0)]
    convergence_after: f64,
    /// Convergence: runs per target (interleaved).
    #[arg(long, default_value_t = 1)]
    convergence_repeats: usize,
    /// Also count, for skewless and every --skewless-build, user-space instructions and clock
    /// reads per call under valgrind's callgrind (1 connection, --in-flight calls, closed
    /// loop) and syscalls per call with `perf stat` (native, open loop at
    /// --instructions-rate): figures the machine's load does not move.
    #[arg(long)]
    instructions: bool,
    /// Only the counts of --instructions (no closed- or open-loop grid).
    #[arg(long)]
    instructions_only: bool,
    /// --instructions: runs per build (interleaved).
    #[arg(long, default_value_t = 2)]
    instructions_runs: usize,
    /// --instructions: seconds counted per run.
    #[arg(long, default_value_t = 10.0)]
    instructions_duration: f64,
    /// --instructions: the offered rate of the syscall runs, calls per second.
    #[arg(long, default_value_t = 1500.0)]
    instructions_rate: f64,
    /// Skip the third-party load section (h2load against HAProxy h2 and skewless-proxy, run
    /// after the grid).
    #[arg(long)]
    no_h2load: bool,
    /// Only the h2load section (no closed- or open-loop grid).
    #[arg(long)]
    h2load_only: bool,
    /// h2load: passes (each runs every target once, interleaved).
    #[arg(long, default_value_t = 3)]
    h2load_runs: usize,
    /// h2load: requests per run (`-n`).
    #[arg(long, default_value_t = 200_000)]
    h2load_requests: u64,
    /// h2load: client connections (`-c`).
    #[arg(long, default_value_t = 4)]
    h2load_connections: usize,
    /// h2load: concurrent streams per connection (`-m`).
    #[arg(long, default_value_t = 50)]
    h2load_streams: usize,
    /// h2load: request payload bytes (the `EchoRequest`'s `payload`).
    #[arg(long, default_value_t = 16)]
    h2load_payload: usize,
    /// h2load: worker threads/processes of every proxy in these runs.
    #[arg(long, default_value_t = 1)]
    h2load_proxy_threads: usize,
    /// The heading of the section of --write that gets the h2load results.
    #[arg(long, default_value = H2LOAD_SECTION)]
    h2load_section: String,
}

fn parse_build(s: &str) -> anyhow::Result<(String, PathBuf)> {
    let Some((label, path)) = s.split_once('=') else {
        bail!("expected LABEL=PATH, got {s:?}");
    };
    if label.is_empty() || label.contains([',', ' ', '|']) {
        bail!("the label of {s:?} must be non-empty, without commas, spaces or bars");
    }
    Ok((label.to_owned(), PathBuf::from(path)))
}

#[derive(Clone, Copy, PartialEq)]
enum Target {
    DirectHealthy,
    DirectSlow,
    L4,
    Haproxy,
    Nginx,
    Skewless,
    /// skewless-proxy in connection mode (when it has one, see [`Bench::connection_mode`]).
    Connection,
    /// skewless-proxy in request mode on the frame codec (`--data-path codec`, when it has
    /// it, see [`Args::codec_path`]).
    Codec,
    /// The `n`-th `--skewless-build`.
    Build(usize),
}

/// What a run loads: the slow pod's delay, client connections, and the open-loop rate (None:
/// closed loop, with `in_flight` calls per connection, or --in-flight).
#[derive(Clone, Copy, PartialEq)]
struct Cell {
    delay_ms: u64,
    connections: usize,
    rate: Option<f64>,
    in_flight: Option<usize>,
}

struct Bench {
    args: Args,
    bin_dir: PathBuf,
    work: PathBuf,
    pods: Vec<Pod>,
    tck: f64,
}

impl Args {
    /// The target's name in the tables.
    fn name(&self, t: Target) -> String {
        match t {
            Target::DirectHealthy => "direct-healthy".to_owned(),
            Target::DirectSlow => "direct-slow".to_owned(),
            Target::L4 => "l4-roundrobin".to_owned(),
            Target::Haproxy => "haproxy".to_owned(),
            Target::Nginx => "nginx".to_owned(),
            Target::Skewless => "skewless".to_owned(),
            Target::Connection => "skewless-connection".to_owned(),
            Target::Codec => "skewless-codec".to_owned(),
            Target::Build(i) => format!("skewless@{}", self.builds[i].0),
        }
    }

    /// Whether `--targets` selects `t` (everything when it is empty).
    fn selected(&self, t: Target) -> bool {
        self.targets.is_empty() || self.targets.contains(&self.name(t))
    }

    /// `targets` without the ones `--targets` leaves out; every build follows `skewless`.
    fn choose(&self, targets: &[Target]) -> Vec<Target> {
        let mut out = Vec::new();
        for &t in targets {
            out.push(t);
            if t == Target::Skewless {
                if self.connection_mode {
                    out.push(Target::Connection);
                }
                if self.codec_path {
                    out.push(Target::Codec);
                }
                out.extend((0..self.builds.len()).map(Target::Build));
            }
        }
        out.retain(|t| self.selected(*t));
        out
    }

    /// Whether this run has the `skewless-connection` target.
    fn runs_connection_mode(&self) -> bool {
        self.connection_mode && self.selected(Target::Connection)
    }

    /// Fails on a `--targets` name that is no target of this run.
    fn check_targets(&self) -> anyhow::Result<()> {
        let mut known: Vec<String> = [
            Target::DirectHealthy,
            Target::DirectSlow,
            Target::L4,
            Target::Haproxy,
            Target::Nginx,
            Target::Skewless,
            Target::Connection,
            Target::Codec,
        ]
        .into_iter()
        .map(|t| self.name(t))
        .collect();
        known.extend((0..self.builds.len()).map(|i| self.name(Target::Build(i))));
        for t in &self.targets {
            if !known.contains(t) {
                bail!(
                    "unknown target {t:?} in --targets (known: {})",
                    known.join(", ")
                );
            }
        }
        for (label, path) in &self.builds {
            if !path.is_file() {
                bail!("--skewless-build {label}={}: no such file", path.display());
            }
        }
        Ok(())
    }
}

impl Bench {
    /// Starts the proxy for `target` (None for direct runs) and returns it with its address.
    fn start_proxy(&self, target: Target) -> anyhow::Result<(Option<Proc>, SocketAddr)> {
        self.start_proxy_with(target, self.args.proxy_threads)
    }

    /// [`Bench::start_proxy`] with `threads` worker threads/processes.
    fn start_proxy_with(
        &self,
        target: Target,
        threads: usize,
    ) -> anyhow::Result<(Option<Proc>, SocketAddr)> {
        let listen = free_addr()?;
        let mut proc = match target {
            Target::DirectHealthy => return Ok((None, self.pods[0].addr)),
            Target::DirectSlow => return Ok((None, self.pods[PODS - 1].addr)),
            Target::L4 | Target::Haproxy => {
                let name = self.args.name(target);
                let cfg = self.work.join(format!("{name}.cfg"));
                std::fs::write(
                    &cfg,
                    haproxy_config(listen, &self.pods, threads, target == Target::L4),
                )?;
                let bin = find_tool("haproxy").context("haproxy is not installed")?;
                Proc::spawn(
                    &name,
                    Command::new(bin)
                        .arg("-db")
                        .arg("-f")
                        .arg(&cfg)
                        .stdout(Stdio::null()),
                )?
            }
            Target::Nginx => {
                let dir = self.work.join("nginx");
                std::fs::create_dir_all(&dir)?;
                let cfg = dir.join("nginx.conf");
                std::fs::write(&cfg, nginx_config(&dir, listen, &self.pods, threads))?;
                let bin = find_tool("nginx").context("nginx is not installed")?;
                Proc::spawn(
                    "nginx",
                    Command::new(bin)
                        .arg("-p")
                        .arg(&dir)
                        .arg("-c")
                        .arg(&cfg)
                        .args(["-e", "stderr"])
                        .stdout(Stdio::null()),
                )?
            }
            Target::Skewless | Target::Connection | Target::Codec | Target::Build(_) => {
                let mut cmd = Command::new(self.proxy_bin(target));
                self.proxy_args_with(&mut cmd, target, listen, threads);
                Proc::spawn(&self.args.name(target), cmd.stdout(Stdio::null()))?
            }
        };
        proc.wait_listening(listen)?;
        Ok((Some(proc), listen))
    }

    /// The skewless-proxy binary of `target` (a skewless target).
    fn proxy_bin(&self, target: Target) -> PathBuf {
        match target {
            Target::Build(i) => self.args.builds[i].1.clone(),
            _ => self.bin_dir.join("skewless-proxy"),
        }
    }

    /// skewless-proxy's arguments for `target`: its mode and data path, listen on `listen`,
    /// the run's workers, every pod.
    fn proxy_args(&self, cmd: &mut Command, target: Target, listen: SocketAddr) {
        self.proxy_args_with(cmd, target, listen, self.args.proxy_threads);
    }

    /// [`Bench::proxy_args`] with `threads` workers.
    fn proxy_args_with(
        &self,
        cmd: &mut Command,
        target: Target,
        listen: SocketAddr,
        threads: usize,
    ) {
        match target {
            Target::Connection => {
                cmd.args(["--mode", "connection"]);
            }
            Target::Codec => {
                cmd.args(["--data-path", "codec"]);
            }
            _ => {}
        }
        cmd.arg("--listen")
            .arg(listen.to_string())
            .arg("--threads")
            .arg(threads.to_string());
        for p in &self.pods {
            cmd.arg("--endpoint").arg(format!("{}={}", p.name, p.addr));
        }
    }

    /// One run: closed loop, or open loop at `rate` calls per second.
    fn run_one(&self, cell: Cell, target: Target) -> anyhow::Result<Row> {
        let Cell {
            delay_ms,
            connections,
            rate,
            in_flight,
        } = cell;
        let (proxy, addr) = self.start_proxy(target)?;
        let a = &self.args;
        let mut cmd = Command::new(self.bin_dir.join("skewless-loadgen"));
        cmd.arg("run")
            .arg("--target")
            .arg(addr.to_string())
            .arg("--connections")
            .arg(connections.to_string())
            .arg("--warmup")
            .arg(a.warmup.to_string())
            .arg("--duration")
            .arg(a.duration.to_string())
            .arg("--json")
            .stdout(Stdio::piped());
        match rate {
            Some(r) => cmd.arg("--rate").arg(r.to_string()),
            None => cmd
                .arg("--in-flight")
                .arg(in_flight.unwrap_or(a.in_flight).to_string()),
        };
        let mut load = Proc::spawn("skewless-loadgen", &mut cmd)?;
        // The measured window of the proxy's CPU is the load generator's measured window.
        sleep(Duration::from_secs_f64(a.warmup));
        let pids = proxy.as_ref().map(|p| tree(p.pid())).unwrap_or_default();
        let (t0, i0) = (cpu_ticks(&pids), Instant::now());
        sleep(Duration::from_secs_f64(a.duration));
        let (t1, i1) = (cpu_ticks(&pids), Instant::now());
        let status = load.wait_for(Duration::from_secs(30))?;
        let mut out = String::new();
        if let Some(mut stdout) = load.child.stdout.take() {
            stdout.read_to_string(&mut out)?;
        }
        if !status.success() {
            bail!(
                "the load generator failed ({status}) against {}",
                self.args.name(target)
            );
        }
        let report: Report =
            serde_json::from_str(out.trim()).context("parsing the load generator's report")?;
        let mut row = Row {
            delay_ms,
            connections,
            target: self.args.name(target),
            ..Row::default()
        };
        row.set_load(&report, &self.pods[PODS - 1].name);
        if proxy.is_some() {
            let cores = (t1 - t0) as f64 / self.tck / (i1 - i0).as_secs_f64();
            row.cores_per_krps = Some(cores / (row.rps / 1000.0).max(1e-9));
            let pids = proxy.as_ref().map(|p| tree(p.pid())).unwrap_or_default();
            row.peak_rss_mib = Some(peak_rss_kib(&pids) as f64 / 1024.0);
        }
        drop(proxy);
        Ok(row)
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("binary directory")?
            .to_owned(),
    };
    let help = Command::new(bin_dir.join("skewless-proxy"))
        .arg("--help")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    args.connection_mode = help.contains("--mode");
    args.codec_path = help.contains("--data-path");
    args.check_targets()?;
    let work = std::env::temp_dir().join(format!("skewless-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = run(args, bin_dir, work.clone());
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// Starts echo pod `i` (`pod-{i}`); returns it, its address and its admin address.
fn spawn_pod(bin_dir: &std::path::Path, i: usize) -> anyhow::Result<(Proc, Pod, SocketAddr)> {
    let (addr, admin) = (free_addr()?, free_addr()?);
    let name = format!("pod-{i}");
    let mut p = Proc::spawn(
        &name,
        Command::new(bin_dir.join("skewless-echo"))
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--name")
            .arg(&name)
            .arg("--admin")
            .arg(admin.to_string())
            .stdout(Stdio::null()),
    )?;
    p.wait_listening(addr)?;
    p.wait_listening(admin)?;
    Ok((p, Pod { name, addr }, admin))
}

fn run(args: Args, bin_dir: PathBuf, work: PathBuf) -> anyhow::Result<()> {
    let mut pods = Vec::new();
    let mut admins = Vec::new();
    let mut echo = Vec::new();
    for i in 0..PODS {
        let (p, pod, admin) = spawn_pod(&bin_dir, i)?;
        echo.push(p);
        pods.push(pod);
        admins.push(admin);
    }
    let mut bench = Bench {
        bin_dir,
        work,
        pods,
        tck: clk_tck(),
        args,
    };
    let counted = if bench.args.instructions || bench.args.instructions_only {
        // All pods healthy: the counts are of the proxy's own work per call.
        set_delay(admins[PODS - 1], 0)?;
        let table = counted_table(&bench.count_builds()?);
        println!("{table}");
        Some(table)
    } else {
        None
    };
    let a = &bench.args;
    if a.instructions_only {
        if let Some(table) = &counted {
            write_counted(a, table)?;
        }
    } else if !a.convergence_only && !a.h2load_only {
        grid(&bench, &admins, counted.as_deref())?;
    }
    let a = &bench.args;
    if a.h2load_only || !(a.no_h2load || a.instructions_only || a.convergence_only) {
        // All pods healthy: the figure is the proxies' own work per request.
        set_delay(admins[PODS - 1], 0)?;
        h2load::section(&bench)?;
    }
    if bench.args.convergence || bench.args.convergence_only {
        // Seed 001 needs ten pods, all healthy.
        set_delay(admins[PODS - 1], 0)?;
        for i in PODS..rotation::AFTER_PODS {
            let (p, pod, _) = spawn_pod(&bench.bin_dir, i)?;
            echo.push(p);
            bench.pods.push(pod);
        }
        convergence(&bench)?;
    }
    drop(echo);
    Ok(())
}

/// The closed-loop grid and the open-loop section, their tables and charts.
fn grid(bench: &Bench, admins: &[SocketAddr], counted: Option<&str>) -> anyhow::Result<()> {
    let started = Instant::now();
    let a = &bench.args;
    let plan = plan(a);
    let open_runs = if a.no_open {
        0
    } else {
        a.repeats_for(a.open_connections) * a.choose(&OPEN_TARGETS).len()
    };
    let low_cell = Cell {
        delay_ms: 0,
        connections: 1,
        rate: None,
        in_flight: Some(1),
    };
    let low_order = if a.no_low_load {
        Vec::new()
    } else {
        // This tree's builds only: the added latency is judged for connection mode, and the
        // before/after comparison of other builds is the grid's CPU per call.
        let mut targets = a.choose(&LOW_TARGETS);
        targets.retain(|t| !matches!(t, Target::Build(_)));
        interleave(&[(low_cell, targets, a.repeats_for(1))])
    };
    let runs =
        plan.iter().map(|(_, cells)| cells.len()).sum::<usize>() + open_runs + low_order.len();
    eprintln!(
        "{runs} runs of {} s + {} s warm-up: about {:.0} min",
        a.duration,
        a.warmup,
        runs as f64 * (a.warmup + a.duration + RUN_OVERHEAD_S) / 60.0
    );
    let mut rows = Vec::new();
    for (delay, cells) in &plan {
        set_delay(admins[PODS - 1], *delay)?;
        for (cell, t) in cells {
            eprint!("[{}/{runs}] ", rows.len() + 1);
            let row = bench.run_logged(*cell, *t)?;
            push_run(&mut rows, row);
        }
    }
    // Kept apart from the grid's rows: a cell of its own (1 in flight) at 0 ms and 1 connection.
    let mut low_rows = Vec::new();
    if !low_order.is_empty() {
        set_delay(admins[PODS - 1], 0)?;
        for (cell, t) in low_order {
            eprint!("[{}/{runs}] ", rows.len() + low_rows.len() + 1);
            let row = bench.run_logged(cell, t)?;
            push_run(&mut low_rows, row);
        }
    }
    if !a.no_open {
        let rate = match a.open_rate {
            Some(r) => r,
            None => a.open_fraction * bench.haproxy_rps(&rows, admins)?,
        };
        set_delay(admins[PODS - 1], a.open_delay)?;
        let cell = Cell {
            delay_ms: a.open_delay,
            connections: a.open_connections,
            rate: Some(rate),
            in_flight: None,
        };
        let order = interleave(&[(
            cell,
            a.choose(&OPEN_TARGETS),
            a.repeats_for(cell.connections),
        )]);
        for (cell, t) in order {
            eprint!("[{}/{runs}] ", rows.len() + low_rows.len() + 1);
            let row = bench.run_logged(cell, t)?;
            push_run(&mut rows, row);
        }
    }
    let cells = summarize(&rows);
    let low = (!low_rows.is_empty()).then(|| low_load_table(&low_rows));
    let connection = connection_targets_table(&cells);
    let connection = (connection.lines().count() > 2).then_some(connection);
    let table = markdown_table(&cells);
    let (targets, all_met) = targets_table(&cells);
    let open = open_table(&cells);
    let open_targets = open_targets_table(&cells);
    let builds = (!a.builds.is_empty()).then(|| builds_table(&rows));
    println!("{table}\n{targets}");
    for t in [&connection, &low, &builds].into_iter().flatten() {
        println!("{t}");
    }
    if !a.no_open {
        println!("{open}\n{open_targets}");
    }
    if targets.lines().count() > 2 {
        println!("all closed-loop issue-4 targets met: {all_met}");
    }
    println!("done in {:.0} s", started.elapsed().as_secs_f64());
    if let Some(path) = &a.write {
        let doc = std::fs::read_to_string(path).unwrap_or_default();
        let dir = path.parent().context("the results file has no directory")?;
        let charts: [Chart; 3] = [
            (
                "p99",
                "Closed loop: p99 latency, median of runs (log scale)",
                "ms",
                |r| r.p99_ms,
                true,
                false,
            ),
            (
                "rps",
                "Closed loop: throughput, median of runs",
                "RPS",
                |r| r.rps.median,
                false,
                false,
            ),
            (
                "open-p99",
                "Open loop at equal offered load: p99 latency (log scale)",
                "ms",
                |r| r.p99_ms,
                true,
                true,
            ),
        ];
        for (chart, title, unit, value, log, open_loop) in charts {
            let file = format!("{}-{chart}.svg", a.chart_prefix);
            let these: Vec<Summary> = cells
                .iter()
                .filter(|c| c.offered_rps.is_some() == open_loop)
                .cloned()
                .collect();
            if these.is_empty() {
                continue;
            }
            let svg = bar_chart_svg(title, unit, &these, value, log)
                .with_context(|| format!("drawing {file}"))?;
            std::fs::write(dir.join(&file), svg).with_context(|| format!("writing {file}"))?;
        }
        let section = section(
            a,
            &table,
            &targets,
            (!a.no_open).then_some((&open, &open_targets)),
            Extra {
                connection: connection.as_deref(),
                low: low.as_deref(),
                builds: builds.as_deref(),
                counted,
            },
        );
        std::fs::write(path, replace_section(&doc, &a.section, &section))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// The rotation-convergence runs (see `rotation`), interleaved over the targets, their table
/// and chart, written to the "Rotation convergence" section of --write.
fn convergence(bench: &Bench) -> anyhow::Result<()> {
    let a = &bench.args;
    let python = skewless_testbed::grpc::python();
    let gen_dir = skewless_testbed::grpc::generate_stubs()
        .context("generating the Python stubs (is the venv installed? `cargo xtask setup`)")?;
    let script = skewless_testbed::grpc::script("rotation_client.py");
    let proxy = bench.bin_dir.join("skewless-proxy");
    // Request mode spreads at once; connection mode has to rotate the pinned connections.
    let mut targets: Vec<(String, Vec<String>)> = vec![(a.name(Target::Skewless), Vec::new())];
    if a.connection_mode {
        let args = |extra: &[&str]| -> Vec<String> {
            ["--mode", "connection"]
                .iter()
                .chain(extra)
                .map(|s| (*s).to_owned())
                .collect()
        };
        // The annotations' defaults (hold 30 s, 6 rotations a minute, connections younger
        // than 10 s left alone), and a Service tuned to move faster.
        targets.push((a.name(Target::Connection), args(&[])));
        targets.push((
            format!("{} (hold 5 s, 30/min)", a.name(Target::Connection)),
            args(&[
                "--hold-time",
                "5",
                "--max-rotations-per-minute",
                "30",
                "--min-connection-age",
                "2",
            ]),
        ));
    }
    targets.retain(|(name, _)| {
        a.targets.is_empty() || a.targets.iter().any(|t| name.split(' ').next() == Some(t))
    });
    if targets.is_empty() {
        bail!("--targets leaves no convergence target (skewless, skewless-connection)");
    }
    let runs = a.convergence_repeats.max(1) * targets.len();
    eprintln!(
        "{runs} convergence runs of {} s: about {:.0} min",
        a.convergence_before + a.convergence_after,
        runs as f64 * (a.convergence_before + a.convergence_after + 2.0) / 60.0
    );
    let mut outcomes = Vec::new();
    for pass in 0..a.convergence_repeats.max(1) {
        let mut order = targets.clone();
        let n = pass % order.len();
        order.rotate_left(n);
        for (target, mode_args) in order {
            let plan = rotation::Plan {
                proxy: (&proxy, mode_args),
                target,
                pods: &bench.pods,
                python: (&python, &gen_dir, &script),
                channels: a.convergence_channels,
                concurrency: a.convergence_concurrency,
                before: a.convergence_before,
                after: a.convergence_after,
                threads: a.proxy_threads,
            };
            let outcome = rotation::run(&plan)?;
            rotation::log(&outcome);
            outcomes.push(outcome);
        }
    }
    let table = rotation::table(&outcomes);
    println!("{table}");
    let Some(path) = &a.write else {
        return Ok(());
    };
    let dir = path.parent().context("the results file has no directory")?;
    // One line per target: its first run.
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for o in &outcomes {
        if !series.iter().any(|(t, _)| *t == o.target) {
            series.push((o.target.clone(), o.convergence.skew.clone()));
        }
    }
    let file = format!("{}-convergence.svg", a.chart_prefix);
    let svg = skew_chart_svg(
        "Skew after the scale-up from 2 to 10 pods (1 s windows, first run of each target)",
        &series,
        rotation::THRESHOLD,
    )
    .with_context(|| format!("drawing {file}"))?;
    std::fs::write(dir.join(&file), svg).with_context(|| format!("writing {file}"))?;
    let doc = std::fs::read_to_string(path).unwrap_or_default();
    let section = format!(
        "{CONVERGENCE}\n\n\
         Run of {date} (`{cmd}`): {ch} pick_first grpcio channels (`testing/py/rotation_client.py`, \
         each one HTTP/2 connection, {conc} calls in flight on each) through skewless-proxy \
         ({t} workers) with pods 0-1 as its endpoints; after {before} s the benchmark sends \
         it the set of pods 0-9 (the seed-001 scale-up, timed at that moment) and the clients \
         go on for {after} s. From the clients' own tallies in 250 ms buckets, the skew of a \
         1 s window is the largest pod's share over the fair share of the 10 pods (1.0 is even, \
         5.0 is two pods taking everything). Times run from the scale-up to the start of the \
         first window that shows it (to the 250 ms bucket): every pod receiving calls, and the \
         skew under {th} in that window and every later one (`for good`); the same with 5 s \
         windows beside it, which average out the clients' own unevenness (with 10 connections \
         on 10 pods, one channel 50% faster than the others for a second is already skew 1.5 \
         in a 1 s window, however well the connections are placed). `connection moves`: \
         times a client channel's answering pod changed, i.e. its connection was rotated and \
         placed elsewhere (request mode moves every call). Runs are interleaved over the \
         targets.\n\n\
         {table}\n\
         ![skew after the scale-up]({file})\n",
        date = utc_now(),
        cmd = a.command,
        ch = a.convergence_channels,
        conc = a.convergence_concurrency,
        t = a.proxy_threads,
        before = a.convergence_before,
        after = a.convergence_after,
        th = rotation::THRESHOLD,
    );
    std::fs::write(path, replace_section(&doc, CONVERGENCE, &section))
        .with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

const CONVERGENCE: &str = "## Rotation convergence";

fn utc_now() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// Adds `row` to `rows`, numbered as the next repeat of its cell and target.
fn push_run(rows: &mut Vec<Row>, mut row: Row) {
    row.repeat = rows
        .iter()
        .filter(|r| r.target == row.target && r.same_cell(&row))
        .count();
    rows.push(row);
}

/// The low-load runs' targets: the added latency of each kind of proxy over direct.
const LOW_TARGETS: [Target; 4] = [
    Target::DirectHealthy,
    Target::L4,
    Target::Haproxy,
    Target::Skewless,
];

/// The tables beyond the grid's, when the run has them.
struct Extra<'a> {
    connection: Option<&'a str>,
    low: Option<&'a str>,
    builds: Option<&'a str>,
    counted: Option<&'a str>,
}

/// The L7 targets of the open-loop section, with direct-healthy as the baseline.
const OPEN_TARGETS: [Target; 4] = [
    Target::DirectHealthy,
    Target::Haproxy,
    Target::Nginx,
    Target::Skewless,
];

impl Args {
    fn repeats_for(&self, connections: usize) -> usize {
        if self.repeat_connections.contains(&connections) {
            self.repeats.max(1)
        } else {
            1
        }
    }
}

/// The closed-loop runs in order, per delay (the slow pod's delay is set once per delay),
/// interleaved over the repeats by [`interleave`].
fn plan(a: &Args) -> Vec<(u64, Vec<(Cell, Target)>)> {
    a.delays
        .iter()
        .map(|&delay| {
            let cells: Vec<(Cell, Vec<Target>, usize)> = a
                .connections
                .iter()
                .map(|&conns| {
                    let mut targets = vec![Target::DirectHealthy, Target::DirectSlow];
                    // Per-connection balancing needs connections to balance; at one it runs
                    // only as connection mode's peer (both relay one connection, and issue
                    // 13 compares their CPU per call).
                    if conns > 1 || a.runs_connection_mode() {
                        targets.push(Target::L4);
                    }
                    targets.extend([Target::Haproxy, Target::Nginx, Target::Skewless]);
                    let targets = a.choose(&targets);
                    let cell = Cell {
                        delay_ms: delay,
                        connections: conns,
                        rate: None,
                        in_flight: None,
                    };
                    (cell, targets, a.repeats_for(conns))
                })
                .collect();
            (delay, interleave(&cells))
        })
        .collect()
}

impl Bench {
    fn run_logged(&self, cell: Cell, t: Target) -> anyhow::Result<Row> {
        let Cell {
            delay_ms: delay,
            connections: conns,
            rate,
            in_flight,
        } = cell;
        let row = self.run_one(cell, t).with_context(|| {
            format!(
                "{} at {delay} ms, {conns} conn(s){}",
                self.args.name(t),
                rate.map(|r| format!(", open loop at {r:.0}/s"))
                    .unwrap_or_default()
            )
        })?;
        eprintln!(
            "delay {delay:>3} ms conns {conns} {:<19}{} {:>7.0} rps  p50 {:>7.2}  p99 {:>7.2}  p99.9 {:>7.2} ms  slow {:>5.1}%  errors {}{}{}",
            row.target,
            rate.map(|r| format!(" open {r:.0}/s"))
                .or(in_flight.map(|n| format!(" {n} in flight")))
                .unwrap_or_default(),
            row.rps,
            row.p50_ms,
            row.p99_ms,
            row.p999_ms,
            row.slow_share * 100.0,
            row.errors,
            if rate.is_some() {
                format!(
                    "  late {} not sent {} unfinished {}",
                    row.late, row.not_sent, row.unfinished
                )
            } else {
                String::new()
            },
            match (row.cores_per_krps, row.peak_rss_mib) {
                (Some(c), Some(m)) => format!("  {c:.3} cores/1k rps  {m:.1} MiB"),
                _ => String::new(),
            }
        );
        Ok(row)
    }

    /// HAProxy's closed-loop median RPS at the open-loop delay and connections, from the grid
    /// when it has that cell, else from one calibration run (not reported).
    fn haproxy_rps(&self, rows: &[Row], admins: &[SocketAddr]) -> anyhow::Result<f64> {
        let a = &self.args;
        let from_grid: Vec<f64> = rows
            .iter()
            .filter(|r| {
                r.target == self.args.name(Target::Haproxy)
                    && r.offered_rps.is_none()
                    && r.delay_ms == a.open_delay
                    && r.connections == a.open_connections
            })
            .map(|r| r.rps)
            .collect();
        if let Some(s) = skewless_bench::Spread::of(from_grid) {
            return Ok(s.median);
        }
        eprintln!(
            "calibrating the open-loop rate: HAProxy closed loop at {} ms",
            a.open_delay
        );
        set_delay(admins[PODS - 1], a.open_delay)?;
        let cell = Cell {
            delay_ms: a.open_delay,
            connections: a.open_connections,
            rate: None,
            in_flight: None,
        };
        Ok(self.run_logged(cell, Target::Haproxy)?.rps)
    }
}

fn section(
    a: &Args,
    table: &str,
    targets: &str,
    open: Option<(&String, &String)>,
    extra: Extra<'_>,
) -> String {
    let Extra {
        connection,
        low,
        builds,
        counted,
    } = extra;
    let date = utc_now();
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    // The cargo profile the binaries were built with (`dist` from `cargo xtask bench`).
    let profile = a
        .bin_dir
        .clone()
        .or_else(|| std::env::current_exe().ok()?.parent().map(Into::into))
        .and_then(|d| Some(d.file_name()?.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let repeated: Vec<String> = a
        .repeat_connections
        .iter()
        .filter(|c| a.connections.contains(c))
        .map(ToString::to_string)
        .collect();
    let repeats = if a.repeats > 1 && !repeated.is_empty() {
        let which = if repeated.len() == a.connections.len() {
            "Every cell".to_owned()
        } else {
            format!(
                "Cells with {} connection(s) (the others once)",
                repeated.join("/")
            )
        };
        format!(
            "{which} ran {} times, interleaved (each pass runs every cell once, the target \
             order rotated from pass to pass); RPS and CPU show the median and the min–max \
             range, latencies are the median of the runs' percentiles, peak RSS the largest \
             run's, errors the sum, and the verdicts use the medians.",
            a.repeats
        )
    } else {
        "Every cell ran once.".to_owned()
    };
    let only = if a.targets.is_empty() {
        String::new()
    } else {
        format!(" Targets run: {} (`--targets`).", a.targets.join(", "))
    };
    let second = a
        .builds
        .iter()
        .map(|(label, path)| format!(" `skewless@{label}` is `{}`.", path.display()))
        .collect::<String>();
    // The issue-4 verdicts need skewless and HAProxy in the run: header lines only otherwise.
    let targets = if targets.lines().count() > 2 {
        format!(
            "Targets (issue 4), skewless against the peers of the same run, per cell:\n\n{targets}"
        )
    } else {
        String::new()
    };
    let mut out = format!(
        "{heading}\n\n\
         Run of {date} (`{cmd}`), {cpus} CPUs, everything on 127.0.0.1: 5 `skewless-echo` pods \
         (the 5th delayed by the row's delay), `skewless-loadgen run` ({w} s warm-up, {d} s \
         measured per run), and one proxy at a time, started fresh for its run with {t} worker \
         threads/processes; our binaries from `target/{profile}`. `direct-healthy` and `direct-slow` load one pod without a proxy: \
         the two outcomes of an L4 coin flip, never averaged; `l4-roundrobin` (HAProxy `mode \
         tcp`) is per-connection balancing, run with more than one connection (and with one \
         beside connection mode, which relays one connection too). Ratios divide by \
         the direct-healthy cell of the same delay and connections. CPU is the proxy's \
         utime+stime over the measured window (all its processes), as cores per 1,000 RPS; \
         peak RSS is `VmHWM` summed over its processes.{only}{second} {repeats}\n\n\
         ### Closed loop\n\n\
         {inf} calls in flight per connection (like ghz `-c`), a call starts when one ends.\n\n\
         {table}\n\
         ![p99 by target]({prefix}-p99.svg) ![RPS by target]({prefix}-rps.svg)\n\n\
         {targets}",
        heading = a.section,
        prefix = a.chart_prefix,
        cmd = a.command,
        inf = a.in_flight,
        w = a.warmup,
        d = a.duration,
        t = a.proxy_threads,
    );
    if let Some((open, open_targets)) = open {
        let rate = a.open_rate.map_or_else(
            || {
                format!(
                    "{:.0}% of HAProxy's closed-loop median RPS at {} ms and {} connection(s) \
                     in this run",
                    a.open_fraction * 100.0,
                    a.open_delay,
                    a.open_connections
                )
            },
            |r| format!("{r:.0} calls/s (`--open-rate`)"),
        );
        let _ = write!(
            out,
            "\n### Open loop at equal offered load\n\n\
             Every target gets the same fixed rate, {rate}, dealt round-robin over the \
             connections; each call's latency counts from its intended send time, so a target \
             that falls behind is charged for every call it delayed (no coordinated omission). \
             `late`: calls sent more than 5 ms after their intended time; `not sent`: due in \
             the window but never sent (at most 1,000 outstanding per connection); \
             `unfinished`: no answer within 5 s after the window. `direct-healthy` is one pod \
             without a proxy while the proxies spread the rate over five, so a rate above one \
             pod's capacity overloads the baseline itself (it then shows `not sent`).\n\n\
             {open}\n\
             ![open-loop p99 by target]({prefix}-open-p99.svg)\n\n\
             {open_targets}",
            prefix = a.chart_prefix,
        );
    }
    if let Some(connection) = connection {
        let _ = write!(
            out,
            "\nConnection mode (issue 13), against HAProxy h2 and tcp and request mode of the \
             same run, per cell (medians):\n\n{connection}"
        );
    }
    if let Some(low) = low {
        let _ = write!(
            out,
            "\n### Low load\n\n\
             One connection with one call in flight (each call starts when the last ends), no \
             slow pod: the latency each proxy adds to a call. `p50 added` is the median \
             (min–max) over the passes of the target's p50 minus direct-healthy's in the same \
             pass.\n\n{low}"
        );
    }
    if let Some(builds) = builds {
        let _ = write!(
            out,
            "\n### Second builds against this one\n\n\
             Each `skewless@LABEL` target is another build of `skewless-proxy`, run in the same \
             cells and passes as `skewless`. CPU per call is the proxy's CPU over the measured \
             window divided by the calls served (cores per 1,000 RPS x 1,000, in \
             microseconds); `skewless / build, per pair` is the median (min–max) of the ratios \
             of the two runs of each pass, which holds when the machine's speed drifts between \
             passes; `95% interval of the median pair` is a distribution-free interval (the \
             order statistics of the pair ratios that a binomial with p = 1/2 allows) holding \
             the true median ratio with at least 95% confidence, shown from 6 pairs on; `pairs \
             over` counts the single pairs above the bar. The bar: CPU per call at most \
             {bar:.2}x the build's (issues 10 and 11), judged by the median; it is shown \
             beyond this machine's noise only where the interval's upper end is within it \
             too.\n\n\
             {builds}",
            bar = skewless_bench::report::BUILD_CPU_BAR,
        );
    }
    if let Some(counted) = counted {
        let _ = write!(out, "\n{}", counted_text(a, counted));
    }
    out
}

/// The load-independent subsection: how the counts were made, and their table.
fn counted_text(a: &Args, table: &str) -> String {
    format!(
        "### Instructions and syscalls per call (load-independent)\n\n\
         With all pods healthy (before the grid, if any), {runs} run(s) per build, interleaved. \
         Instructions: the build's skewless-proxy ({t} workers) under `valgrind \
         --tool=callgrind`, warmed up by {warm} s of closed loop, its counters zeroed \
         (`callgrind_control -z`), then `skewless-loadgen` with 1 connection x {inf} calls in \
         flight for {d} s and no warm-up window (every call it sends is counted), then \
         `callgrind_control -d`: the dump's user-space instructions (`Ir`) over the calls \
         served. Clock reads: calls into `clock_gettime` in the same dump (under valgrind it \
         is a syscall, natively a vDSO call: counted, not timed). Syscalls: the native build \
         at an offered {rate:.0} calls/s (1 connection, open loop) for {d} s, counted with \
         `perf stat -e raw_syscalls:sys_enter -p PID` over the load generator's window. Under \
         callgrind the proxy is the bottleneck (it serves a few thousand calls a second), so \
         batching is like the closed-loop runs'. These counts do not move with the machine's \
         load, but they leave out what an instruction or a syscall costs (caches, locks, \
         the kernel's own work): CPU time per call is the bar's measure; these are beside it.\n\n\
         {table}",
        runs = a.instructions_runs.max(1),
        t = a.proxy_threads,
        warm = counting::CALLGRIND_WARMUP_S,
        inf = a.in_flight,
        d = a.instructions_duration,
        rate = a.instructions_rate,
    )
}

/// `--instructions-only`: the counts alone, as the section `--section` of `--write`.
fn write_counted(a: &Args, table: &str) -> anyhow::Result<()> {
    let Some(path) = &a.write else {
        return Ok(());
    };
    let doc = std::fs::read_to_string(path).unwrap_or_default();
    let section = format!(
        "{}\n\nRun of {} (`{}`).\n\n{}",
        a.section,
        utc_now(),
        a.command,
        counted_text(a, table)
    );
    std::fs::write(path, replace_section(&doc, &a.section, &section))
        .with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}
