//! `skewless-observer-bench`: the agent's observer at node scale (issue 11 section 4), as root.
//!
//! A testbed node (a network namespace of its own) with a kube-proxy-style DNAT Service over
//! four backend pods, and its conntrack table filled with synthetic TCP entries over ctnetlink
//! (`skewless-conntrack`; the root namespace's table is never touched). The real agent (the
//! binary given, the `dist` build from `cargo xtask bench`) runs in the node with that Service
//! in `observe` mode and its hooks attached to two client pods' cgroups. One client pod opens
//! real connections to the VIP through those hooks (`sock_ops` records each one in the `CONNS`
//! map) and keeps them open, idle; the observer resolves each one's backend through conntrack
//! and reports every 2 s. From `/proc/<agent>`: CPU (utime + stime, all threads) over whole
//! cycles, first idle (no connections) and then with the connections, and the resident set
//! (`VmRSS`, peak `VmHWM`). Then the full map: filler pods open enough connections to pass the
//! map's capacity, and the run reports what the agent then sees and counts, its cost with a
//! full map, whether connections opened after that are still attributed (a second observed
//! Service), and whether it still serves. Everything started here is ended when the testbed
//! drops (also on errors); every wait is bounded.

use std::{
    collections::HashMap,
    fs::File,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    path::{Path, PathBuf},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use clap::Parser;
use skewless_admin::json::Status;
use skewless_bench::{
    replace_section,
    sampling::{clk_tck, cpu_ticks, peak_rss_kib},
};
use skewless_conntrack::{Conntrack, Entry};
use skewless_testbed::{FileService, Place, Testbed, scripts};

/// Service `obs`, observed: the client pod's connections and the fillers'.
const VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(198, 19, 0, 40), 8080);
/// Service `late`, observed too, over the same backends: only the connections opened once the
/// map is full go to it, so its report tells whether those are recorded and attributed.
const LATE_VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(198, 19, 0, 41), 8080);
/// Connections opened to [`LATE_VIP`] after the fill.
const LATE: u32 = 1_000;
const BACKENDS: [&str; 4] = ["backend-0", "backend-1", "backend-2", "backend-3"];
const ADMIN: &str = "127.0.0.1:9990";
/// The observer's period (agent/skewless/src/observer.rs).
const CYCLE: Duration = Duration::from_secs(2);
const SECTION: &str = "## Observation at node scale (issue 11)";
/// Connections per client process: under the machine's hard open-file limit (20,000 here).
const PER_PROCESS: u32 = 15_000;
/// Connections per filler pod (one source address each). Under half of the default ephemeral
/// port range (32768-60999, 28,232 ports): Linux's connect() takes ports of one parity first
/// (`__inet_hash_connect`, since 4.6; the other half is left to bind()), and once that half
/// holds connections to the same VIP:port every further connect scans it. From one pod,
/// connects slowed there from thousands to ~120 a second, and 60,000 missed the fill's
/// deadline (the ECONNREFUSED the fillers reported then came from the teardown after that
/// timeout, which ends the backends first).
const FILL_PER_POD: u32 = 12_000;

#[derive(Parser)]
#[command(about = "The observer at node scale: CPU per cycle and memory of the real agent")]
struct Args {
    /// The agent binary (`skewless`).
    #[arg(long)]
    agent: PathBuf,
    /// Synthetic TCP entries in the node's conntrack table.
    #[arg(long, default_value_t = 100_000)]
    entries: u32,
    /// Real connections the client pod opens to the observed Service and keeps.
    #[arg(long, default_value_t = 10_000)]
    connections: u32,
    /// Observer cycles (2 s each) per measured window.
    #[arg(long, default_value_t = 10)]
    cycles: u32,
    /// Connections filler pods open afterwards (12,000 per pod), to pass the connection map's
    /// capacity (65,536), e.g. 60000; then 1,000 more to a second observed Service. 0 skips
    /// the full-map part.
    #[arg(long, default_value_t = 60_000)]
    fill: u32,
    /// Replace this benchmark's section of this Markdown file with the results.
    #[arg(long)]
    write: Option<PathBuf>,
    /// The command shown in the written section.
    #[arg(long, default_value = "cargo xtask bench --observer-only")]
    command: String,
}

/// The agent as `/proc` shows it at one moment.
#[derive(Clone, Copy, Debug)]
struct Sample {
    at: Instant,
    ticks: u64,
    rss_kib: u64,
    peak_kib: u64,
}

impl Sample {
    fn take(pid: u32) -> Self {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let rss_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        Self {
            at: Instant::now(),
            ticks: cpu_ticks(&[pid]),
            rss_kib,
            peak_kib: peak_rss_kib(&[pid]),
        }
    }
}

/// CPU between two samples: seconds of CPU, and cores (CPU seconds per wall second).
fn cpu_between(a: Sample, b: Sample) -> (f64, f64) {
    let cpu = (b.ticks - a.ticks) as f64 / clk_tck();
    let wall = (b.at - a.at).as_secs_f64();
    (cpu, cpu / wall)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// What the agent's `/status` reports for an observed Service: open connections over all
/// backends, unresolved connections, backends receiving.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Observed {
    open: u64,
    unresolved: u64,
    backends: usize,
}

/// One row of the results table.
struct Row {
    phase: String,
    recorded: u64,
    observed: Observed,
    cpu_per_cycle_ms: f64,
    cores: f64,
    rss_mib: f64,
    peak_mib: f64,
}

struct Bench<'a> {
    tb: Testbed,
    args: &'a Args,
    agent: u32,
    tmp: PathBuf,
    /// The filler pods of the full-map part.
    fillers: Vec<String>,
    /// The agent's stderr.
    log: PathBuf,
}

/// What the full-map part found.
struct Full {
    /// Connections open to `obs` (the client's and the fillers').
    total: u64,
    /// The observer's report of `obs` once it settled.
    seen: Observed,
    /// Its report of `late`, after [`LATE`] connections were opened to it with the map full.
    late: Observed,
    metrics: HashMap<String, f64>,
    /// Lines of the agent's log that warn of evictions.
    warnings: usize,
    ready: bool,
    running: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ensure!(
        nix_is_root(),
        "the observer benchmark needs root (network namespaces, eBPF, ctnetlink)"
    );
    let tmp = std::env::temp_dir().join(format!("skewless-observer-bench-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let out = run(&args, &tmp);
    let _ = std::fs::remove_dir_all(&tmp);
    let section = out?;
    println!("{section}");
    if let Some(path) = &args.write {
        let doc = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
        std::fs::write(path, replace_section(&doc, SECTION, &section))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().nth(1))
            == Some("0")
    })
}

fn run(args: &Args, tmp: &Path) -> anyhow::Result<String> {
    let started = chrono_now();
    let fillers: Vec<String> = (0..args.fill.div_ceil(FILL_PER_POD))
        .map(|i| format!("filler-{i}"))
        .collect();
    // Each backend holds its share of every connection in one process.
    let per_backend = (args.connections + args.fill + LATE).div_ceil(BACKENDS.len() as u32);
    let nofile = hard_open_files()?;
    ensure!(
        u64::from(per_backend) * 21 / 20 + 64 < nofile,
        "{per_backend} connections per backend (with a 5% margin for the DNAT's random spread) do not fit the hard open-file limit {nofile}"
    );
    let mut b = Testbed::builder().nodes(1).pod("client", 0);
    for f in &fillers {
        b = b.pod(f, 0);
    }
    for p in BACKENDS {
        b = b.pod(p, 0);
    }
    let mut tb = b
        .service("obs", *VIP.ip(), VIP.port(), VIP.port(), &BACKENDS)
        .service(
            "late",
            *LATE_VIP.ip(),
            LATE_VIP.port(),
            LATE_VIP.port(),
            &BACKENDS,
        )
        .build()
        .context("building the testbed (needs root)")?;
    // Backends that accept and keep every connection.
    for p in BACKENDS {
        tb.spawn(
            Place::Pod(p),
            &[
                "python3",
                scripts::HOLD_CONNS,
                "serve",
                "0.0.0.0",
                &VIP.port().to_string(),
            ],
        )?;
    }
    for p in BACKENDS {
        let ip = tb.pod(p)?.ip;
        tb.wait_for_tcp(
            Place::Node(0),
            SocketAddrV4::new(ip, VIP.port()),
            Duration::from_secs(20),
        )?;
    }

    // The node's table: synthetic entries, as a busy kube-proxy node holds.
    let netns = format!("/run/netns/{}", tb.node(0).netns);
    let t = Instant::now();
    let mut ct = Conntrack::in_netns(&netns)
        .open()
        .context("ctnetlink in the node")?;
    let entries: Vec<Entry> = (0..args.entries).map(synthetic).collect();
    ct.create(&entries, Duration::from_secs(900))
        .context("creating the synthetic conntrack entries")?;
    let table = ct.dump().context("dumping the node's conntrack table")?;
    ensure!(
        table.len() >= entries.len(),
        "the table holds {} entries, {} were made",
        table.len(),
        entries.len()
    );
    let fill_s = t.elapsed().as_secs_f64();
    let conntrack_l = time_conntrack_list(&netns)?;

    // The agent, observing the Service.
    let services = tmp.join("services.yaml");
    write_services(&tb, &services)?;
    let agent_bin = args.agent.display().to_string();
    let services_arg = services.display().to_string();
    let mut argv = vec![
        agent_bin.clone(),
        "agent".into(),
        "--services-file".into(),
        services_arg,
        "--admin-addr".into(),
        ADMIN.into(),
    ];
    for pod in std::iter::once("client").chain(fillers.iter().map(String::as_str)) {
        argv.push("--cgroup".into());
        argv.push(tb.pod(pod)?.cgroup.display().to_string());
    }
    // Its log (stderr) is kept: the run reports whether it warned of evictions.
    let log = tmp.join("agent.log");
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let mut cmd = tb.command(Place::Node(0), &argv)?;
    cmd.stderr(File::create(&log).with_context(|| format!("creating {}", log.display()))?);
    let agent = tb.spawn_command(&mut cmd)?;
    tb.wait_for_tcp(
        Place::Node(0),
        ADMIN.parse::<SocketAddr>()?,
        Duration::from_secs(20),
    )
    .context("the agent serves its admin API")?;
    let mut bench = Bench {
        tb,
        args,
        agent,
        tmp: tmp.to_owned(),
        fillers,
        log,
    };
    bench.measure(started, fill_s, conntrack_l, table.len())
}

impl Bench<'_> {
    fn measure(
        &mut self,
        started: String,
        fill_s: f64,
        conntrack_l: f64,
        table_len: usize,
    ) -> anyhow::Result<String> {
        let n = self.args.connections;
        let window = CYCLE * self.args.cycles;
        let mut rows = Vec::new();
        // Two cycles to settle, then the idle window: the table, the Service, no connection.
        sleep(CYCLE * 2);
        let a = self.sample()?;
        sleep(window);
        let b = self.sample()?;
        rows.push(self.row("idle: no connection recorded", 0, a, b)?);

        // The connections: the first cycles resolve them (one conntrack GET each).
        let before = self.sample()?;
        self.open(&[("client", n)], VIP)?;
        let seen = self.wait_observed(u64::from(n), Duration::from_secs(60))?;
        let after = self.sample()?;
        rows.push(self.row(
            &format!(
                "{n} connections opened and resolved ({:.1} s)",
                (after.at - before.at).as_secs_f64()
            ),
            u64::from(n),
            before,
            after,
        )?);
        ensure!(
            seen.unresolved == 0 && seen.backends == BACKENDS.len(),
            "every connection must be resolved to one of the backends: {seen:?}"
        );
        // Steady state: the same connections, cycle after cycle.
        sleep(CYCLE);
        let a = self.sample()?;
        sleep(window);
        let b = self.sample()?;
        let steady = self.row(&format!("steady, {n} connections"), u64::from(n), a, b)?;
        let steady_cores = steady.cores;
        let idle_cores = rows[0].cores;
        rows.push(steady);
        let peak_at_n = b.peak_kib;
        let map = conns_map(self.agent);

        // The full map: more connections than the map holds.
        let full = if self.args.fill > 0 {
            Some(self.fill(&mut rows)?)
        } else {
            None
        };
        let peak_end = self.sample()?.peak_kib;

        let mut s = format!(
            "{SECTION}\n\nRun of {started} (`{}`), as root, on a {}-CPU machine. A testbed node (its own \
             network namespace) with a kube-proxy-style DNAT Service over {} backend pods, its \
             conntrack table filled with {} synthetic TCP entries over ctnetlink ({fill_s:.1} s; \
             the table then held {table_len}), and the real agent (`dist` build) observing that \
             Service (`observe` mode), its hooks on the client pod's cgroup and the filler pods'. \
             The client pod opens \
             {n} real connections to the VIP through the hooks and keeps them open, idle; the \
             agent's observer resolves each one's backend (one conntrack GET per new \
             connection) and reports every 2 s. CPU is the agent's utime + stime (all its \
             threads: the observer, the admin API, the heartbeat) over {} whole cycles per \
             window, RSS from `/proc/<agent>/status`.\n\n",
            self.args.command,
            std::thread::available_parallelism().map_or(0, usize::from),
            BACKENDS.len(),
            self.args.entries,
            self.args.cycles,
        );
        s.push_str("| phase | recorded connections | reported open | unresolved | backends receiving | agent CPU per 2 s cycle, ms | cores | RSS MiB | peak RSS MiB |\n");
        s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for r in &rows {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {:.1} | {:.4} | {:.1} | {:.1} |\n",
                r.phase,
                r.recorded,
                r.observed.open,
                r.observed.unresolved,
                r.observed.backends,
                r.cpu_per_cycle_ms,
                r.cores,
                r.rss_mib,
                r.peak_mib
            ));
        }
        let verdict = |met: bool| if met { "met" } else { "NOT met" };
        s.push_str(&format!(
            "\nTargets (issue 11): with {} conntrack entries and {n} recorded connections, the \
             agent's CPU {:.2}% of a core in steady state ({:.2}% idle), bar < 2%: **{}**; \
             peak RSS {:.1} MiB, bar < 50 MiB: **{}**.\n",
            self.args.entries,
            steady_cores * 100.0,
            idle_cores * 100.0,
            verdict(steady_cores < 0.02),
            mib(peak_at_n),
            verdict(mib(peak_at_n) < 50.0),
        ));
        s.push_str(&format!(
            "\nFor comparison, in the same node: one `conntrack -L -p tcp` of that table took \
             {conntrack_l:.2} s (what the observer ran twice per cycle before it read conntrack \
             over netlink).\n"
        ));
        if let Some(m) = map {
            s.push_str(&format!(
                "\nThe connection map (`CONNS`, from `/proc/<agent>/fdinfo`): an LRU hash of {} \
                 entries of {} + {} bytes, {:.1} MiB of locked kernel memory, not in the agent's \
                 RSS.\n",
                m.max_entries,
                m.key_size,
                m.value_size,
                mib(m.memlock / 1024)
            ));
        }
        if let Some(f) = full {
            let metric = |name: &str| metrics_value(&f.metrics, name);
            let evicted = metric("skewless_observed_records_evicted_total");
            let entries = metric("skewless_map_entries{map=\"conns\"}");
            s.push_str(&format!(
                "\nFull map: {total} connections open to the Service (every connect succeeded, \
                 {pods} filler pods of at most {FILL_PER_POD}); the observer reports {open} of \
                 them open ({unresolved} unresolved), so {missing} have no record. The agent's \
                 metrics: `skewless_map_entries{{map=\"conns\"}}` {entries} of \
                 `skewless_map_capacity` {capacity}, `skewless_observed_records_evicted_total` \
                 {evicted}, `skewless_observed_connections_total` {recorded}, \
                 `skewless_observed_record_failed_total` {failed}; the log's eviction \
                 warnings: {warnings}. Then {LATE} connections to a second observed Service \
                 (`late`, same backends), opened with the map full: it reports {late_open} of \
                 them open, {late_unresolved} unresolved, on {late_backends} backends. Agent \
                 still running: {running}; `/ready` answered: {ready}; its peak RSS by then \
                 {peak:.1} MiB.\n",
                total = f.total,
                pods = self.fillers.len(),
                open = f.seen.open,
                unresolved = f.seen.unresolved,
                missing = f.total.saturating_sub(f.seen.open),
                capacity = metric("skewless_map_capacity{map=\"conns\"}"),
                recorded = metric("skewless_observed_connections_total"),
                failed = metric("skewless_observed_record_failed_total"),
                warnings = f.warnings,
                late_open = f.late.open,
                late_unresolved = f.late.unresolved,
                late_backends = f.late.backends,
                running = if f.running { "yes" } else { "NO" },
                ready = if f.ready { "yes" } else { "NO" },
                peak = mib(peak_end),
            ));
        }
        Ok(s)
    }

    fn sample(&mut self) -> anyhow::Result<Sample> {
        if !self.tb.is_running(self.agent) {
            bail!("the agent exited");
        }
        Ok(Sample::take(self.agent))
    }

    fn row(&self, phase: &str, recorded: u64, a: Sample, b: Sample) -> anyhow::Result<Row> {
        let (cpu, cores) = cpu_between(a, b);
        let cycles = (b.at - a.at).as_secs_f64() / CYCLE.as_secs_f64();
        Ok(Row {
            phase: phase.to_owned(),
            recorded,
            observed: self.observed(VIP)?,
            cpu_per_cycle_ms: cpu * 1000.0 / cycles,
            cores,
            rss_mib: mib(b.rss_kib),
            peak_mib: mib(b.peak_kib),
        })
    }

    /// The full map: the fillers' connections, the observer's report once it settles, a
    /// steady window with the map full, then [`LATE`] connections to `late`.
    fn fill(&mut self, rows: &mut Vec<Row>) -> anyhow::Result<Full> {
        let n = self.args.connections;
        let total = u64::from(n + self.args.fill);
        let before = self.sample()?;
        let mut left = self.args.fill;
        let plan: Vec<(String, u32)> = self
            .fillers
            .iter()
            .map(|f| {
                let k = left.min(FILL_PER_POD);
                left -= k;
                (f.clone(), k)
            })
            .collect();
        let plan: Vec<(&str, u32)> = plan.iter().map(|(f, k)| (f.as_str(), *k)).collect();
        self.open(&plan, VIP)?;
        let opened = self.sample()?;
        // Let the observer catch up: until two reports in a row agree.
        let seen = self.settled(VIP, u64::from(n))?;
        let after = self.sample()?;
        rows.push(self.row(
            &format!(
                "{} more connections in {} pods (map capacity passed; opened in {:.1} s, report \
                 settled after {:.1} s)",
                self.args.fill,
                self.fillers.len(),
                (opened.at - before.at).as_secs_f64(),
                (after.at - before.at).as_secs_f64()
            ),
            total,
            before,
            after,
        )?);
        // Steady with the map full: every cycle dumps all of it.
        sleep(CYCLE);
        let a = self.sample()?;
        sleep(CYCLE * self.args.cycles);
        let b = self.sample()?;
        rows.push(self.row(&format!("steady, map full ({total} open)"), total, a, b)?);
        // Connections opened now must still be recorded and attributed.
        self.open(&[("client", LATE)], LATE_VIP)?;
        let late = self.settled(LATE_VIP, 0)?;
        let metrics = self.metrics()?;
        let ready = self
            .tb
            .run(
                Place::Node(0),
                &[
                    "python3",
                    scripts::HTTP_GET,
                    &format!("http://{ADMIN}/ready"),
                ],
            )
            .is_ok();
        let running = self.tb.is_running(self.agent);
        let warnings = std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("connection map full"))
            .count();
        Ok(Full {
            total,
            seen,
            late,
            metrics,
            warnings,
            ready,
            running,
        })
    }

    /// Polls the observer's report of the Service at `vip` every cycle until two in a row
    /// agree and it shows more than `floor` open connections (bounded: 90 s).
    fn settled(&self, vip: SocketAddrV4, floor: u64) -> anyhow::Result<Observed> {
        let deadline = Instant::now() + Duration::from_secs(90);
        let mut last = self.observed(vip)?;
        loop {
            sleep(CYCLE);
            let now = self.observed(vip)?;
            if now == last && now.open > floor {
                return Ok(now);
            }
            ensure!(
                Instant::now() < deadline,
                "the observer's report of {vip} did not settle: {now:?}"
            );
            last = now;
        }
    }

    /// Starts held connections to `vip`, `n` from each `(pod, n)`, in processes of at most
    /// [`PER_PROCESS`] (the open-file limit), and waits until all are open.
    fn open(&mut self, plan: &[(&str, u32)], vip: SocketAddrV4) -> anyhow::Result<()> {
        let mut clients = Vec::new();
        for &(pod, n) in plan {
            let mut left = n;
            while left > 0 {
                let k = left.min(PER_PROCESS);
                left -= k;
                let ready = self
                    .tmp
                    .join(format!("{pod}-{}-{}.ready", vip.ip(), clients.len()));
                let pid = self.tb.spawn(
                    Place::Pod(pod),
                    &[
                        "python3",
                        scripts::HOLD_CONNS,
                        "connect",
                        &vip.ip().to_string(),
                        &vip.port().to_string(),
                        &k.to_string(),
                        &ready.display().to_string(),
                    ],
                )?;
                clients.push((pod, pid, ready));
            }
        }
        let total: u32 = plan.iter().map(|(_, n)| n).sum();
        let deadline = Instant::now() + Duration::from_secs(180);
        for (pod, pid, ready) in clients {
            while !ready.exists() {
                ensure!(
                    self.tb.is_running(pid),
                    "a client of the {pod} pod exited before opening its connections"
                );
                ensure!(
                    Instant::now() < deadline,
                    "{total} connections to {vip} not open within 180 s"
                );
                sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    }

    /// Waits until the observer reports `n` open connections to `obs`.
    fn wait_observed(&self, n: u64, timeout: Duration) -> anyhow::Result<Observed> {
        let deadline = Instant::now() + timeout;
        loop {
            let o = self.observed(VIP)?;
            if o.open >= n {
                return Ok(o);
            }
            ensure!(
                Instant::now() < deadline,
                "the observer reports {o:?} after {timeout:?}, expected {n} open connections"
            );
            sleep(Duration::from_millis(500));
        }
    }

    /// The observer's report of the Service at `vip`, from `skewless status --json`.
    fn observed(&self, vip: SocketAddrV4) -> anyhow::Result<Observed> {
        let agent = self.args.agent.display().to_string();
        let out = self.tb.run(
            Place::Node(0),
            &[&agent, "status", "--json", "--admin-addr", ADMIN],
        )?;
        let status: Status =
            serde_json::from_slice(&out.stdout).context("the agent's status JSON")?;
        let mut o = Observed::default();
        for svc in status.observed.iter().filter(|s| s.vip == vip.to_string()) {
            o.unresolved += svc.unresolved as u64;
            for backend in &svc.backends {
                o.open += backend.open_connections as u64;
                o.backends += usize::from(backend.open_connections > 0);
            }
        }
        Ok(o)
    }

    /// The agent's unlabelled metrics.
    fn metrics(&self) -> anyhow::Result<HashMap<String, f64>> {
        let out = self.tb.run(
            Place::Node(0),
            &[
                "python3",
                scripts::HTTP_GET,
                &format!("http://{ADMIN}/metrics"),
            ],
        )?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (name, value) = l.split_once(' ')?;
                Some((name.to_owned(), value.trim().parse().ok()?))
            })
            .collect())
    }
}

/// A metric's value from [`Bench::metrics`], NaN when absent.
fn metrics_value(metrics: &HashMap<String, f64>, name: &str) -> f64 {
    metrics.get(name).copied().unwrap_or(f64::NAN)
}

/// This process's hard open-file limit (its children inherit it), from `/proc/self/limits`.
fn hard_open_files() -> anyhow::Result<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").context("/proc/self/limits")?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .context("no open-file limit in /proc/self/limits")?;
    let hard = line
        .split_whitespace()
        .nth(4)
        .context("/proc/self/limits: open-file limit line")?;
    Ok(hard.parse().unwrap_or(u64::MAX))
}

/// Entry `i`: a client among 8 addresses x 16,384 ports to one of 16 VIPs, DNATed to one of
/// 250 backends; none of these addresses exists in the testbed.
fn synthetic(i: u32) -> Entry {
    let client = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 128, 1)) + (i >> 14));
    let port = 10_000 + (i & 0x3fff) as u16;
    let vip = Ipv4Addr::new(198, 19, 250, (i % 16) as u8 + 1);
    let backend = Ipv4Addr::new(198, 19, 251, (i % 250) as u8 + 1);
    Entry {
        src: SocketAddr::new(client.into(), port),
        dst: SocketAddr::new(vip.into(), 443),
        reply_src: SocketAddr::new(backend.into(), 8443),
    }
}

/// Seconds one `conntrack -L -p tcp` of the node's table takes (its output discarded).
fn time_conntrack_list(netns: &str) -> anyhow::Result<f64> {
    let t = Instant::now();
    let status = std::process::Command::new("nsenter")
        .arg(format!("--net={netns}"))
        .args(["--", "conntrack", "-L", "-p", "tcp"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .context("running conntrack -L (conntrack-tools)")?;
    ensure!(status.success(), "conntrack -L failed: {status}");
    Ok(t.elapsed().as_secs_f64())
}

/// The services file: both Services in `observe` mode over the backend pods.
fn write_services(tb: &Testbed, path: &Path) -> anyhow::Result<()> {
    let mut yaml = String::from("services:\n");
    for (name, vip) in [("obs", VIP), ("late", LATE_VIP)] {
        yaml.push_str(&tb.services_entry(&FileService {
            name,
            cluster_ips: &[vip.ip().to_string()],
            port: vip.port(),
            mode: "observe",
            pods: &BACKENDS,
            ipv6_endpoints: false,
        })?);
    }
    std::fs::write(path, yaml).with_context(|| format!("writing {}", path.display()))
}

/// A BPF map as `/proc/<pid>/fdinfo` describes it.
struct MapInfo {
    max_entries: u64,
    key_size: u64,
    value_size: u64,
    memlock: u64,
}

/// The agent's `CONNS` map: the LRU hash (type 9) with 96-byte values (`skewless_common::Conn`).
fn conns_map(pid: u32) -> Option<MapInfo> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/fdinfo")).ok()?;
    dir.flatten().find_map(|e| {
        let text = std::fs::read_to_string(e.path()).ok()?;
        let field = |name: &str| -> Option<u64> {
            text.lines()
                .find_map(|l| l.strip_prefix(name))?
                .trim()
                .parse()
                .ok()
        };
        (field("map_type:")? == 9 && field("value_size:")? == 96).then(|| MapInfo {
            max_entries: field("max_entries:").unwrap_or(0),
            key_size: field("key_size:").unwrap_or(0),
            value_size: 96,
            memlock: field("memlock:").unwrap_or(0),
        })
    })
}

/// `YYYY-MM-DD HH:MM UTC`, from `date` (no clock crate in this tool).
fn chrono_now() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or_else(|| "?".to_owned(), |s| s.trim().to_owned())
}
