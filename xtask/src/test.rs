//! `cargo xtask test`: every tier of the README's test command, one after another, with one
//! passed/failed count over all of them.

use std::{path::PathBuf, process::Command, time::Instant};

use anyhow::{Context as _, Result, bail, ensure};

use crate::{cargo, fuzz, is_root, setup, target_dir, workspace_root};

#[derive(clap::Args)]
pub(crate) struct Args {
    /// Only the unprivileged tiers (fmt, clippy, docs, unit tests, fuzzing).
    #[arg(long, conflicts_with = "privileged")]
    pub(crate) unit: bool,
    /// Only the privileged tests (real eBPF, network namespaces; needs root).
    #[arg(long)]
    pub(crate) privileged: bool,
    /// Passed to the test binaries, e.g. a test name filter.
    #[arg(last = true)]
    pub(crate) test_args: Vec<String>,
}

/// Privileged tests whose bar the code does not meet yet on every run: left out of `cargo
/// xtask test` by name, said so in its output and in docs/limits.md, and run on demand with
/// `cargo test -p skewless --test connection_mode -- --ignored NAME`. Never a way to hide a
/// regression: an entry goes with an open or blocked issue, its measurement and its reason.
const BARS_NOT_MET: &[(&str, &str)] = &[(
    "connection_mode_rotation_every_second_fails_no_grpcio_call",
    "issue 13 (blocked on grpc-core's client): grpcio fails one 4 MiB call (\"GOAWAY \
         received\") in about 1 of 4 runs, 0 unary calls: grpc-core hands a call picked \
         between reading any GOAWAY and its subchannel hearing of it (another thread) to the \
         old transport, which cancels it unsent, and cannot retry it above its 256 KiB retry \
         buffer; no relay behaviour prevents it (docs/connection-mode.md)",
)];

/// How skewless-clients' `bin_dir` finds the binaries this run's test build made
/// (`skewless_clients::BIN_DIR_ENV`; xtask does not depend on the testing crates).
const BIN_DIR_ENV: &str = "SKEWLESS_TEST_BIN_DIR";

/// One tier of the run.
enum Tier {
    /// A command whose output is echoed and whose test results are counted.
    Run(Command),
    /// The test build ([`test_build`]); the later tiers are told where its binaries are.
    Build(Command),
}

pub(crate) fn run(args: Args) -> Result<()> {
    let Args {
        unit,
        privileged,
        test_args,
    } = args;
    setup::ensure_installed(Some(setup::For::Test), false)?;
    let started = Instant::now();
    // Clippy's lints ride on the test build, so every crate is compiled once; they are left
    // out when only the privileged tests run (the inner loop of a privileged test).
    let lints = !privileged;
    let mut tiers: Vec<(&str, Tier)> = Vec::new();
    if !privileged {
        let mut fmt = cargo();
        fmt.args(["fmt", "--all", "--check"]);
        tiers.push(("fmt", Tier::Run(fmt)));
    }
    let build_name = if lints {
        "clippy and the test build (warnings denied)"
    } else {
        "the test build"
    };
    tiers.push((build_name, Tier::Build(test_build(lints)?)));
    if !privileged {
        tiers.push(("clippy (eBPF programs)", Tier::Run(bpf_clippy())));
        // Broken intra-doc links and malformed doc markup fail here, not on a reader.
        let mut docs = cargo();
        docs.args(["doc", "--workspace", "--no-deps"])
            .env("RUSTDOCFLAGS", "-D warnings");
        tiers.push(("docs (warnings denied)", Tier::Run(docs)));
        // deny.toml: licences, banned/wildcard dependencies, sources (crates.io only). The
        // advisories check needs the network and is not run.
        let mut deny = cargo();
        deny.args([
            "deny",
            "check",
            "--hide-inclusion-graph",
            "licenses",
            "bans",
            "sources",
        ]);
        tiers.push(("dependency policy (cargo deny)", Tier::Run(deny)));
        // nextest runs every test in its own process, test binaries side by side, so a binary
        // whose tests wait on sockets or timers does not hold up the others; doctests (which
        // nextest does not run) follow with libtest. Both find the test build fresh.
        // Four at a time: most of these tests wait on sockets and timers (about 1.7 of the
        // two cores busy at four; the ones that load the machine are grouped in
        // .config/nextest.toml).
        let mut unit_tests = test_cargo(lints)?;
        unit_tests
            .args([
                "nextest",
                "run",
                "--workspace",
                "--no-tests=fail",
                "--test-threads=4",
                "--",
            ])
            .args(&test_args);
        tiers.push(("unit tests", Tier::Run(unit_tests)));
        let mut doc_tests = test_cargo(lints)?;
        doc_tests
            .args(["test", "--workspace", "--doc", "--"])
            .args(&test_args);
        tiers.push(("doctests", Tier::Run(doc_tests)));
        // This binary again, so the tier's output and failure go through the same runner.
        let mut fuzzing = Command::new(std::env::current_exe()?);
        fuzzing.args(["fuzz", "--secs", &fuzz::TEST_SECS.to_string()]);
        tiers.push(("fuzzing (bounded)", Tier::Run(fuzzing)));
    }
    if !unit {
        if !is_root() {
            bail!(
                "the privileged tests need root (real eBPF, network namespaces); run as root or pass --unit"
            );
        }
        let (netns, cgroups) = skewless_testbed::clean_stale();
        if netns + cgroups > 0 {
            println!(
                "removed {netns} stale namespace(s) and {cgroups} cgroup(s) from an earlier run"
            );
        }
        let mut privileged_tests = test_cargo(lints)?;
        // The privileged tests are the ones marked #[ignore = "privileged: ..."]; they run
        // here, on the real kernel, and nowhere else. Four slots, of which a test that drives
        // real clients for many seconds takes two (.config/nextest.toml): at most two of those
        // at once, as in a tier of two, with the tests that mostly wait beside them.
        privileged_tests.args([
            "nextest",
            "run",
            "--workspace",
            "--run-ignored",
            "only",
            "--test-threads=4",
        ]);
        let mut left_out = Vec::new();
        for (test, why) in BARS_NOT_MET {
            println!("==> NOT RUN (its bar is not met): {test}: {why}");
            left_out.push(format!("not test(={test})"));
        }
        if !left_out.is_empty() {
            privileged_tests.args(["-E", &left_out.join(" and ")]);
        }
        privileged_tests.arg("--").args(&test_args);
        tiers.push((
            "privileged tests (real kernel)",
            Tier::Run(privileged_tests),
        ));
    }
    let total = tiers.len();
    let mut counts = TestCounts::default();
    let mut bin_dir = None;
    for (i, (name, tier)) in tiers.into_iter().enumerate() {
        let t = Instant::now();
        println!("==> test [{}/{total}] {name}", i + 1);
        let result = match tier {
            Tier::Build(mut cmd) => run_test_build(&mut cmd).map(|dir| bin_dir = Some(dir)),
            Tier::Run(mut cmd) => {
                if let Some(dir) = &bin_dir {
                    cmd.env(BIN_DIR_ENV, dir);
                }
                run_counting(&mut cmd, &mut counts)
            }
        };
        if let Err(e) = result {
            println!("{} passed, {} failed", counts.passed, counts.failed.max(1));
            return Err(e.context(format!("test tier `{name}` failed")));
        }
        println!(
            "==> test [{}/{total}] {name}: ok in {:.1?}",
            i + 1,
            t.elapsed()
        );
    }
    println!(
        "==> all {total} test tiers passed in {:.1?}",
        started.elapsed()
    );
    // One closing line over every tier, so the total is not just the last test binary's.
    println!("{} passed, {} failed", counts.passed, counts.failed);
    Ok(())
}

/// Cargo for the test build and the tiers that run its binaries: with `lints`, the
/// workspace's own crates are compiled by clippy's driver with warnings denied (what `cargo
/// clippy -- -D warnings` runs, with code generation), dependencies by rustc. Every such
/// tier must be run alike, or cargo would build the crates again.
///
/// Without incremental compilation: a full run builds each crate once, and writing the
/// incremental caches cost a fifth of the workspace's build time (78 s against 57 s).
fn test_cargo(lints: bool) -> Result<Command> {
    let mut cmd = cargo();
    cmd.env("CARGO_INCREMENTAL", "0");
    if lints {
        let sysroot = Command::new("rustc")
            .args(["--print", "sysroot"])
            .output()
            .context("running `rustc --print sysroot`")?;
        ensure!(sysroot.status.success(), "`rustc --print sysroot` failed");
        let driver = std::path::Path::new(String::from_utf8_lossy(&sysroot.stdout).trim())
            .join("bin/clippy-driver");
        ensure!(
            driver.is_file(),
            "{} is missing: `rustup component add clippy`",
            driver.display()
        );
        // cargo-clippy's way of handing the driver its arguments, each followed by the marker.
        cmd.env("RUSTC_WORKSPACE_WRAPPER", driver).env(
            "CLIPPY_ARGS",
            "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__",
        );
    }
    Ok(cmd)
}

/// Every test binary of the workspace and the binaries the tests start (what nextest would
/// build), built once for the unit, doctest and privileged tiers.
fn test_build(lints: bool) -> Result<Command> {
    let mut cmd = test_cargo(lints)?;
    cmd.args([
        "test",
        "--workspace",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    Ok(cmd)
}

/// Runs the test build (cargo's progress and diagnostics go to the terminal) and links the
/// non-test binaries it built or found fresh into one directory, which it returns: what
/// skewless-clients' `bin_dir` then uses instead of a `cargo build` of its own, which would
/// compile the dependencies again with other features.
fn run_test_build(cmd: &mut Command) -> Result<PathBuf> {
    use std::io::{BufRead as _, BufReader};
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| anyhow::anyhow!("could not start {cmd:?}: {e}"))?;
    let mut bins = Vec::new();
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line?;
            let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
                println!("{line}");
                continue;
            };
            let is_bin = msg["reason"] == "compiler-artifact"
                && msg["profile"]["test"] == false
                && msg["target"]["kind"]
                    .as_array()
                    .is_some_and(|k| k.iter().any(|k| k == "bin"));
            if let (true, Some(exe)) = (is_bin, msg["executable"].as_str()) {
                bins.push(PathBuf::from(exe));
            }
        }
    }
    let status = child.wait()?;
    ensure!(status.success(), "{cmd:?} exited with {status}");
    let dir = target_dir().join("debug/test-run-bins");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for exe in &bins {
        let name = exe.file_name().context("an executable without a name")?;
        std::os::unix::fs::symlink(exe, dir.join(name))
            .with_context(|| format!("linking {} into {}", exe.display(), dir.display()))?;
    }
    println!("{} binaries of the build in {}", bins.len(), dir.display());
    Ok(dir)
}

#[derive(Default)]
struct TestCounts {
    passed: u64,
    failed: u64,
}

/// Runs a tier, echoing its output, and adds up libtest's `test result:` lines and nextest's
/// `Summary` line (nextest reports on stderr).
fn run_counting(cmd: &mut Command, counts: &mut TestCounts) -> Result<()> {
    use std::io::{BufRead as _, BufReader};
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| anyhow::anyhow!("could not start {cmd:?}: {e}"))?;
    let stderr = child.stderr.take().map(|err| {
        std::thread::spawn(move || {
            let mut counts = TestCounts::default();
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("{line}");
                count_line(&line, &mut counts);
            }
            counts
        })
    });
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line?;
            println!("{line}");
            count_line(&line, counts);
        }
    }
    if let Some(from_stderr) = stderr.and_then(|t| t.join().ok()) {
        counts.passed += from_stderr.passed;
        counts.failed += from_stderr.failed;
    }
    let status = child.wait()?;
    anyhow::ensure!(status.success(), "{cmd:?} exited with {status}");
    Ok(())
}

/// Adds a libtest `test result:` line or a nextest `Summary` line to `counts`.
fn count_line(line: &str, counts: &mut TestCounts) {
    let (passed, failed) = if let Some(rest) = line.strip_prefix("test result: ") {
        parse_test_result(rest)
    } else if let Some(rest) = line.trim_start().strip_prefix("Summary [") {
        parse_nextest_summary(rest)
    } else {
        return;
    };
    counts.passed += passed;
    counts.failed += failed;
}

/// Parses the part after `Summary [` of nextest's closing line, e.g.
/// `  1.234s] 418 tests run: 415 passed, 3 failed, 51 skipped`.
fn parse_nextest_summary(rest: &str) -> (u64, u64) {
    let Some((_, tally)) = rest.split_once(" run: ") else {
        return (0, 0);
    };
    // `N passed (1 slow, 2 leaky), N failed, N timed out, N skipped`: a count is the word
    // before its name.
    let words: Vec<&str> = tally
        .split_whitespace()
        .map(|w| w.trim_matches(|c: char| c == ',' || c == '(' || c == ')'))
        .collect();
    let field = |name: &str| -> u64 {
        words
            .windows(2)
            .filter(|w| w[1] == name)
            .filter_map(|w| w[0].parse::<u64>().ok())
            .sum()
    };
    (field("passed"), field("failed") + field("timed"))
}

/// Parses the part after `test result: ` of libtest's summary, e.g.
/// `ok. 2 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.00s`.
fn parse_test_result(rest: &str) -> (u64, u64) {
    let rest = rest.split_once(". ").map_or(rest, |(_, r)| r);
    let field = |word: &str| -> u64 {
        rest.split(';')
            .find_map(|f| f.trim().strip_suffix(word))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    };
    (field(" passed"), field(" failed"))
}

/// Clippy for the eBPF crate must run with the toolchain that builds it (Debian's rustc-web,
/// with its prebuilt core for bpfel-unknown-none); host clippy only sees the host stub.
fn bpf_clippy() -> Command {
    let mut cmd = Command::new("rustup");
    cmd.current_dir(workspace_root())
        .args([
            "run",
            "debian",
            "cargo",
            "clippy",
            "--package",
            "skewless-ebpf",
        ])
        .args([
            "--target",
            "bpfel-unknown-none",
            "--release",
            "--",
            "-D",
            "warnings",
        ])
        .env("RUSTC_BOOTSTRAP", "aya_ebpf")
        .env(
            "CARGO_TARGET_DIR",
            workspace_root().join("target/bpf-clippy"),
        )
        // The host toolchain's variables must not leak into the Debian toolchain's build.
        .env_remove("RUSTC")
        .env_remove("RUSTDOC")
        .env_remove("CARGO")
        .env_remove("RUSTUP_TOOLCHAIN");
    cmd
}

#[cfg(test)]
mod tests {
    use super::{parse_nextest_summary, parse_test_result};

    #[test]
    fn nextest_summaries_are_counted() {
        assert_eq!(
            parse_nextest_summary(" 117.841s] 418 tests run: 415 passed, 3 failed, 51 skipped"),
            (415, 3)
        );
        assert_eq!(
            parse_nextest_summary(" 2.000s] 12 tests run: 12 passed, 1 skipped"),
            (12, 0)
        );
        assert_eq!(
            parse_nextest_summary(
                " 9.1s] 5 tests run: 3 passed (1 slow, 1 leaky), 2 failed, 0 skipped"
            ),
            (3, 2),
            "a passed count followed by notes"
        );
        assert_eq!(
            parse_nextest_summary(" 9.1s] 4 tests run: 3 passed, 1 timed out, 0 skipped"),
            (3, 1),
            "a timed-out test is a failure"
        );
    }

    #[test]
    fn libtest_summaries_are_counted() {
        assert_eq!(
            parse_test_result(
                "ok. 2 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.00s"
            ),
            (2, 0)
        );
        assert_eq!(
            parse_test_result(
                "FAILED. 3 passed; 4 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.2s"
            ),
            (3, 4)
        );
    }
}
