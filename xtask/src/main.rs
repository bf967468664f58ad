//! skewless's workflows. See README.md: `cargo xtask demo` and `cargo xtask test` are the two
//! commands a fresh machine needs; both install what is missing first.

mod demo;
mod setup;

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
    /// Run the test tiers: fmt, clippy (host and bpf), unit tests, privileged tests.
    Test(TestArgs),
    /// Show the problem on one machine: a pick_first gRPC client pinned to one of 5 pods.
    Demo(demo::Args),
    /// Testbed maintenance.
    Testbed {
        #[command(subcommand)]
        cmd: TestbedCmd,
    },
}

#[derive(clap::Args)]
struct TestArgs {
    /// Only the unprivileged tiers (fmt, clippy, unit tests).
    #[arg(long, conflicts_with = "privileged")]
    unit: bool,
    /// Only the privileged tests (real eBPF, network namespaces; needs root).
    #[arg(long)]
    privileged: bool,
    /// Passed to the test binaries, e.g. a test name filter.
    #[arg(last = true)]
    test_args: Vec<String>,
}

#[derive(Subcommand)]
enum TestbedCmd {
    /// Remove the namespaces, cgroups and processes that a crashed run left behind.
    Clean,
}

fn main() -> Result<()> {
    let Cli { cmd } = Cli::parse();
    match cmd {
        Cmd::Setup => setup::ensure_installed(true),
        Cmd::Test(args) => test(args),
        Cmd::Demo(args) => {
            setup::ensure_installed(false)?;
            demo::run(&args)
        }
        Cmd::Testbed {
            cmd: TestbedCmd::Clean,
        } => {
            let (netns, cgroups) = skewless_testbed::clean_stale();
            println!("removed {netns} network namespace(s) and {cgroups} cgroup(s)");
            Ok(())
        }
    }
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

fn test(args: TestArgs) -> Result<()> {
    let TestArgs {
        unit,
        privileged,
        test_args,
    } = args;
    setup::ensure_installed(false)?;
    let started = Instant::now();
    let mut tiers: Vec<(&str, Command)> = Vec::new();
    if !privileged {
        let mut fmt = cargo();
        fmt.args(["fmt", "--all", "--check"]);
        tiers.push(("fmt", fmt));
        let mut clippy = cargo();
        clippy.args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]);
        tiers.push(("clippy (host crates)", clippy));
        tiers.push(("clippy (eBPF programs)", bpf_clippy()));
        let mut unit_tests = cargo();
        unit_tests
            .args(["test", "--workspace", "--"])
            .args(&test_args);
        tiers.push(("unit tests", unit_tests));
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
        let mut privileged_tests = cargo();
        // The privileged tests are the ones marked #[ignore = "privileged: ..."]; they run
        // here, on the real kernel, and nowhere else.
        privileged_tests
            .args(["test", "--workspace", "--", "--ignored", "--test-threads=2"])
            .args(&test_args);
        tiers.push(("privileged tests (real kernel)", privileged_tests));
    }
    let total = tiers.len();
    for (i, (name, mut cmd)) in tiers.into_iter().enumerate() {
        let t = Instant::now();
        println!("==> test [{}/{total}] {name}", i + 1);
        setup::run(&mut cmd).map_err(|e| e.context(format!("test tier `{name}` failed")))?;
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
    Ok(())
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

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}
