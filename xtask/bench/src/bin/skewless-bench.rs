//! `skewless-bench`: the side-by-side proxy benchmark (issue 4), on 127.0.0.1 only.
//!
//! Starts 5 `skewless-echo` pods (the 5th one slowed down by the run's delay), then for every
//! delay and client connection count loads, with `skewless-loadgen run --json` in closed loop:
//! one healthy pod directly, the slow pod directly (the two outcomes of an L4 coin flip, never
//! averaged), an L4 per-connection balancer (HAProxy `mode tcp`, only with more than one
//! connection), HAProxy (h2, leastconn), nginx (grpc_pass, least_conn) and `skewless-proxy`.
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

use std::fmt::Write as _;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use skewless_bench::sampling::{clk_tck, cpu_ticks, peak_rss_kib, tree};
use skewless_bench::{
    Pod, Row, Summary, bar_chart_svg, haproxy_config, interleave, markdown_table, nginx_config,
    open_table, open_targets_table, replace_section, summarize, targets_table,
};
use skewless_loadgen::Report;

const PODS: usize = 5;
const SECTION: &str = "## Proxies side by side";

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
}

/// A process this benchmark started; ended by its pid (SIGTERM, then SIGKILL) when dropped.
struct Proc {
    name: String,
    child: Child,
}

impl Proc {
    fn spawn(name: &str, cmd: &mut Command) -> anyhow::Result<Self> {
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({cmd:?})"))?;
        Ok(Self {
            name: name.to_owned(),
            child,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until `addr` accepts connections, failing if the process exits first.
    fn wait_listening(&mut self, addr: SocketAddr) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("{} exited before listening: {status}", self.name);
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{} is not listening on {addr} after 10 s", self.name);
            }
            sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let pids = tree(self.pid());
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            sleep(Duration::from_millis(20));
        }
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            eprintln!("{} ignored SIGTERM; killing it", self.name);
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // Workers of a multi-process proxy that outlived their master (started by it, so
        // by this benchmark).
        for pid in pids.into_iter().skip(1) {
            if Path::new(&format!("/proc/{pid}")).exists() {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
    }
}

fn free_addr() -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?)
}

fn set_delay(admin: SocketAddr, ms: u64) -> anyhow::Result<()> {
    let mut s = TcpStream::connect_timeout(&admin, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(
        s,
        "PUT /delay/{ms} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    if !reply.starts_with("HTTP/1.1 2") {
        bail!("setting the delay at {admin}: {reply:?}");
    }
    Ok(())
}

fn find_tool(name: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
}

#[derive(Clone, Copy, PartialEq)]
enum Target {
    DirectHealthy,
    DirectSlow,
    L4,
    Haproxy,
    Nginx,
    Skewless,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::DirectHealthy => "direct-healthy",
            Target::DirectSlow => "direct-slow",
            Target::L4 => "l4-roundrobin",
            Target::Haproxy => "haproxy",
            Target::Nginx => "nginx",
            Target::Skewless => "skewless",
        }
    }
}

/// What a run loads: the slow pod's delay, client connections, and the open-loop rate (None:
/// closed loop).
#[derive(Clone, Copy, PartialEq)]
struct Cell {
    delay_ms: u64,
    connections: usize,
    rate: Option<f64>,
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
        let threads = self.args.proxy_threads;
        let listen = free_addr()?;
        let mut proc = match target {
            Target::DirectHealthy => return Ok((None, self.pods[0].addr)),
            Target::DirectSlow => return Ok((None, self.pods[PODS - 1].addr)),
            Target::L4 | Target::Haproxy => {
                let cfg = self.work.join(format!("{}.cfg", target.name()));
                std::fs::write(
                    &cfg,
                    haproxy_config(listen, &self.pods, threads, target == Target::L4),
                )?;
                let bin = find_tool("haproxy").context("haproxy is not installed")?;
                Proc::spawn(
                    target.name(),
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
            Target::Skewless => {
                let mut cmd = Command::new(self.bin_dir.join("skewless-proxy"));
                cmd.arg("--listen")
                    .arg(listen.to_string())
                    .arg("--threads")
                    .arg(threads.to_string());
                for p in &self.pods {
                    cmd.arg("--endpoint").arg(format!("{}={}", p.name, p.addr));
                }
                Proc::spawn("skewless-proxy", cmd.stdout(Stdio::null()))?
            }
        };
        proc.wait_listening(listen)?;
        Ok((Some(proc), listen))
    }

    /// One run: closed loop, or open loop at `rate` calls per second.
    fn run_one(&self, cell: Cell, target: Target) -> anyhow::Result<Row> {
        let Cell {
            delay_ms,
            connections,
            rate,
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
            None => cmd.arg("--in-flight").arg(a.in_flight.to_string()),
        };
        let mut load = Proc::spawn("skewless-loadgen", &mut cmd)?;
        // The measured window of the proxy's CPU is the load generator's measured window.
        sleep(Duration::from_secs_f64(a.warmup));
        let pids = proxy.as_ref().map(|p| tree(p.pid())).unwrap_or_default();
        let (t0, i0) = (cpu_ticks(&pids), Instant::now());
        sleep(Duration::from_secs_f64(a.duration));
        let (t1, i1) = (cpu_ticks(&pids), Instant::now());
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = load.child.try_wait()? {
                break s;
            }
            if Instant::now() > deadline {
                bail!("the load generator did not finish within 30 s of its window");
            }
            sleep(Duration::from_millis(20));
        };
        let mut out = String::new();
        if let Some(mut stdout) = load.child.stdout.take() {
            stdout.read_to_string(&mut out)?;
        }
        if !status.success() {
            bail!(
                "the load generator failed ({status}) against {}",
                target.name()
            );
        }
        let report: Report =
            serde_json::from_str(out.trim()).context("parsing the load generator's report")?;
        let mut row = Row {
            delay_ms,
            connections,
            target: target.name().to_owned(),
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
    let args = Args::parse();
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("binary directory")?
            .to_owned(),
    };
    let work = std::env::temp_dir().join(format!("skewless-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = run(args, bin_dir, work.clone());
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn run(args: Args, bin_dir: PathBuf, work: PathBuf) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut pods = Vec::new();
    let mut admins = Vec::new();
    let mut echo = Vec::new();
    for i in 0..PODS {
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
        echo.push(p);
        pods.push(Pod { name, addr });
        admins.push(admin);
    }
    let bench = Bench {
        bin_dir,
        work,
        pods,
        tck: clk_tck(),
        args,
    };
    let a = &bench.args;
    let plan = plan(a);
    let open_runs = if a.no_open {
        0
    } else {
        a.repeats_for(a.open_connections) * OPEN_TARGETS.len()
    };
    let runs = plan.iter().map(|(_, cells)| cells.len()).sum::<usize>() + open_runs;
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
            rows.push(bench.run_logged(*cell, *t)?);
        }
    }
    if !a.no_open {
        let rate = match a.open_rate {
            Some(r) => r,
            None => a.open_fraction * bench.haproxy_rps(&rows, &admins)?,
        };
        set_delay(admins[PODS - 1], a.open_delay)?;
        let cell = Cell {
            delay_ms: a.open_delay,
            connections: a.open_connections,
            rate: Some(rate),
        };
        let order = interleave(&[(cell, OPEN_TARGETS.to_vec(), a.repeats_for(cell.connections))]);
        for (cell, t) in order {
            eprint!("[{}/{runs}] ", rows.len() + 1);
            rows.push(bench.run_logged(cell, t)?);
        }
    }
    drop(echo);
    let cells = summarize(&rows);
    let table = markdown_table(&cells);
    let (targets, all_met) = targets_table(&cells);
    let open = open_table(&cells);
    let open_targets = open_targets_table(&cells);
    println!("{table}\n{targets}");
    if !a.no_open {
        println!("{open}\n{open_targets}");
    }
    println!(
        "all closed-loop targets met: {all_met} ({:.0} s)",
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = &a.write {
        let doc = std::fs::read_to_string(path).unwrap_or_default();
        let dir = path.parent().context("the results file has no directory")?;
        let charts: [Chart; 3] = [
            (
                "bench-p99.svg",
                "Closed loop: p99 latency, median of runs (log scale)",
                "ms",
                |r| r.p99_ms,
                true,
                false,
            ),
            (
                "bench-rps.svg",
                "Closed loop: throughput, median of runs",
                "RPS",
                |r| r.rps.median,
                false,
                false,
            ),
            (
                "bench-open-p99.svg",
                "Open loop at equal offered load: p99 latency (log scale)",
                "ms",
                |r| r.p99_ms,
                true,
                true,
            ),
        ];
        for (file, title, unit, value, log, open_loop) in charts {
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
            std::fs::write(dir.join(file), svg).with_context(|| format!("writing {file}"))?;
        }
        let section = section(
            a,
            &table,
            &targets,
            (!a.no_open).then_some((&open, &open_targets)),
        );
        std::fs::write(path, replace_section(&doc, SECTION, &section))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
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
                    if conns > 1 {
                        targets.push(Target::L4);
                    }
                    targets.extend([Target::Haproxy, Target::Nginx, Target::Skewless]);
                    let cell = Cell {
                        delay_ms: delay,
                        connections: conns,
                        rate: None,
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
        } = cell;
        let row = self.run_one(cell, t).with_context(|| {
            format!(
                "{} at {delay} ms, {conns} conn(s){}",
                t.name(),
                rate.map(|r| format!(", open loop at {r:.0}/s"))
                    .unwrap_or_default()
            )
        })?;
        eprintln!(
            "delay {delay:>3} ms conns {conns} {:<15}{} {:>7.0} rps  p50 {:>7.2}  p99 {:>7.2}  p99.9 {:>7.2} ms  slow {:>5.1}%  errors {}{}{}",
            row.target,
            rate.map(|r| format!(" open {r:.0}/s")).unwrap_or_default(),
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
                r.target == Target::Haproxy.name()
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
        };
        Ok(self.run_logged(cell, Target::Haproxy)?.rps)
    }
}

fn section(a: &Args, table: &str, targets: &str, open: Option<(&String, &String)>) -> String {
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .unwrap_or_default();
    let date = date.trim();
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
    let mut out = format!(
        "{SECTION}\n\n\
         Run of {date} (`{cmd}`), {cpus} CPUs, everything on 127.0.0.1: 5 `skewless-echo` pods \
         (the 5th delayed by the row's delay), `skewless-loadgen run` ({w} s warm-up, {d} s \
         measured per run), and one proxy at a time, started fresh for its run with {t} worker \
         threads/processes; our binaries from `target/{profile}`. `direct-healthy` and `direct-slow` load one pod without a proxy: \
         the two outcomes of an L4 coin flip, never averaged; `l4-roundrobin` (HAProxy `mode \
         tcp`) is per-connection balancing, run with more than one connection. Ratios divide by \
         the direct-healthy cell of the same delay and connections. CPU is the proxy's \
         utime+stime over the measured window (all its processes), as cores per 1,000 RPS; \
         peak RSS is `VmHWM` summed over its processes. {repeats}\n\n\
         ### Closed loop\n\n\
         {inf} calls in flight per connection (like ghz `-c`), a call starts when one ends.\n\n\
         {table}\n\
         ![p99 by target](bench-p99.svg) ![RPS by target](bench-rps.svg)\n\n\
         Targets (issue 4), skewless against the peers of the same run, per cell:\n\n\
         {targets}",
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
             ![open-loop p99 by target](bench-open-p99.svg)\n\n\
             {open_targets}"
        );
    }
    out
}
