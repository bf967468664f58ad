//! The fuzz tier: every cargo-fuzz target of the workspace, each for a bounded time.
//!
//! Each fuzzed crate keeps its own `fuzz/` (as h2 and linkerd do), a workspace of its own
//! because the build needs sanitizer flags the main workspace never sees. cargo-fuzz passes
//! `-Z` flags, so it runs on rustup's stable toolchain with `RUSTC_BOOTSTRAP=1` (nightly cannot
//! be installed on these machines); all targets share one target directory
//! (`target/fuzz`), so their common dependencies are built once. A target's corpus grows in
//! `<crate>/fuzz/corpus/<target>` (not committed) and starts from the committed seeds in
//! `<crate>/fuzz/seeds/<target>` when there are any; a finding is written to
//! `<crate>/fuzz/artifacts/<target>/` and fails the tier.

use std::{process::Command, time::Instant};

use anyhow::{Context as _, Result, ensure};

use crate::workspace_root;

/// Every fuzz target: (fuzz directory, target name, what it feeds).
pub(crate) const TARGETS: &[(&str, &str, &str)] = &[
    (
        "agent/conntrack/fuzz",
        "decode",
        "datagrams from the conntrack socket",
    ),
    (
        "agent/model/fuzz",
        "annotations",
        "skewless.io/* annotation values",
    ),
    (
        "agent/services-file/fuzz",
        "services_file",
        "the services file, then the model index",
    ),
    (
        "agent/balancer/fuzz",
        "grpc_headers",
        "grpc-timeout and grpc-status values",
    ),
    (
        "agent/balancer/fuzz",
        "health",
        "grpc.health.v1 Watch responses, in any pieces",
    ),
    (
        "agent/balancer/fuzz",
        "relay",
        "both peers of connection mode's relay, rotated at any point",
    ),
    (
        "agent/frame/fuzz",
        "frames",
        "HTTP/2 frames and gRPC messages (skewless-frame)",
    ),
];

/// Seconds per target in `cargo xtask test`: 7 targets, 3.5 minutes of fuzzing.
pub(crate) const TEST_SECS: u64 = 30;

/// The command that fuzzes one target for `secs` seconds.
fn command(dir: &str, target: &str, secs: u64) -> Command {
    let root = workspace_root();
    let mut cmd = Command::new("rustup");
    cmd.current_dir(&root)
        .env("RUSTC_BOOTSTRAP", "1")
        .args(["run", "stable", "cargo", "fuzz", "run", target])
        .arg("--fuzz-dir")
        .arg(dir)
        .arg("--target-dir")
        .arg(root.join("target/fuzz"));
    let corpus = root.join(dir).join("corpus").join(target);
    let seeds = root.join(dir).join("seeds").join(target);
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
    cmd
}

/// Fuzzes the targets whose name contains `filter` (all without one) for `secs` seconds each.
///
/// # Errors
/// When a target fails to build or finds a crash, hang or leak.
pub(crate) fn run(secs: u64, filter: Option<&str>) -> Result<()> {
    let chosen: Vec<_> = TARGETS
        .iter()
        .filter(|(_, t, _)| filter.is_none_or(|f| t.contains(f)))
        .collect();
    ensure!(!chosen.is_empty(), "no fuzz target matches {filter:?}");
    for (i, (dir, target, what)) in chosen.iter().enumerate() {
        let started = Instant::now();
        println!(
            "==> fuzz [{}/{}] {target} ({what}), {secs} s (a first build takes minutes)",
            i + 1,
            chosen.len()
        );
        std::fs::create_dir_all(workspace_root().join(dir).join("corpus").join(target))
            .context("creating the corpus directory")?;
        let mut cmd = command(dir, target, secs);
        let status = cmd
            .status()
            .with_context(|| format!("could not start {cmd:?}"))?;
        ensure!(
            status.success(),
            "fuzz target {target} failed ({status}); the input is in {dir}/artifacts/{target}/, \
             replay it with `RUSTC_BOOTSTRAP=1 cargo +stable fuzz run {target} --fuzz-dir {dir} <file>`"
        );
        println!(
            "==> fuzz [{}/{}] {target}: no finding in {:.0?}",
            i + 1,
            chosen.len(),
            started.elapsed()
        );
    }
    Ok(())
}
