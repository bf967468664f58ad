//! The load-independent section (`--instructions`): every skewless-proxy build of the run
//! serves a counted number of calls while valgrind's callgrind counts its user-space
//! instructions and clock reads, and, run natively at a fixed offered rate, while `perf stat`
//! counts its syscalls. Parsing and the table are in `skewless_bench::counted`.

use std::io::Read as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::Duration;

use anyhow::{Context as _, bail};
use skewless_bench::counted::{Counted, parse_callgrind, parse_perf_syscalls};
use skewless_loadgen::Report;

use crate::procs::{Proc, find_tool, free_addr};
use crate::{Bench, Target};

/// Closed-loop warm-up under callgrind before its counters are zeroed (JIT translation of the
/// hot paths, connection setup), seconds.
pub const CALLGRIND_WARMUP_S: f64 = 2.0;
/// How long a proxy under valgrind may take to listen (it translates code as it first runs).
const VALGRIND_START: Duration = Duration::from_secs(120);

impl Bench {
    /// Counts every build of the run (`skewless` first), `--instructions-runs` times each,
    /// interleaved.
    pub fn count_builds(&self) -> anyhow::Result<Vec<Counted>> {
        let a = &self.args;
        let valgrind = find_tool("valgrind")
            .context("valgrind is not installed (`cargo xtask setup` installs it)")?;
        let control =
            find_tool("callgrind_control").context("callgrind_control is not installed")?;
        let perf = find_tool("perf").context("perf is not installed (`cargo xtask setup`)")?;
        let mut targets = vec![Target::Skewless];
        if a.codec_path {
            targets.push(Target::Codec);
        }
        targets.extend((0..a.builds.len()).map(Target::Build));
        targets.retain(|t| a.selected(*t));
        let mut counted: Vec<Counted> = targets
            .iter()
            .map(|t| Counted {
                target: a.name(*t),
                ..Counted::default()
            })
            .collect();
        for pass in 0..a.instructions_runs.max(1) {
            for (i, t) in targets.iter().enumerate() {
                let name = a.name(*t);
                let (calls, dump) = self
                    .callgrind_once(*t, pass, &valgrind, &control)
                    .with_context(|| format!("counting {name}'s instructions"))?;
                #[expect(clippy::cast_precision_loss, reason = "counts far below 2^52")]
                let per_call = dump.instructions as f64 / calls.max(1) as f64;
                eprintln!(
                    "callgrind {name:<19} {calls:>6} calls  {per_call:>8.0} instructions per call"
                );
                counted[i].callgrind.push((calls, dump));
            }
            for (i, t) in targets.iter().enumerate() {
                let name = a.name(*t);
                let (calls, syscalls) = self
                    .perf_once(*t, &perf)
                    .with_context(|| format!("counting {name}'s syscalls"))?;
                #[expect(clippy::cast_precision_loss, reason = "counts far below 2^52")]
                let per_call = syscalls as f64 / calls.max(1) as f64;
                eprintln!(
                    "perf stat {name:<19} {calls:>6} calls  {per_call:>6.2} syscalls per call"
                );
                counted[i].syscalls.push((calls, syscalls));
            }
        }
        Ok(counted)
    }

    /// One closed-loop window of `--instructions-duration` seconds under callgrind: the calls
    /// served, and what the dump of that window counted.
    fn callgrind_once(
        &self,
        target: Target,
        pass: usize,
        valgrind: &Path,
        control: &Path,
    ) -> anyhow::Result<(u64, skewless_bench::counted::Dump)> {
        let listen = free_addr()?;
        let label = self.args.name(target).replace('@', "-");
        let out = self.work.join(format!("callgrind.{label}.{pass}"));
        let mut cmd = Command::new(valgrind);
        cmd.arg("--tool=callgrind")
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(self.proxy_bin(target));
        self.proxy_args(&mut cmd, target, listen);
        let mut proxy = Proc::spawn(
            &format!("{} under callgrind", self.args.name(target)),
            cmd.stdout(Stdio::null()).stderr(Stdio::null()),
        )?;
        proxy.wait_listening_for(listen, VALGRIND_START)?;
        self.closed_loop(listen, CALLGRIND_WARMUP_S)?;
        let pid = proxy.pid().to_string();
        let zeroed = Command::new(control).args(["-z", &pid]).output()?;
        if !zeroed.status.success() {
            bail!(
                "callgrind_control -z failed: {}",
                String::from_utf8_lossy(&zeroed.stderr)
            );
        }
        let report = self.closed_loop(listen, self.args.instructions_duration)?;
        let dumped = Command::new(control).args(["-d", &pid]).output()?;
        if !dumped.status.success() {
            bail!(
                "callgrind_control -d failed: {}",
                String::from_utf8_lossy(&dumped.stderr)
            );
        }
        // `-d` writes OUT.1 (the part number); the final dump at exit would be OUT itself.
        let part = out.with_file_name(format!(
            "{}.1",
            out.file_name().unwrap_or_default().to_string_lossy()
        ));
        let text = std::fs::read_to_string(&part)
            .with_context(|| format!("reading the dump {}", part.display()))?;
        drop(proxy);
        let dump = parse_callgrind(&text).context("the dump has no instruction total")?;
        Ok((report.ok + report.failed(), dump))
    }

    /// One open-loop window at `--instructions-rate` calls per second on the native build, its
    /// syscalls counted by `perf stat` over the load generator's measured window.
    fn perf_once(&self, target: Target, perf: &Path) -> anyhow::Result<(u64, u64)> {
        let a = &self.args;
        let listen = free_addr()?;
        let mut cmd = Command::new(self.proxy_bin(target));
        self.proxy_args(&mut cmd, target, listen);
        let mut proxy = Proc::spawn(&a.name(target), cmd.stdout(Stdio::null()))?;
        proxy.wait_listening(listen)?;
        let warmup = 1.0;
        let rate = a.instructions_rate.to_string();
        let mut load = self.load(listen, ["--rate", &rate], warmup, a.instructions_duration)?;
        sleep(Duration::from_secs_f64(warmup));
        let stat_out = self.work.join("perf-stat.csv");
        let stat = Command::new(perf)
            .args(["stat", "-x,", "-e", "raw_syscalls:sys_enter", "-o"])
            .arg(&stat_out)
            .arg("-p")
            .arg(proxy.pid().to_string())
            .arg("--")
            .args(["sleep", &a.instructions_duration.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .context("running perf stat")?;
        if !stat.status.success() {
            bail!(
                "perf stat failed: {}",
                String::from_utf8_lossy(&stat.stderr)
            );
        }
        let report = finish_load(&mut load)?;
        drop(proxy);
        let text = std::fs::read_to_string(&stat_out)?;
        let syscalls = parse_perf_syscalls(&text)
            .with_context(|| format!("perf stat counted no syscalls: {text:?}"))?;
        Ok((report.ok + report.failed(), syscalls))
    }

    /// One closed-loop run of 1 connection x `--in-flight` calls for `seconds`, every call
    /// counted (no warm-up window: each slot waits for its last call).
    fn closed_loop(&self, target: std::net::SocketAddr, seconds: f64) -> anyhow::Result<Report> {
        let in_flight = self.args.in_flight.to_string();
        let mut load = self.load(target, ["--in-flight", &in_flight], 0.0, seconds)?;
        finish_load(&mut load)
    }

    /// Starts `skewless-loadgen run --json` on 1 connection to `target`, with `mode` (closed
    /// or open loop) and its warm-up and measured seconds.
    fn load(
        &self,
        target: std::net::SocketAddr,
        mode: [&str; 2],
        warmup: f64,
        seconds: f64,
    ) -> anyhow::Result<Proc> {
        Proc::spawn(
            "skewless-loadgen",
            Command::new(self.bin_dir.join("skewless-loadgen"))
                .arg("run")
                .arg("--target")
                .arg(target.to_string())
                .args(["--connections", "1"])
                .args(mode)
                .arg("--warmup")
                .arg(warmup.to_string())
                .arg("--duration")
                .arg(seconds.to_string())
                .arg("--json")
                .stdout(Stdio::piped()),
        )
    }
}

/// Waits for a load generator started with `--json` and reads its report.
fn finish_load(load: &mut Proc) -> anyhow::Result<Report> {
    let status = load.wait_for(Duration::from_secs(120))?;
    let mut out = String::new();
    if let Some(mut stdout) = load.child.stdout.take() {
        stdout.read_to_string(&mut out)?;
    }
    if !status.success() {
        bail!("the load generator failed ({status})");
    }
    serde_json::from_str(out.trim()).context("parsing the load generator's report")
}
