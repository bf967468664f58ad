//! The fuzz tier: every cargo-fuzz target of the workspace, each for a bounded time.
//!
//! Every target is a binary of one package, `fuzz/`, a workspace of its own because the build
//! needs instrumentation flags the main workspace never sees; one cargo build makes them all,
//! so the fuzzed crates' common dependencies are compiled once, with one feature set (five
//! packages built one after another compiled tokio and its kin once each). cargo-fuzz passes
//! `-Z` flags, so it runs on rustup's stable toolchain with `RUSTC_BOOTSTRAP=1` (nightly cannot
//! be installed on these machines); the build goes to `target/fuzz`. A target's corpus grows in
//! `fuzz/corpus/<target>` (not committed) and starts from the committed seeds in
//! `fuzz/seeds/<target>` when there are any; a finding is written to
//! `fuzz/artifacts/<target>/` and fails the tier.
//!
//! The targets are built without a sanitizer by default (`--sanitizer none`; coverage
//! instrumentation stays): every fuzzed crate forbids unsafe code, so AddressSanitizer looks
//! for what safe Rust cannot do, and costs a third more build time and about six times the
//! run time per input. `cargo xtask fuzz --sanitizer address` builds and runs with it.
//!
//! libFuzzer runs one process on one core, so the targets run [`LANES`] at a time, each for
//! its full time: the same fuzzing per target in less wall time. Each target's output goes to
//! `target/fuzz/logs/<target>.log`; a finding prints its tail.

use std::{
    collections::VecDeque,
    fs::File,
    io::{BufRead as _, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};

use crate::workspace_root;

/// The cargo-fuzz package of every target, from the workspace root.
const FUZZ_DIR: &str = "fuzz";

/// Every fuzz target: (target name, what it feeds).
pub(crate) const TARGETS: &[(&str, &str)] = &[
    ("decode", "datagrams from the conntrack socket"),
    ("annotations", "skewless.io/* annotation values"),
    ("services_file", "the services file, then the model index"),
    ("grpc_headers", "grpc-timeout and grpc-status values"),
    ("health", "grpc.health.v1 Watch responses, in any pieces"),
    (
        "relay",
        "both peers of connection mode's relay, rotated at any point",
    ),
    ("frames", "HTTP/2 frames and gRPC messages (skewless-frame)"),
    (
        "request_paths",
        "request mode's h2 and codec paths on the same client frames",
    ),
];

/// Targets whose servers and their connections outlive an input (a balancer serving both
/// data paths): what an input's connections still hold when it returns is not a leak.
const LONG_LIVED: &[&str] = &["request_paths"];

/// Seconds per target in `cargo xtask test`: 8 targets, 2.4 minutes of fuzzing in about 75 s
/// of wall time on two cores (without a sanitizer, about six times the inputs that 30 s with
/// AddressSanitizer ran).
pub(crate) const TEST_SECS: u64 = 18;

/// Targets fuzzed at the same time: libFuzzer is single-threaded and these machines have two
/// cores.
pub(crate) const LANES: usize = 2;

/// The command that fuzzes one target for `secs` seconds.
fn command(target: &str, secs: u64, sanitizer: &str) -> Command {
    let root = workspace_root();
    let mut cmd = Command::new("rustup");
    cmd.current_dir(&root)
        .env("RUSTC_BOOTSTRAP", "1")
        .args([
            "run",
            "stable",
            "cargo",
            "fuzz",
            "run",
            "--sanitizer",
            sanitizer,
            target,
        ])
        .arg("--fuzz-dir")
        .arg(FUZZ_DIR)
        .arg("--target-dir")
        .arg(root.join("target/fuzz"));
    let corpus = root.join(FUZZ_DIR).join("corpus").join(target);
    let seeds = root.join(FUZZ_DIR).join("seeds").join(target);
    // libFuzzer writes new inputs to the first corpus directory and only reads the others.
    cmd.arg(&corpus);
    if seeds.is_dir() {
        cmd.arg(&seeds);
    }
    cmd.args([
        "--",
        &format!("-max_total_time={secs}"),
        // A target that allocates without bound fails instead of swapping.
        "-rss_limit_mb=2048",
        "-print_final_stats=1",
    ]);
    if LONG_LIVED.contains(&target) {
        cmd.arg("-detect_leaks=0");
    }
    cmd
}

/// Fuzzes the targets whose name contains `filter` (all without one) for `secs` seconds each,
/// [`LANES`] at a time. Every target is built first (one cargo build), so the fuzzing runs do
/// not wait on each other's builds.
///
/// # Errors
/// When a target fails to build or finds a crash, hang or leak.
pub(crate) fn run(secs: u64, filter: Option<&str>, sanitizer: &str) -> Result<()> {
    let chosen: Vec<_> = TARGETS
        .iter()
        .filter(|(t, _)| filter.is_none_or(|f| t.contains(f)))
        .collect();
    ensure!(!chosen.is_empty(), "no fuzz target matches {filter:?}");
    let root = workspace_root();
    let started = Instant::now();
    println!(
        "==> fuzz build: every target of {FUZZ_DIR}/ (instrumented build; a first build takes minutes)"
    );
    let mut build = build_command(sanitizer);
    let status = build
        .status()
        .with_context(|| format!("could not start {build:?}"))?;
    ensure!(
        status.success(),
        "building the fuzz targets failed ({status})"
    );
    println!("==> fuzz build: done in {:.0?}", started.elapsed());
    let logs = root.join("target/fuzz/logs");
    std::fs::create_dir_all(&logs).context("creating target/fuzz/logs")?;
    let started = Instant::now();
    let mut queue: VecDeque<_> = chosen.iter().copied().collect();
    let mut running: Vec<Running> = Vec::new();
    let total = chosen.len();
    let mut done = 0;
    while !queue.is_empty() || !running.is_empty() {
        while running.len() < LANES
            && let Some(&(target, what)) = queue.pop_front()
        {
            std::fs::create_dir_all(root.join(FUZZ_DIR).join("corpus").join(target))
                .context("creating the corpus directory")?;
            let log = logs.join(format!("{target}.log"));
            let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
            let mut cmd = command(target, secs, sanitizer);
            cmd.stdout(out.try_clone()?)
                .stderr(out)
                .stdin(Stdio::null());
            let child = cmd
                .spawn()
                .with_context(|| format!("could not start {cmd:?}"))?;
            println!(
                "==> fuzz {target} ({what}), {secs} s, log {}",
                log.display()
            );
            running.push(Running {
                child,
                target,
                log,
                started: Instant::now(),
            });
        }
        std::thread::sleep(Duration::from_millis(200));
        let mut i = 0;
        while i < running.len() {
            let Some(status) = running[i].child.try_wait()? else {
                i += 1;
                continue;
            };
            let r = running.swap_remove(i);
            done += 1;
            if !status.success() {
                for p in &mut running {
                    let _ = p.child.kill();
                    let _ = p.child.wait();
                }
                print_tail(&r.log, 40);
                anyhow::bail!(
                    "fuzz target {target} failed ({status}); the input is in \
                     {FUZZ_DIR}/artifacts/{target}/, replay it with `RUSTC_BOOTSTRAP=1 cargo \
                     +stable fuzz run {target} --fuzz-dir {FUZZ_DIR} <file>`",
                    target = r.target,
                );
            }
            println!(
                "==> fuzz [{done}/{total}] {}: no finding in {:.0?} ({})",
                r.target,
                r.started.elapsed(),
                final_stats(&r.log)
            );
        }
    }
    println!(
        "==> fuzz: {total} targets, {secs} s each, in {:.0?}",
        started.elapsed()
    );
    Ok(())
}

/// One fuzzing process and where its output goes.
struct Running {
    child: Child,
    target: &'static str,
    log: PathBuf,
    started: Instant,
}

/// `cargo fuzz build` of every target, into `target/fuzz`.
fn build_command(sanitizer: &str) -> Command {
    let root = workspace_root();
    let mut cmd = Command::new("rustup");
    cmd.current_dir(&root)
        .env("RUSTC_BOOTSTRAP", "1")
        .args([
            "run",
            "stable",
            "cargo",
            "fuzz",
            "build",
            "--sanitizer",
            sanitizer,
        ])
        .arg("--fuzz-dir")
        .arg(FUZZ_DIR)
        .arg("--target-dir")
        .arg(root.join("target/fuzz"));
    cmd
}

/// libFuzzer's run count and coverage from its final stats (`-print_final_stats=1`).
fn final_stats(log: &std::path::Path) -> String {
    let Ok(f) = File::open(log) else {
        return "no log".into();
    };
    let stat = |line: &str, key: &str| {
        line.strip_prefix(key)
            .and_then(|r| r.split_whitespace().last())
            .map(str::to_owned)
    };
    let (mut runs, mut cov) = (None, None);
    for line in BufReader::new(f).lines().map_while(Result::ok) {
        runs = stat(&line, "stat::number_of_executed_units:").or(runs);
        if line.starts_with('#') && line.contains(" cov: ") {
            cov = line
                .split(" cov: ")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .map(str::to_owned);
        }
    }
    format!(
        "{} runs, coverage {}",
        runs.as_deref().unwrap_or("?"),
        cov.as_deref().unwrap_or("?")
    )
}

fn print_tail(log: &std::path::Path, lines: usize) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    for line in &all[all.len().saturating_sub(lines)..] {
        println!("{line}");
    }
}
