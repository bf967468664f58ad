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

mod args;
mod convergence;
mod counting;
mod h2load;
mod procs;
mod report;
mod rotation;

use std::io::Read as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use skewless_bench::counted::counted_table;
use skewless_bench::sampling::{clk_tck, cpu_ticks, peak_rss_kib, tree};
use skewless_bench::{
    Pod, Row, Summary, bar_chart_svg, builds_table, connection_targets_table, haproxy_config,
    interleave, low_load_table, markdown_table, nginx_config, open_table, open_targets_table,
    replace_section, summarize, targets_table,
};
use skewless_loadgen::Report;

use crate::args::Args;
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
            report::write_counted(a, table)?;
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
        convergence::convergence(&bench)?;
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
        let section = report::section(
            a,
            &table,
            &targets,
            (!a.no_open).then_some((&open, &open_targets)),
            report::Extra {
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

/// The L7 targets of the open-loop section, with direct-healthy as the baseline.
const OPEN_TARGETS: [Target; 4] = [
    Target::DirectHealthy,
    Target::Haproxy,
    Target::Nginx,
    Target::Skewless,
];

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
