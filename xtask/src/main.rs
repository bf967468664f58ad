//! skewless's workflows. See README.md: `cargo xtask demo` and `cargo xtask test` are the two
//! commands a fresh machine needs; both install what is missing first.

mod demo;
mod fuzz;
mod image;
mod setup;
mod test;

use std::{path::PathBuf, process::Command, time::Instant};

use anyhow::{Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "skewless workflows: setup, tests, demo, testbed maintenance")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install the eBPF toolchain, network tools, benchmark peers and Python gRPC (idempotent).
    Setup,
    /// Run the test tiers: fmt, clippy (host and bpf), docs, unit tests, fuzzing (18 s per
    /// target), privileged tests.
    Test(test::Args),
    /// Run the cargo-fuzz targets (parsers of peer and user input) for longer than the test
    /// tier does.
    Fuzz(FuzzArgs),
    /// Show the problem on one machine: a pick_first gRPC client pinned to one of 5 pods.
    Demo(demo::Args),
    /// Benchmarks: the connect4 hook's run time per call (kernel accounting, needs root), then
    /// skewless-proxy side by side with direct, HAProxy and nginx, then h2load's calls through
    /// HAProxy h2 and skewless-proxy (docs/benchmarks.md).
    Bench(BenchArgs),
    /// Build the agent's container image with podman (or docker: SKEWLESS_ENGINE=docker):
    /// base images from Debian's archive, then deploy/Dockerfile (docs/install.md).
    Image(image::Args),
    /// Regenerate deploy/monitoring/prometheusrule.yaml from the rules file
    /// (deploy/monitoring/skewless.rules.yaml, the source).
    Monitoring,
    /// Testbed maintenance.
    Testbed {
        #[command(subcommand)]
        cmd: TestbedCmd,
    },
}

#[derive(clap::Args)]
struct FuzzArgs {
    /// Seconds per target.
    #[arg(long, default_value_t = 300)]
    secs: u64,
    /// Only the targets whose name contains this (decode, annotations, services_file,
    /// grpc_headers, health, relay, frames, request_paths).
    target: Option<String>,
    /// cargo-fuzz's sanitizer: `none` (coverage only; the fuzzed crates forbid unsafe code),
    /// or `address`, `leak`, `memory`, `thread` for a deeper run.
    #[arg(long, default_value = "none")]
    sanitizer: String,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Only the connect4 hook benchmark.
    #[arg(long, conflicts_with_all = ["proxies_only", "scrape_only", "hostile_only", "observer_only", "scale_only"])]
    hook_only: bool,
    /// Only the proxy comparison (no root needed).
    #[arg(long, conflicts_with_all = ["scrape_only", "hostile_only", "observer_only", "scale_only"])]
    proxies_only: bool,
    /// Only the observer at node scale: the real agent (`dist` build) observing 10,000
    /// connections with 100,000 conntrack entries in its node, then a full connection map
    /// (needs root; about 2 minutes). Written to docs/benchmarks.md.
    #[arg(long, conflicts_with_all = ["scrape_only", "hostile_only", "scale_only"])]
    observer_only: bool,
    /// Only the agent at cluster scale: the real agent (`dist` build) against the fake API
    /// server with 1,000-10,000 Services x 10-50 endpoints, 10 opted in: time and CPU to
    /// ready, memory across churn and forced relists, CPU under slice churn, opt-in latency
    /// (needs root; about 5 minutes). Written to docs/benchmarks.md. Pass
    /// `-- --agent LABEL=PATH` to run another agent binary beside it.
    #[arg(long, conflicts_with_all = ["scrape_only", "hostile_only"])]
    scale_only: bool,
    /// Also build skewless-proxy at this git revision (into target/bench-baseline/, its own
    /// target directory) and run it beside this tree's as `skewless@REV`, compared run by run:
    /// the before/after figures of a data-path change, e.g. `--baseline ae9ca9d -- --targets
    /// skewless,skewless@ae9ca9d`.
    #[arg(long, value_name = "REV")]
    baseline: Vec<String>,
    /// Only the metrics cardinality benchmark: one scrape at 100 Services x 50 backends
    /// (series, bytes, encode time; no root needed).
    #[arg(long, conflicts_with = "hostile_only")]
    scrape_only: bool,
    /// Only the hostile-clients memory benchmark: a balancer's RSS under 1,000 hostile
    /// connections (500 silent, 500 PING-sending non-readers), both modes (no root needed).
    #[arg(long)]
    hostile_only: bool,
    /// Passed to skewless-bench, e.g. `-- --delays 50 --connections 1,2 --repeats 1` (see
    /// `cargo run -p skewless-bench --bin skewless-bench -- --help`).
    #[arg(last = true)]
    bench_args: Vec<String>,
}

#[derive(Subcommand)]
enum TestbedCmd {
    /// Remove the namespaces, cgroups and processes that a crashed run left behind.
    Clean,
}

fn main() -> Result<()> {
    let Cli { cmd } = Cli::parse();
    match cmd {
        Cmd::Setup => setup::ensure_installed(None, true),
        Cmd::Test(args) => test::run(args),
        Cmd::Fuzz(FuzzArgs {
            secs,
            target,
            sanitizer,
        }) => {
            setup::ensure_installed(Some(setup::For::Fuzz), false)?;
            fuzz::run(secs, target.as_deref(), &sanitizer)
        }
        Cmd::Demo(args) => {
            setup::ensure_installed(Some(setup::For::Demo), false)?;
            demo::run(&args)
        }
        Cmd::Bench(args) => {
            setup::ensure_installed(Some(setup::For::Bench), false)?;
            let only = args.hook_only
                || args.proxies_only
                || args.scrape_only
                || args.hostile_only
                || args.observer_only
                || args.scale_only;
            if args.hook_only || !only {
                hook_bench()?;
            }
            if args.scrape_only || !only {
                scrape_bench()?;
            }
            if args.hostile_only || !only {
                hostile_bench()?;
            }
            if args.observer_only || !only {
                observer_bench(&args)?;
            }
            if args.scale_only || !only {
                scale_bench(&args)?;
            }
            if args.proxies_only || !only {
                proxy_bench(&args)?;
            }
            Ok(())
        }
        Cmd::Image(args) => {
            setup::ensure_installed(None, false)?;
            image::run(&args)
        }
        Cmd::Monitoring => monitoring(),
        Cmd::Testbed {
            cmd: TestbedCmd::Clean,
        } => {
            let (netns, cgroups) = skewless_testbed::clean_stale();
            println!("removed {netns} network namespace(s) and {cgroups} cgroup(s)");
            Ok(())
        }
    }
}

/// Writes the PrometheusRule generated from the rules file.
fn monitoring() -> Result<()> {
    use anyhow::Context as _;
    use skewless_admin::monitoring;
    let dir = monitoring::dir();
    let rules_path = dir.join(monitoring::RULES_FILE);
    let rules = std::fs::read_to_string(&rules_path)
        .with_context(|| format!("reading {}", rules_path.display()))?;
    let out = dir.join(monitoring::PROMETHEUS_RULE_FILE);
    std::fs::write(&out, monitoring::prometheus_rule(&rules))
        .with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}

/// The metrics cardinality benchmark (skewless-admin's `scrape_bench` example): fails when
/// a scrape at 100 Services x 50 backends exceeds 40,000 series or 50 ms.
fn scrape_bench() -> Result<()> {
    println!("==> bench: one /metrics scrape at 100 Services x 50 backends");
    run_release_target(
        "the scrape benchmark",
        "skewless-admin",
        "--example",
        "scrape_bench",
    )
}

/// The hostile-clients memory benchmark (skewless-bench's `skewless-hostile-bench`): a
/// balancer process's RSS with 1,000 hostile connections open, in both modes; fails if the
/// good client beside them loses a call.
fn hostile_bench() -> Result<()> {
    println!("==> bench: balancer memory under 1,000 hostile client connections");
    run_release_target(
        "the hostile-clients benchmark",
        "skewless-bench",
        "--bin",
        "skewless-hostile-bench",
    )
}

fn hook_bench() -> Result<()> {
    if !is_root() {
        bail!(
            "the connect4 hook benchmark needs root (real eBPF, network namespaces); run as root or pass --proxies-only"
        );
    }
    println!("==> bench: connect4 hook run time (kernel BPF stats, one sample per connect)");
    run_release_target(
        "the hook benchmark",
        "skewless-bench",
        "--bin",
        "skewless-hook-bench",
    )
}

/// The observer at node scale (skewless-bench's `skewless-observer-bench`): the `dist` agent,
/// as it ships, in a testbed node whose conntrack table holds 100,000 entries; its figures are
/// written to docs/benchmarks.md.
fn observer_bench(args: &BenchArgs) -> Result<()> {
    if !is_root() {
        bail!(
            "the observer benchmark needs root (real eBPF, network namespaces, ctnetlink); run as root or pass --proxies-only"
        );
    }
    println!(
        "==> bench: the observer at node scale (100,000 conntrack entries, 10,000 connections)"
    );
    // Two builds: the agent alone, as it ships; the driver needs no speed.
    build_dist_agent()?;
    build(
        "bench: building the observer benchmark",
        &[
            "--package",
            "skewless-bench",
            "--bin",
            "skewless-observer-bench",
        ],
    )?;
    let dist = target_dir().join("dist");
    let mut shown = String::from("cargo xtask bench --observer-only");
    if !args.bench_args.is_empty() {
        shown.push_str(" -- ");
        shown.push_str(&shell_words(&args.bench_args));
    }
    let mut cmd = Command::new(target_dir().join("debug/skewless-observer-bench"));
    cmd.arg("--agent")
        .arg(dist.join("skewless"))
        .arg("--write")
        .arg(workspace_root().join("docs/benchmarks.md"))
        .arg("--command")
        .arg(shown);
    if args.observer_only {
        cmd.args(&args.bench_args);
    }
    setup::run(&mut cmd)
}

/// The agent alone, as it ships (`target/dist/skewless`): built with other packages, cargo would
/// unify their dependencies' features and build a different agent.
fn build_dist_agent() -> Result<()> {
    build(
        "bench: building the agent",
        &[
            "--profile",
            "dist",
            "--package",
            "skewless",
            "--bin",
            "skewless",
        ],
    )
}

/// The agent at cluster scale (skewless-bench's `skewless-scale-bench`): the `dist` agent
/// against the fake API server; written to docs/benchmarks.md.
fn scale_bench(args: &BenchArgs) -> Result<()> {
    if !is_root() {
        bail!("the scale benchmark needs root (the agent loads its eBPF programs); run as root");
    }
    println!("==> bench: the agent at cluster scale (1,000-10,000 Services, fake API server)");
    build_dist_agent()?;
    // Optimized: it generates up to 1,000 slice changes a second beside the agent.
    build(
        "bench: building the scale benchmark",
        &[
            "--release",
            "--package",
            "skewless-bench",
            "--bin",
            "skewless-scale-bench",
        ],
    )?;
    let mut shown = String::from("cargo xtask bench --scale-only");
    if args.scale_only && !args.bench_args.is_empty() {
        shown.push_str(" -- ");
        shown.push_str(&shell_words(&args.bench_args));
    }
    let mut cmd = Command::new(target_dir().join("release/skewless-scale-bench"));
    cmd.arg("--agent")
        .arg(format!(
            "this tree={}",
            target_dir().join("dist/skewless").display()
        ))
        .arg("--write")
        .arg(workspace_root().join("docs/benchmarks.md"))
        .arg("--command")
        .arg(shown);
    if args.scale_only {
        cmd.args(&args.bench_args);
    }
    setup::run(&mut cmd)
}

/// The side-by-side proxy benchmark: `dist` (release + LTO) binaries of the echo pods, the
/// load generator and skewless-proxy, driven by skewless-bench (which finds the others next to itself), with the
/// results written to docs/benchmarks.md.
fn proxy_bench(args: &BenchArgs) -> Result<()> {
    println!("==> bench: skewless-proxy side by side with direct, HAProxy and nginx");
    // The shipped build (see `[profile.dist]` in Cargo.toml): what users run is what is
    // measured.
    build(
        "bench: building the echo pods, the load generator and skewless-proxy",
        &[
            "--profile",
            "dist",
            "--package",
            "skewless-echo",
            "--package",
            "skewless-loadgen",
            "--package",
            "skewless-bench",
        ],
    )?;
    let mut shown = String::from("cargo xtask bench");
    if args.proxies_only {
        shown.push_str(" --proxies-only");
    }
    let mut builds = Vec::new();
    for rev in &args.baseline {
        let (label, bin) = baseline_proxy(rev)?;
        shown.push_str(&format!(" --baseline {rev}"));
        builds.push(format!("{label}={}", bin.display()));
    }
    if !args.bench_args.is_empty() {
        shown.push_str(" -- ");
        shown.push_str(&shell_words(&args.bench_args));
    }
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--profile",
        "dist",
        "--quiet",
        "--package",
        "skewless-bench",
        "--bin",
        "skewless-bench",
        "--",
    ])
    .arg("--write")
    .arg(workspace_root().join("docs/benchmarks.md"))
    .arg("--command")
    .arg(shown);
    for b in builds {
        cmd.arg("--skewless-build").arg(b);
    }
    cmd.args(&args.bench_args);
    setup::run(&mut cmd)
}

/// Builds one target of `package` in `release` (`kind` is `--bin` or `--example`), with
/// progress as [`build`], and runs it: the scrape, hostile-clients and hook benchmarks.
fn run_release_target(what: &str, package: &str, kind: &str, name: &str) -> Result<()> {
    build(
        &format!("bench: building {what}"),
        &["--release", "--package", package, kind, name],
    )?;
    let mut cmd = cargo();
    cmd.args(["run", "--release", "--quiet", "--package", package])
        .args([kind, name]);
    setup::run(&mut cmd)
}

/// `cargo build ARGS` with cargo's own progress visible (its progress bar on a terminal, a
/// `Compiling <crate>` line per crate otherwise), so a first build that takes minutes on a
/// fresh machine shows that it is working. What runs the result afterwards may be `--quiet`:
/// by then there is nothing left to build.
pub(crate) fn build(what: &str, args: &[&str]) -> Result<()> {
    println!("==> {what} (cargo's progress follows; a first build takes a few minutes)");
    let started = Instant::now();
    setup::run(cargo().arg("build").args(args))?;
    println!("==> {what}: done in {:.0?}", started.elapsed());
    Ok(())
}

/// Builds skewless-proxy as it was at `rev` (`dist` profile, like this tree's) from a `git
/// archive` of that revision under `target/bench-baseline/<commit>/`, with its own target
/// directory so neither build disturbs the other; keeps only the binary (a commit's build
/// never changes, so a second call reuses it) and returns the label (the short commit) and
/// the binary.
fn baseline_proxy(rev: &str) -> Result<(String, PathBuf)> {
    let root = workspace_root();
    let git = |args: &[&str]| -> Result<String> {
        let mut cmd = Command::new("git");
        cmd.current_dir(&root).args(args);
        Ok(setup::output(&mut cmd)?.trim().to_owned())
    };
    let commit = git(&[
        "rev-parse",
        "--verify",
        "--short",
        &format!("{rev}^{{commit}}"),
    ])?;
    let dir = root.join("target/bench-baseline").join(&commit);
    let bin = dir.join("skewless-proxy");
    if bin.exists() {
        println!("==> bench: baseline {commit}: reusing {}", bin.display());
        return Ok((commit, bin));
    }
    let src = dir.join("src");
    if !src.join("Cargo.toml").exists() {
        println!(
            "==> bench: baseline {commit}: unpacking its tree into {}",
            src.display()
        );
        std::fs::create_dir_all(&src)?;
        let archive = dir.join("src.tar");
        git(&["archive", "--output", &archive.to_string_lossy(), &commit])?;
        setup::run(
            Command::new("tar")
                .arg("-xf")
                .arg(&archive)
                .arg("-C")
                .arg(&src),
        )?;
        std::fs::remove_file(&archive)?;
    }
    println!(
        "==> bench: baseline {commit}: building skewless-proxy (dist profile, its own target \
         directory: a first build takes many minutes; cargo's progress follows)"
    );
    let mut build = cargo();
    build
        .current_dir(&src)
        .args(["build", "--profile", "dist", "--package", "skewless-bench"])
        .args(["--bin", "skewless-proxy", "--target-dir"])
        .arg(dir.join("target"));
    setup::run(&mut build)?;
    std::fs::copy(dir.join("target/dist/skewless-proxy"), &bin)?;
    // The sources and the build take ~250 MB; the binary is all a run needs.
    std::fs::remove_dir_all(dir.join("target"))?;
    std::fs::remove_dir_all(&src)?;
    Ok((commit, bin))
}

/// `args` as one would type them: an argument with a space or a shell metacharacter in
/// double quotes, so a command written into the docs (`--section "## ..."`) runs as shown.
fn shell_words(args: &[String]) -> String {
    args.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || ",.-_=/@:".contains(c))
            {
                a.clone()
            } else {
                format!("\"{}\"", a.replace('\\', "\\\\").replace('"', "\\\""))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Cargo's target directory (`CARGO_TARGET_DIR`, or `target/` in the workspace).
pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace_root().join("target"), PathBuf::from)
}

pub(crate) fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

pub(crate) fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::{Cli, Cmd, shell_words};

    #[test]
    fn bench_arguments_with_spaces_are_shown_quoted() {
        let args: Vec<String> = [
            "--section",
            "## Request mode (issues 10, 11)",
            "--repeats",
            "4",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            shell_words(&args),
            "--section \"## Request mode (issues 10, 11)\" --repeats 4"
        );
        assert_eq!(shell_words(&[r#"a"b"#.to_owned()]), r#""a\"b""#);
    }

    #[test]
    fn bench_flags_and_pass_through() {
        let Cli {
            cmd: Cmd::Bench(args),
        } = Cli::try_parse_from([
            "xtask",
            "bench",
            "--proxies-only",
            "--",
            "--connections",
            "1,2",
        ])
        .unwrap()
        else {
            panic!("not bench");
        };
        assert!(args.proxies_only && !args.hook_only);
        assert_eq!(args.bench_args, ["--connections", "1,2"]);
        assert!(args.baseline.is_empty());
        let Cli {
            cmd: Cmd::Bench(args),
        } = Cli::try_parse_from(["xtask", "bench", "--proxies-only", "--baseline", "ae9ca9d"])
            .unwrap()
        else {
            panic!("not bench");
        };
        assert_eq!(args.baseline, ["ae9ca9d"]);
        assert!(Cli::try_parse_from(["xtask", "bench", "--hook-only", "--proxies-only"]).is_err());
    }
}
