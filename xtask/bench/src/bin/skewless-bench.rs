//! `skewless-bench`: the side-by-side proxy benchmark (issue 4), on 127.0.0.1 only.
//!
//! Starts 5 `skewless-echo` pods (the 5th one slowed down by the run's delay), then for every
//! delay and client connection count loads, with `skewless-loadgen run --json`: one healthy pod
//! directly, the slow pod directly (the two outcomes of an L4 coin flip, never averaged), an
//! L4 per-connection balancer (HAProxy `mode tcp`, only with more than one connection), HAProxy
//! (h2, leastconn), nginx (grpc_pass, least_conn) and `skewless-proxy`. Each proxy is started
//! fresh for its run; its CPU comes from `/proc/<pid>/stat` over the measured window and its
//! peak RSS from `VmHWM`, both summed over its processes. Every process started here is ended
//! by its pid when its run ends, also on errors.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use skewless_bench::{
    Pod, Row, bar_chart_svg, haproxy_config, markdown_table, nginx_config, replace_section,
    stat_cpu_ticks, stat_ppid, status_vm_hwm_kib, targets_table,
};

const PODS: usize = 5;
const SECTION: &str = "## Proxies side by side";

/// File name, title, unit, value of a row, log scale.
type Chart = (
    &'static str,
    &'static str,
    &'static str,
    fn(&Row) -> f64,
    bool,
);

#[derive(Debug, Parser)]
#[command(about = "Side-by-side gRPC balancing benchmark: direct, L4, HAProxy, nginx, skewless")]
struct Args {
    /// Delays of the 5th pod, ms.
    #[arg(long, value_delimiter = ',', default_value = "0,50,200")]
    delays: Vec<u64>,
    /// Client HTTP/2 connection counts.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    connections: Vec<usize>,
    /// Calls in flight per connection.
    #[arg(long, default_value_t = 200)]
    in_flight: usize,
    /// Warm-up seconds per run (not measured).
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 8.0)]
    duration: f64,
    /// Worker threads/processes of every proxy (HAProxy nbthread, nginx worker_processes,
    /// skewless-proxy runtime threads).
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

/// `root` and its descendants.
fn tree(root: u32) -> Vec<u32> {
    let mut all: Vec<(u32, u32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(ppid) = std::fs::read_to_string(e.path().join("stat"))
                .ok()
                .as_deref()
                .and_then(stat_ppid)
            {
                all.push((pid, ppid));
            }
        }
    }
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        out.extend(all.iter().filter(|(_, pp)| *pp == parent).map(|(p, _)| *p));
        i += 1;
    }
    out
}

fn cpu_ticks(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .filter_map(|s| stat_cpu_ticks(&s))
        .sum()
}

fn peak_rss_kib(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .filter_map(|s| status_vm_hwm_kib(&s))
        .sum()
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
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

    fn run_one(&self, delay_ms: u64, connections: usize, target: Target) -> anyhow::Result<Row> {
        let (proxy, addr) = self.start_proxy(target)?;
        let a = &self.args;
        let mut load = Proc::spawn(
            "skewless-loadgen",
            Command::new(self.bin_dir.join("skewless-loadgen"))
                .arg("run")
                .arg("--target")
                .arg(addr.to_string())
                .arg("--connections")
                .arg(connections.to_string())
                .arg("--in-flight")
                .arg(a.in_flight.to_string())
                .arg("--warmup")
                .arg(a.warmup.to_string())
                .arg("--duration")
                .arg(a.duration.to_string())
                .arg("--json")
                .stdout(Stdio::piped()),
        )?;
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
        let json: serde_json::Value =
            serde_json::from_str(out.trim()).context("parsing the load generator's JSON")?;
        let mut row = Row {
            delay_ms,
            connections,
            target: target.name().to_owned(),
            ..Row::default()
        };
        row.set_load(&json, &self.pods[PODS - 1].name)?;
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
    let mut rows = Vec::new();
    for &delay in &a.delays {
        set_delay(admins[PODS - 1], delay)?;
        for &conns in &a.connections {
            let mut targets = vec![Target::DirectHealthy, Target::DirectSlow];
            if conns > 1 {
                targets.push(Target::L4);
            }
            targets.extend([Target::Haproxy, Target::Nginx, Target::Skewless]);
            for t in targets {
                let row = bench
                    .run_one(delay, conns, t)
                    .with_context(|| format!("{} at {delay} ms, {conns} conn(s)", t.name()))?;
                eprintln!(
                    "delay {delay:>3} ms conns {conns} {:<15} {:>7.0} rps  p50 {:>7.2}  p99 {:>7.2}  p99.9 {:>7.2} ms  slow {:>5.1}%  errors {}{}",
                    row.target,
                    row.rps,
                    row.p50_ms,
                    row.p99_ms,
                    row.p999_ms,
                    row.slow_share * 100.0,
                    row.errors,
                    match (row.cores_per_krps, row.peak_rss_mib) {
                        (Some(c), Some(m)) => format!("  {c:.3} cores/1k rps  {m:.1} MiB"),
                        _ => String::new(),
                    }
                );
                rows.push(row);
            }
        }
    }
    drop(echo);
    let table = markdown_table(&rows);
    let (targets, all_met) = targets_table(&rows);
    println!("{table}\n{targets}");
    println!(
        "all targets met: {all_met} ({:.0} s)",
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = &a.write {
        let doc = std::fs::read_to_string(path).unwrap_or_default();
        let dir = path.parent().context("the results file has no directory")?;
        let charts: [Chart; 2] = [
            (
                "bench-p99.svg",
                "p99 latency (log scale)",
                "ms",
                |r| r.p99_ms,
                true,
            ),
            ("bench-rps.svg", "Throughput", "RPS", |r| r.rps, false),
        ];
        for (file, title, unit, value, log) in charts {
            std::fs::write(
                dir.join(file),
                bar_chart_svg(title, unit, &rows, value, log),
            )
            .with_context(|| format!("writing {file}"))?;
        }
        let section = section(a, &table, &targets);
        std::fs::write(path, replace_section(&doc, SECTION, &section))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn section(a: &Args, table: &str, targets: &str) -> String {
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .unwrap_or_default();
    let date = date.trim();
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    format!(
        "{SECTION}\n\n\
         Run of {date} (`{cmd}`), {cpus} CPUs, everything on 127.0.0.1: 5 `skewless-echo` pods \
         (the 5th delayed by the row's delay), `skewless-loadgen run` (closed loop, {inf} calls \
         in flight per connection, {w} s warm-up, {d} s measured), and one proxy at a time, \
         started fresh for its run with {t} worker threads/processes. `direct-healthy` and \
         `direct-slow` load one pod without a proxy: the two outcomes of an L4 coin flip, never \
         averaged. `p99 / direct-healthy` divides by the direct-healthy p99 of the same delay. \
         CPU is the proxy's utime+stime over the measured window (all its processes), as cores \
         per 1,000 RPS; peak RSS is `VmHWM` summed over its processes.\n\n\
         {table}\n\
         ![p99 by target](bench-p99.svg) ![RPS by target](bench-rps.svg)\n\n\
         Targets (issue 4), skewless against the peers of the same run:\n\n\
         {targets}",
        cmd = a.command,
        inf = a.in_flight,
        w = a.warmup,
        d = a.duration,
        t = a.proxy_threads,
    )
}
