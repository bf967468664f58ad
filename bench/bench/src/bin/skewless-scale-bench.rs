//! `skewless-scale-bench`: the agent against a cluster of N Services x E endpoints (one
//! EndpointSlice each, a few opted in), served by the project's fake API server (the real
//! list/watch protocol: paged lists, streaming lists, bookmarks, 410 Gone), as root (the agent
//! loads its eBPF programs; no cgroup is attached, so nothing is redirected for real).
//!
//! Per agent binary and cluster size, from `/proc/<agent>`: the time from start to `/ready`,
//! the CPU (utime + stime) spent by then, the resident set once ready, after each of the
//! forced relists (every watch cut and history compacted, so the re-watch gets 410 Gone) and
//! its peak (`VmHWM`) across ready, churn and relists; the CPU under a steady rate of slice
//! changes spread over the whole cluster; and how long an opt-in (`skewless.io/mode: request`
//! on a Service that was not opted in) takes to reach the redirect map (`/status`). Every
//! agent started here is killed when its run ends, also on errors; every wait is bounded.

#[path = "../../../../agent/k8s/tests/support/mod.rs"]
mod support;

use std::{
    fs::File,
    io::{Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, bail, ensure};
use clap::Parser;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};
use skewless_bench::{
    replace_section,
    sampling::{clk_tck, cpu_ticks, peak_rss_kib},
};
use support::{FakeApi, Kind};

const SECTION: &str = "## Cluster scale";
const NS: &str = "bench";
const SLICES: &str = "/apis/discovery.k8s.io/v1/endpointslices";
const SERVICES: &str = "/api/v1/services";

#[derive(Parser)]
#[command(about = "The agent against a fake API server with N Services x E endpoints")]
struct Args {
    /// Agent binary to run, `LABEL=PATH`; repeatable (runs alternate per cluster size).
    #[arg(long = "agent", required = true)]
    agents: Vec<String>,
    /// Cluster sizes, `SERVICESxENDPOINTS`, comma-separated.
    #[arg(long, default_value = "1000x10,10000x10,10000x50")]
    sizes: String,
    /// Services opted in (observe mode) from the start.
    #[arg(long, default_value_t = 10)]
    opted_in: usize,
    /// Forced relists after ready.
    #[arg(long, default_value_t = 3)]
    relists: usize,
    /// Slice change rates, per second, comma-separated.
    #[arg(long, default_value = "100,1000")]
    churn: String,
    /// How long each churn rate runs.
    #[arg(long, default_value_t = 5)]
    churn_secs: u64,
    /// Opt-ins timed (each then opted out again).
    #[arg(long, default_value_t = 5)]
    opt_ins: usize,
    /// Markdown file whose "## Cluster scale" section gets the results.
    #[arg(long)]
    write: Option<PathBuf>,
    /// The command shown with the results.
    #[arg(long, default_value = "cargo xtask bench --scale-only")]
    command: String,
}

struct Run {
    label: String,
    services: usize,
    endpoints: usize,
    ready: Duration,
    cpu_ready: f64,
    rss_ready_mib: f64,
    rss_relists_mib: Vec<f64>,
    peak_mib: f64,
    /// Per rate asked: the rate achieved and the agent's CPU, cores.
    churn: Vec<(f64, f64)>,
    opt_in: Vec<Duration>,
    /// The same opt-ins until the agent's log says the redirect map has the VIP: the agent's
    /// own part, without `/status`'s polling interval.
    opt_in_map: Vec<Duration>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let agents: Vec<(String, PathBuf)> = args
        .agents
        .iter()
        .map(|a| {
            let (l, p) = a.split_once('=').context("--agent LABEL=PATH")?;
            Ok((l.to_owned(), PathBuf::from(p)))
        })
        .collect::<anyhow::Result<_>>()?;
    let sizes: Vec<(usize, usize)> = args
        .sizes
        .split(',')
        .map(|s| {
            let (n, e) = s.split_once('x').context("size SERVICESxENDPOINTS")?;
            Ok((n.parse()?, e.parse()?))
        })
        .collect::<anyhow::Result<_>>()?;
    let rates: Vec<u32> = args
        .churn
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let mut runs = Vec::new();
    for &(n, e) in &sizes {
        ensure!(
            e <= 100,
            "one slice per Service holds at most 100 endpoints"
        );
        for (label, path) in &agents {
            println!("==> {label}: {n} Services x {e} endpoints");
            let run = rt.block_on(run_one(&args, label, path, n, e, &rates))?;
            println!("{}", row(&run));
            runs.push(run);
        }
    }
    let table = table(&runs);
    println!("{table}");
    if let Some(path) = &args.write {
        let doc = std::fs::read_to_string(path).unwrap_or_default();
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let date = Command::new("date").arg("+%Y-%m-%d").output()?.stdout;
        let section = format!(
            "{SECTION}\n\n`{}` ({}, load average {} at the end). {} opted in (observe mode), one \
             EndpointSlice per Service; each agent is the `dist` build; RSS is `VmRSS`, peak \
             `VmHWM` across ready, churn and {} forced relists; CPU is utime + stime of the \
             agent; opt-in is `skewless.io/mode: request` set on a Service that was not opted in \
             until its VIP is in the redirect map, median, p90 and max of {}: as `/status` shows \
             it (polled every 2 ms, each poll a fraction of a millisecond), and as the agent's \
             log timestamps the map write (`redirect set`, debug level of \
             `skewless_datapath::redirect`), which leaves the polling out.\n\n{table}",
            args.command,
            String::from_utf8_lossy(&date).trim(),
            load.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" "),
            args.opted_in,
            args.relists,
            args.opt_ins,
        );
        std::fs::write(path, replace_section(&doc, SECTION, &section))?;
    }
    Ok(())
}

fn table(runs: &[Run]) -> String {
    let mut t = String::from(
        "| agent | Services x endpoints | time to /ready | CPU to ready | RSS after ready | RSS after each relist | peak RSS | CPU at 100 / 1,000 changes/s (achieved) | opt-in -> redirect in `/status` (median, p90, max) | opt-in -> redirect map write, agent's log (median, p90, max) |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        t.push_str(&row(r));
        t.push('\n');
    }
    t
}

/// Median, p90 and max, in milliseconds to `decimals` places (the max to one fewer).
fn quantiles(times: &[Duration], decimals: usize) -> String {
    let mut t = times.to_vec();
    t.sort();
    if t.is_empty() {
        return "-".to_owned();
    }
    let ms = |q: usize| t[(t.len() * q / 100).min(t.len() - 1)].as_secs_f64() * 1e3;
    let max_decimals = decimals.saturating_sub(1);
    format!(
        "{:.decimals$} ms, {:.decimals$} ms, {:.max_decimals$} ms",
        ms(50),
        ms(90),
        ms(100)
    )
}

fn row(r: &Run) -> String {
    format!(
        "| {} | {}k x {} | {:.2} s | {:.2} s | {:.0} MiB | {} MiB | {:.0} MiB | {} core | {} | {} |",
        r.label,
        r.services / 1000,
        r.endpoints,
        r.ready.as_secs_f64(),
        r.cpu_ready,
        r.rss_ready_mib,
        r.rss_relists_mib
            .iter()
            .map(|m| format!("{m:.0}"))
            .collect::<Vec<_>>()
            .join(" / "),
        r.peak_mib,
        r.churn
            .iter()
            .map(|(rate, c)| format!("{c:.3} ({rate:.0}/s)"))
            .collect::<Vec<_>>()
            .join(" / "),
        quantiles(&r.opt_in, 1),
        quantiles(&r.opt_in_map, 2),
    )
}

fn vip(i: usize) -> String {
    format!("10.96.{}.{}", i / 250, i % 250 + 1)
}

fn service(i: usize, mode: Option<&str>) -> Value {
    let mut v = json!({
        "metadata": {"name": format!("svc-{i}"), "namespace": NS,
                     "labels": {"app": format!("svc-{i}")},
                     "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}},
        "spec": {"type": "ClusterIP", "clusterIP": vip(i), "clusterIPs": [vip(i)],
                 "selector": {"app": format!("svc-{i}")}, "sessionAffinity": "None",
                 "ports": [{"name": "grpc", "port": 50051, "protocol": "TCP", "targetPort": 50051}]},
        "status": {"loadBalancer": {}}
    });
    if let Some(m) = mode {
        v["metadata"]["annotations"]["skewless.io/mode"] = json!(m);
    }
    v
}

/// Service `i`'s slice, `e` endpoints; `gen` varies one endpoint's readiness and the rest.
fn slice(i: usize, e: usize, generation: u64) -> Value {
    let endpoints: Vec<Value> = (0..e)
        .map(|j| {
            let ready = !(generation % 2 == 1 && j == (generation as usize / 2) % e);
            json!({
                "addresses": [format!("10.{}.{}.{}", 1 + i / 65_000, (i / 250) % 256, 1 + (i % 250 + j) % 250)],
                "conditions": {"ready": ready, "serving": ready, "terminating": false},
                "nodeName": format!("node-{}", j % 100),
                "zone": "zone-a",
                "targetRef": {"kind": "Pod", "namespace": NS, "name": format!("svc-{i}-pod-{j}"),
                              "uid": format!("00000000-0000-0000-{i:04}-{j:012}")}
            })
        })
        .collect();
    json!({
        "metadata": {"name": format!("svc-{i}-abcde"), "namespace": NS,
                     "labels": {"kubernetes.io/service-name": format!("svc-{i}"),
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
                     "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-12-03T10:00:00Z"},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": format!("svc-{i}"),
                                          "uid": format!("uid-svc-{i}"), "controller": true, "blockOwnerDeletion": true}]},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "grpc", "port": 50051, "protocol": "TCP"}]
    })
}

/// The agent process; killed on drop.
struct Agent {
    child: Child,
    pid: u32,
    admin: String,
    dir: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Ok(keep) = std::env::var("SCALE_BENCH_KEEP_LOG") {
            let _ = std::fs::copy(self.dir.path().join("agent.log"), keep);
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn start_agent(path: &PathBuf, api: &FakeApi) -> anyhow::Result<Agent> {
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig())?;
    let admin = format!("127.0.0.1:{}", free_port()?);
    let log = File::create(dir.path().join("agent.log"))?;
    let child = Command::new(path)
        .args([
            "agent",
            "--kubernetes",
            "--node-name",
            "node-a",
            "--balancer-ip",
            "127.0.0.1",
            "--admin-addr",
            &admin,
        ])
        .env("KUBECONFIG", &kubeconfig)
        .env(
            "RUST_LOG",
            std::env::var("SCALE_BENCH_AGENT_LOG").unwrap_or_else(|_| REDIRECT_LOG.to_owned()),
        )
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", path.display()))?;
    Ok(Agent {
        pid: child.id(),
        child,
        admin,
        dir,
    })
}

/// What the agent logs: warnings, and each redirect map write (which [`map_written`] reads).
const REDIRECT_LOG: &str = "warn,skewless_datapath::redirect=debug";

/// When the agent's log says it wrote `vip` into the redirect map at or after `since`: the
/// timestamp that begins its `redirect set service=VIP` line (tracing's RFC 3339, UTC).
fn map_written(log: &Path, vip: &str, since: SystemTime) -> Option<SystemTime> {
    let needle = format!("redirect set service={vip} ");
    std::fs::read_to_string(log)
        .ok()?
        .lines()
        .filter(|l| l.contains(&needle))
        .find_map(|l| {
            let ts: Timestamp = l.split_whitespace().next()?.parse().ok()?;
            let at = SystemTime::from(ts);
            (at >= since).then_some(at)
        })
}

/// One HTTP/1.0 GET of the admin API: status code and body.
fn get(admin: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(admin).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((code, body))
}

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map_or(0.0, |k| k / 1024.0)
}

fn cpu_secs(pid: u32) -> f64 {
    cpu_ticks(&[pid]) as f64 / clk_tck()
}

/// [`redirected`], on a blocking thread: the fake API server's tasks share this runtime, and a
/// worker blocked in a `/status` read would hold up the answers the agent waits for (the
/// opt-in's gets among them).
async fn redirected_now(admin: &str, vip: &str) -> bool {
    let (admin, vip) = (admin.to_owned(), vip.to_owned());
    tokio::task::spawn_blocking(move || redirected(&admin, &vip))
        .await
        .unwrap_or(false)
}

fn redirected(admin: &str, vip: &str) -> bool {
    get(admin, "/status")
        .and_then(|(_, b)| serde_json::from_str::<Value>(&b).ok())
        .and_then(|s| {
            s["redirects"]
                .as_array()
                .map(|r| r.iter().any(|r| r["service"] == vip))
        })
        .unwrap_or(false)
}

/// Waits until the agent is idle (under 5% of a core over half a second), at most 15 s, so
/// what it does after `/ready` is not counted as churn.
async fn settle(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let c0 = cpu_secs(pid);
        tokio::time::sleep(Duration::from_millis(500)).await;
        if cpu_secs(pid) - c0 < 0.025 || Instant::now() > deadline {
            return;
        }
    }
}

/// Waits (bounded) until the agent has relisted: both collections listed again and no new
/// slice request for a second.
async fn relisted(api: &FakeApi, services: usize, slices: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while api.full_lists(SERVICES) <= services || api.full_lists(SLICES) <= slices {
        ensure!(Instant::now() < deadline, "no relist within 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut last = api.requests().len();
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < Duration::from_secs(1) {
        ensure!(
            Instant::now() < deadline,
            "relist did not settle within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let n = api.requests().len();
        if n != last {
            last = n;
            quiet_since = Instant::now();
        }
    }
    Ok(())
}

async fn run_one(
    args: &Args,
    label: &str,
    path: &PathBuf,
    n: usize,
    e: usize,
    rates: &[u32],
) -> anyhow::Result<Run> {
    let api = FakeApi::start().await;
    api.change(|c| {
        c.apply_value(
            Kind::Node,
            json!({"metadata": {"name": "node-a"}, "spec": {"podCIDRs": ["10.0.0.0/24"]}}),
        );
        for i in 0..n {
            let mode = (i < args.opted_in).then_some("observe");
            c.apply_value(Kind::Service, service(i, mode));
            c.apply_value(Kind::EndpointSlice, slice(i, e, 0));
        }
    });
    api.compact();

    let t0 = Instant::now();
    let mut agent = start_agent(path, &api)?;
    loop {
        if let Some((200, _)) = get(&agent.admin, "/ready") {
            break;
        }
        if let Some(status) = agent.child.try_wait()? {
            bail!("the agent exited: {status}");
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(120),
            "not ready in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ready = t0.elapsed();
    let cpu_ready = cpu_secs(agent.pid);
    settle(agent.pid).await;
    let rss_ready_mib = rss_mib(agent.pid);

    // Churn: `rate` changes a second over random Services, in 10 ms batches.
    let mut churn = Vec::new();
    let mut generation = 1u64;
    let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
    for &rate in rates {
        let per_tick = (rate / 100).max(1) as usize;
        let cpu0 = cpu_secs(agent.pid);
        let start = Instant::now();
        let mut applied = 0usize;
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        while start.elapsed() < Duration::from_secs(args.churn_secs) {
            tick.tick().await;
            api.change(|c| {
                for _ in 0..per_tick {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let i = (rng % n as u64) as usize;
                    generation += 1;
                    c.apply_value(Kind::EndpointSlice, slice(i, e, generation));
                }
            });
            applied += per_tick;
            api.trim_log(4 * per_tick * 100);
        }
        let achieved = applied as f64 / start.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let secs = start.elapsed().as_secs_f64();
        churn.push((achieved, (cpu_secs(agent.pid) - cpu0) / secs));
    }

    // Opt-ins of Services that were not opted in: until the redirect map has them.
    let mut opt_in = Vec::new();
    let mut opt_in_map = Vec::new();
    for k in 0..args.opt_ins {
        let i = args.opted_in + 1 + k * (n / (args.opt_ins + 1)).max(1);
        let vip = format!("{}:50051", vip(i));
        let t = Instant::now();
        let wall = SystemTime::now();
        api.change(|c| c.apply_value(Kind::Service, service(i, Some("request"))));
        while !redirected_now(&agent.admin, &vip).await {
            ensure!(
                t.elapsed() < Duration::from_secs(30),
                "opt-in of svc-{i} not redirected in 30 s"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        opt_in.push(t.elapsed());
        // The line may trail the map write by a flush; absent (another log format or filter),
        // the column shows none.
        if let Some(at) = map_written(&agent.dir.path().join("agent.log"), &vip, wall) {
            opt_in_map.push(at.duration_since(wall).unwrap_or_default());
        }
        api.change(|c| c.apply_value(Kind::Service, service(i, None)));
        let t = Instant::now();
        while redirected_now(&agent.admin, &vip).await {
            ensure!(
                t.elapsed() < Duration::from_secs(30),
                "opt-out of svc-{i} not done in 30 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    let mut rss_relists_mib = Vec::new();
    for _ in 0..args.relists {
        let (s, l) = (api.full_lists(SERVICES), api.full_lists(SLICES));
        api.change_behind_watches(|_| {});
        relisted(&api, s, l).await?;
        settle(agent.pid).await;
        rss_relists_mib.push(rss_mib(agent.pid));
    }
    let peak_mib = peak_rss_kib(&[agent.pid]) as f64 / 1024.0;
    ensure!(
        matches!(get(&agent.admin, "/ready"), Some((200, _))),
        "the agent must still be ready at the end"
    );
    drop(agent);
    Ok(Run {
        label: label.to_owned(),
        services: n,
        endpoints: e,
        ready,
        cpu_ready,
        rss_ready_mib,
        rss_relists_mib,
        peak_mib,
        churn,
        opt_in,
        opt_in_map,
    })
}
