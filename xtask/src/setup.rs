//! `cargo xtask setup`: installs everything skewless needs on a fresh Debian 12 machine.
//!
//! Every step checks first and installs only what is missing, so running it again is cheap.
//! On failure the error names the step and the command that failed.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail, ensure};

/// Debian packages every build and the demo need: the eBPF toolchain (rustc-web with its
/// prebuilt `core` for bpfel-unknown-none) and the network tools the testbed drives.
const DEBIAN_PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "libstd-rust-web-dev-bpf",
    "iproute2",
    "nftables",
    "conntrack",
    "util-linux",
    "procps",
];

/// Debian packages of the tests and the benchmark only: clippy for the eBPF programs, the
/// peers the benchmark compares against, h2load (nghttp2-client) as its third-party load
/// generator, valgrind and perf for the benchmark's load-independent counts per call
/// (`--instructions`), Prometheus (server and promtool) for the rule tests and the scrape
/// tests, and Chromium for the status page's browser test (headless, driven over the DevTools
/// protocol on a pipe).
const DEBIAN_TEST_PACKAGES: &[&str] = &[
    "rust-web-clippy",
    "haproxy",
    "nginx-light",
    "nghttp2-client",
    "valgrind",
    "linux-perf",
    "prometheus",
    "chromium",
    // The container tier and `cargo xtask image`: podman with runc (crun refuses hybrid
    // cgroup layouts), base images from Debian's archive with mmdebstrap, binutils' objcopy
    // to strip the agent.
    "podman",
    "buildah",
    "runc",
    "mmdebstrap",
    "uidmap",
    "binutils",
    // Counts the programs attached to a cgroup in the container tests.
    "bpftool",
];

/// bpf-linker version that links objects from Debian's rustc-web (see EBPF-TOOLCHAIN.md).
const BPF_LINKER_VERSION: &str = "0.13.0";

/// cargo-fuzz version the fuzz tier runs (`cargo xtask fuzz`, `cargo xtask test`).
const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// cargo-nextest version the unit and privileged tiers run (these machines ship it).
const CARGO_NEXTEST_VERSION: &str = "0.9.143";

/// cargo-deny version the dependency-policy tier runs (`deny.toml`, `cargo xtask test`).
const CARGO_DENY_VERSION: &str = "0.20.2";

/// Python packages for the independent gRPC peers (grpcio clients and servers), and
/// kubernetes-validate with the Kubernetes API schemas the manifest tests check deploy/ against.
const PYTHON_PACKAGES: &[&str] = &[
    "grpcio==1.85.*",
    "grpcio-tools==1.85.*",
    "grpcio-health-checking==1.85.*",
    "kubernetes-validate==1.37.0",
];

/// The commands that install what they need first; `cargo xtask setup` installs what all of
/// them need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum For {
    Demo,
    Test,
    Fuzz,
    Bench,
}

use For::{Bench, Demo, Fuzz, Test};

struct Step {
    name: &'static str,
    /// The commands that use what this step installs.
    needed_by: &'static [For],
    missing: fn() -> Option<String>,
    install: fn() -> Result<()>,
}

const STEPS: &[Step] = &[
    Step {
        name: "Debian packages (eBPF toolchain, testbed tools)",
        needed_by: &[Demo, Test, Bench],
        missing: || missing_packages(DEBIAN_PACKAGES),
        install: || install_packages(DEBIAN_PACKAGES),
    },
    Step {
        name: "Debian packages (test and benchmark peers and tools)",
        needed_by: &[Test, Bench],
        missing: || missing_packages(DEBIAN_TEST_PACKAGES),
        install: || install_packages(DEBIAN_TEST_PACKAGES),
    },
    Step {
        name: "rustup toolchain `debian`",
        needed_by: &[Demo, Test, Bench],
        missing: missing_debian_toolchain,
        install: link_debian_toolchain,
    },
    Step {
        name: "bpf-linker",
        needed_by: &[Demo, Test, Bench],
        missing: missing_bpf_linker,
        install: install_bpf_linker,
    },
    Step {
        name: "Python venv with grpcio",
        needed_by: &[Demo, Test, Bench],
        missing: missing_venv,
        install: install_venv,
    },
    Step {
        name: "Node.js with @grpc/grpc-js",
        needed_by: &[Test, Bench],
        missing: missing_node_clients,
        install: install_node_clients,
    },
    Step {
        name: "rustfmt and clippy",
        needed_by: &[Test],
        missing: missing_rust_components,
        install: install_rust_components,
    },
    Step {
        name: "cargo-fuzz (the fuzz tier)",
        needed_by: &[Test, Fuzz],
        missing: missing_cargo_fuzz,
        install: install_cargo_fuzz,
    },
    Step {
        name: "cargo-nextest (runs the unit and privileged tests)",
        needed_by: &[Test],
        missing: || missing_cargo_subcommand("nextest", CARGO_NEXTEST_VERSION),
        install: || install_cargo_subcommand("nextest", CARGO_NEXTEST_VERSION),
    },
    Step {
        name: "cargo-deny (the dependency-policy tier)",
        needed_by: &[Test],
        missing: missing_cargo_deny,
        install: install_cargo_deny,
    },
    Step {
        name: "kubectl (renders deploy/ with kustomize)",
        needed_by: &[Test],
        missing: missing_kubectl,
        install: install_kubectl,
    },
];

/// The steps `command` needs, in order (all of them for `None`, i.e. `cargo xtask setup`).
fn steps_for(command: Option<For>) -> Vec<&'static Step> {
    STEPS
        .iter()
        .filter(|s| command.is_none_or(|c| s.needed_by.contains(&c)))
        .collect()
}

/// Where the Python venv lives: outside the checkout, so fresh clones on the same machine
/// reuse it.
pub fn venv() -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/skewless/venv")
}

pub fn venv_python() -> PathBuf {
    venv().join("bin/python")
}

/// Runs every step that `command` needs (every step for `None`, i.e. `cargo xtask setup`)
/// whose check finds something missing. With `verbose`, also reports steps that are already
/// satisfied.
pub fn ensure_installed(command: Option<For>, verbose: bool) -> Result<()> {
    let steps = steps_for(command);
    let n = steps.len();
    let todo: Vec<(usize, &Step, String)> = steps
        .iter()
        .enumerate()
        .filter_map(|(i, s)| (s.missing)().map(|why| (i, *s, why)))
        .collect();
    if todo.is_empty() {
        if verbose {
            println!("setup: everything is installed ({n} steps checked)");
        }
        return Ok(());
    }
    for (i, step, why) in todo {
        let started = Instant::now();
        println!("==> setup [{}/{n}] {}: {why}", i + 1, step.name);
        (step.install)()
            .with_context(|| format!("setup step {}/{n} ({}) failed", i + 1, step.name))?;
        if let Some(still) = (step.missing)() {
            bail!(
                "setup step {}/{n} ({}) ran but is still incomplete: {still}",
                i + 1,
                step.name
            );
        }
        println!(
            "==> setup [{}/{n}] {}: done in {:.0?}",
            i + 1,
            step.name,
            started.elapsed()
        );
    }
    Ok(())
}

fn missing_packages(packages: &'static [&'static str]) -> Option<String> {
    let missing = packages_missing(packages);
    (!missing.is_empty()).then(|| format!("installing {}", missing.join(" ")))
}

fn packages_missing(packages: &'static [&'static str]) -> Vec<&'static str> {
    packages
        .iter()
        .copied()
        .filter(|p| {
            !Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .output()
                .is_ok_and(|o| o.status.success() && o.stdout.ends_with(b"installed"))
        })
        .collect()
}

fn install_packages(packages: &'static [&'static str]) -> Result<()> {
    let missing = packages_missing(packages);
    run(Command::new("apt-get").args(["update", "-q"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn missing_debian_toolchain() -> Option<String> {
    let listed = output(Command::new("rustup").args(["toolchain", "list"])).unwrap_or_default();
    (!listed.lines().any(|l| l.starts_with("debian")))
        .then(|| "linking /usr as `debian`".to_owned())
}

fn link_debian_toolchain() -> Result<()> {
    run(Command::new("rustup").args(["toolchain", "link", "debian", "/usr"]))
}

fn missing_bpf_linker() -> Option<String> {
    match output(Command::new("bpf-linker").arg("--version")) {
        Ok(v) if v.contains(BPF_LINKER_VERSION) => None,
        Ok(v) => Some(format!("found {}, need {BPF_LINKER_VERSION}", v.trim())),
        Err(_) => Some(format!(
            "building bpf-linker {BPF_LINKER_VERSION} against rustc-web's LLVM"
        )),
    }
}

/// Builds bpf-linker against the same libLLVM that rustc-web uses: bitcode from one LLVM major
/// cannot be linked by another.
fn install_bpf_linker() -> Result<()> {
    let vv = output(Command::new("rustup").args(["run", "debian", "rustc", "-vV"]))?;
    let major = vv
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("rustc-web did not report its LLVM version")?
        .to_owned();
    let lib = std::fs::read_dir("/usr/lib/x86_64-linux-gnu")?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with(&format!("libLLVM.so.{major}")) || n == format!("libLLVM-{major}.so")
            })
        })
        .with_context(|| format!("no libLLVM for LLVM {major} in /usr/lib/x86_64-linux-gnu"))?;
    // bpf-linker's build script only needs a prefix containing lib/libLLVM.so.
    let prefix = std::env::temp_dir().join(format!("skewless-llvm-{major}"));
    std::fs::create_dir_all(prefix.join("lib"))?;
    let link = prefix.join("lib/libLLVM.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&lib, &link)?;
    run(Command::new("cargo")
        .args([
            "+stable",
            "install",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
        ])
        .args([
            "--no-default-features",
            "--features",
            &format!("llvm-{major}"),
        ])
        .env("LLVM_PREFIX", &prefix))
}

fn missing_venv() -> Option<String> {
    let ok = Command::new(venv_python())
        .args([
            "-c",
            "import grpc, grpc_tools, grpc_health, kubernetes_validate",
        ])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    (!ok).then(|| {
        format!(
            "creating {} with {}",
            venv().display(),
            PYTHON_PACKAGES.join(" ")
        )
    })
}

fn install_venv() -> Result<()> {
    if !venv_python().exists() {
        run(Command::new("python3").arg("-m").arg("venv").arg(venv()))?;
    }
    run(Command::new(venv_python())
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
        ])
        .args(PYTHON_PACKAGES))
}

/// Where the grpc-js client's npm packages live (`node_modules` below it): outside the
/// checkout like the venv, so fresh clones on the same machine reuse it.
pub fn node_dir() -> PathBuf {
    venv().with_file_name("node")
}

/// The npm packages of the grpc-js client, exactly as testing/node/package-lock.json pins them
/// (and their dependencies with them). The check reads these versions back from the installed
/// packages.
pub const NODE_PACKAGES: &[(&str, &str)] =
    &[("@grpc/grpc-js", "1.14.7"), ("@grpc/proto-loader", "0.8.1")];

fn node_manifest_dir() -> PathBuf {
    crate::workspace_root().join("testing/node")
}

fn missing_node_clients() -> Option<String> {
    if output(Command::new("node").arg("--version")).is_err()
        || output(Command::new("npm").arg("--version")).is_err()
    {
        return Some("installing Debian's nodejs and npm, then the grpc-js client".to_owned());
    }
    let wrong: Vec<String> = NODE_PACKAGES
        .iter()
        .filter(|(name, version)| {
            let manifest = node_dir()
                .join("node_modules")
                .join(name)
                .join("package.json");
            let found = std::fs::read_to_string(&manifest).unwrap_or_default();
            !found.contains(&format!("\"version\": \"{version}\""))
        })
        .map(|(name, version)| format!("{name}@{version}"))
        .collect();
    // The lock file is what `npm ci` installed from: a changed one is a reinstall.
    let lock = std::fs::read(node_manifest_dir().join("package-lock.json")).ok();
    let installed_lock = std::fs::read(node_dir().join("package-lock.json")).ok();
    if !wrong.is_empty() || lock != installed_lock {
        return Some(format!(
            "npm ci of {} into {}",
            NODE_PACKAGES
                .iter()
                .map(|(n, v)| format!("{n}@{v}"))
                .collect::<Vec<_>>()
                .join(" "),
            node_dir().display()
        ));
    }
    None
}

fn install_node_clients() -> Result<()> {
    if output(Command::new("node").arg("--version")).is_err()
        || output(Command::new("npm").arg("--version")).is_err()
    {
        run(Command::new("apt-get")
            .args([
                "install",
                "-y",
                "-q",
                "--no-install-recommends",
                "nodejs",
                "npm",
            ])
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    let dir = node_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for file in ["package.json", "package-lock.json"] {
        let from = node_manifest_dir().join(file);
        std::fs::copy(&from, dir.join(file))
            .with_context(|| format!("copying {} to {}", from.display(), dir.display()))?;
    }
    // `npm ci`: exactly the lock file's versions, node_modules replaced whole. No install
    // scripts: none of these packages needs one to work (protobufjs's only checks versions).
    run(Command::new("npm")
        .args([
            "ci",
            "--no-audit",
            "--no-fund",
            "--ignore-scripts",
            "--loglevel=http",
        ])
        .current_dir(&dir))
}

/// These machines' image ships kubectl; where it does not, Debian's `kubernetes-client`
/// provides one with `kubectl kustomize`.
fn missing_kubectl() -> Option<String> {
    let ok = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    (!ok).then(|| "installing Debian's kubernetes-client".to_owned())
}

fn install_kubectl() -> Result<()> {
    run(Command::new("apt-get")
        .args([
            "install",
            "-y",
            "-q",
            "--no-install-recommends",
            "kubernetes-client",
        ])
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn missing_rust_components() -> Option<String> {
    let ok = |sub: &str| {
        Command::new("cargo")
            .args([sub, "--version"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    (!(ok("fmt") && ok("clippy"))).then(|| "adding rustfmt and clippy".to_owned())
}

fn install_rust_components() -> Result<()> {
    run(Command::new("rustup").args(["component", "add", "rustfmt", "clippy"]))
}

fn missing_cargo_fuzz() -> Option<String> {
    missing_cargo_subcommand("fuzz", CARGO_FUZZ_VERSION)
}

fn install_cargo_fuzz() -> Result<()> {
    install_cargo_subcommand("fuzz", CARGO_FUZZ_VERSION)
}

fn missing_cargo_deny() -> Option<String> {
    missing_cargo_subcommand("deny", CARGO_DENY_VERSION)
}

fn install_cargo_deny() -> Result<()> {
    install_cargo_subcommand("deny", CARGO_DENY_VERSION)
}

/// Why `cargo-<name>` `version` needs installing for the stable toolchain, if it does.
fn missing_cargo_subcommand(name: &str, version: &str) -> Option<String> {
    match output(Command::new("rustup").args(["run", "stable", "cargo", name, "--version"])) {
        Ok(v) if v.contains(version) => None,
        Ok(v) => Some(format!("found {}, need {version}", v.trim())),
        Err(_) => Some(format!("building cargo-{name} {version}")),
    }
}

/// Builds `cargo-<name>` `version` from crates.io with its own lock file.
fn install_cargo_subcommand(name: &str, version: &str) -> Result<()> {
    run(Command::new("rustup").args([
        "run",
        "stable",
        "cargo",
        "install",
        &format!("cargo-{name}"),
        "--version",
        version,
        "--locked",
    ]))
}

/// Runs a command with inherited output (so its progress is visible) and fails with the
/// command line if it exits non-zero.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("could not start {cmd:?}"))?;
    ensure!(status.success(), "{cmd:?} exited with {status}");
    Ok(())
}

pub(crate) fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("could not start {cmd:?}"))?;
    ensure!(out.status.success(), "{cmd:?} exited with {}", out.status);
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::{For, STEPS, steps_for};

    fn names(command: Option<For>) -> Vec<&'static str> {
        steps_for(command).iter().map(|s| s.name).collect()
    }

    #[test]
    fn the_demo_installs_only_what_it_runs() {
        let demo = names(Some(For::Demo));
        assert_eq!(
            demo,
            [
                "Debian packages (eBPF toolchain, testbed tools)",
                "rustup toolchain `debian`",
                "bpf-linker",
                "Python venv with grpcio",
            ],
            "the demo builds the agent and its eBPF programs and runs grpcio in a testbed"
        );
        for tool in [
            "cargo-fuzz",
            "cargo-deny",
            "Node.js",
            "test and benchmark peers",
        ] {
            assert!(
                !demo.iter().any(|n| n.contains(tool)),
                "the demo never uses {tool}: {demo:?}"
            );
        }
    }

    #[test]
    fn setup_and_the_test_tiers_install_every_step() {
        assert_eq!(names(None).len(), STEPS.len());
        assert_eq!(names(Some(For::Test)), names(None));
    }
}
