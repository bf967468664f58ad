//! `cargo xtask image`: the agent's container image, built with podman (or docker) from a
//! clean checkout with no network but the package registries.
//!
//! Both base images are made from Debian's archive with mmdebstrap, every package pinned
//! (skewless-testbed's `container` module); `deploy/Dockerfile` then builds the agent with
//! Debian's rustc-web and `--locked`, strips it, and keeps the debug info apart. With
//! `--binary` only the runtime stage runs, on a host-built binary (seconds: what the
//! privileged tests do).

use std::{path::PathBuf, process::Command, time::Instant};

use anyhow::{Context as _, Result, ensure};
use skewless_testbed::container::{self, Base, BaseOptions};

/// Debian's bundle of the CAs this machine trusts (ca-certificates).
const HOST_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The image must stay below this (the runtime base is ~5 MB; the rest is the agent).
const MAX_IMAGE_BYTES: u64 = 40_000_000;

#[derive(clap::Args)]
pub struct Args {
    /// Image name and tag (default: `localhost/skewless:<version>-g<commit>`, with `-dirty`
    /// for local changes).
    #[arg(long)]
    tag: Option<String>,
    /// Build only the runtime stage, around this host-built agent binary (stripped on the
    /// way), instead of the whole Dockerfile.
    #[arg(long, value_name = "FILE")]
    binary: Option<PathBuf>,
    /// Debian mirror for the base images [default: this machine's apt sources].
    #[arg(long, value_name = "URL")]
    mirror: Option<String>,
    /// CA certificates (PEM, one or a bundle) trusted by apt and by the build, e.g. a
    /// TLS-inspecting proxy's [default: this machine's bundle, /etc/ssl/certs/ca-certificates.crt,
    /// so the build trusts what the host's cargo trusts].
    #[arg(long, value_name = "FILE")]
    ca_cert: Option<PathBuf>,
    /// A cargo config file for the build, e.g. a crate source replacement or a registry
    /// mirror (`[source.crates-io] replace-with = ...`).
    #[arg(long, value_name = "FILE")]
    cargo_config: Option<PathBuf>,
}

pub fn run(args: &Args) -> Result<()> {
    let Args {
        tag,
        binary,
        mirror,
        ca_cert,
        cargo_config,
    } = args;
    let host_bundle = std::path::Path::new(HOST_CA_BUNDLE);
    let ca_cert = ca_cert
        .clone()
        .or_else(|| host_bundle.is_file().then(|| host_bundle.to_owned()));
    let opts = BaseOptions {
        mirror: mirror.clone(),
        ca_cert: ca_cert.as_ref().map(|p| absolute(p)).transpose()?,
        cargo_config: cargo_config.as_ref().map(|p| absolute(p)).transpose()?,
    };
    let tag = match tag {
        Some(t) => t.clone(),
        None => default_tag()?,
    };
    let started = Instant::now();
    if let Some(binary) = binary {
        println!("==> image: runtime stage around {}", binary.display());
        container::runtime_image(binary, &tag, &opts)?;
    } else {
        full_build(&tag, &opts)?;
    }
    let size = container::image_size(&tag)?;
    println!(
        "==> image: {tag}, {:.1} MB, built in {:.0?}",
        size as f64 / 1e6,
        started.elapsed()
    );
    ensure!(
        size < MAX_IMAGE_BYTES,
        "{tag} is {size} bytes, over the {MAX_IMAGE_BYTES}-byte bound"
    );
    println!(
        "==> push it and point the manifests at it:\n    {engine} tag {tag} REGISTRY/skewless:TAG \
         && {engine} push REGISTRY/skewless:TAG\n    (cd deploy && kustomize edit set image \
         skewless=REGISTRY/skewless:TAG)",
        engine = container::engine()
    );
    Ok(())
}

/// The whole Dockerfile: base images from Debian, the agent built inside, debug info saved.
fn full_build(tag: &str, opts: &BaseOptions) -> Result<()> {
    let root = crate::workspace_root();
    println!("==> image: base images from Debian's archive (mmdebstrap; once per pin change)");
    let runtime = container::base_image(Base::Runtime, opts)?;
    let build = container::base_image(Base::Build, opts)?;
    println!("==> image: bases {runtime}, {build}");
    let dist = format!("{tag}-dist");
    for (target, name) in [("dist", dist.as_str()), ("runtime", tag)] {
        println!("==> image: deploy/Dockerfile, stage {target} (the engine's progress follows)");
        let mut cmd = container::engine_cmd();
        cmd.current_dir(&root)
            .args(["build", "--pull=never", "--target", target])
            .arg("--build-arg")
            .arg(format!("BUILD_BASE={build}"))
            .arg("--build-arg")
            .arg(format!("RUNTIME_BASE={runtime}"))
            .args(["--ignorefile", "deploy/Dockerfile.dockerignore"])
            .args(["-f", "deploy/Dockerfile", "-t", name, "."]);
        crate::setup::run(&mut cmd)?;
    }
    // The stripped binary's debug info, for symbolizing a core dump or a profile.
    let out = crate::target_dir().join("image");
    std::fs::create_dir_all(&out)?;
    let ctr = format!("skewless-dist-{}", std::process::id());
    crate::setup::run(container::engine_cmd().args([
        "create",
        "--name",
        &ctr,
        &dist,
        "/skewless",
    ]))?;
    let copied = crate::setup::run(
        container::engine_cmd()
            .arg("cp")
            .arg(format!("{ctr}:/skewless.debug"))
            .arg(out.join("skewless.debug")),
    );
    let _ = container::engine_cmd().args(["rm", &ctr]).output();
    copied?;
    println!(
        "==> image: debug info in {}",
        out.join("skewless.debug").display()
    );
    Ok(())
}

/// `localhost/skewless:<agent version>-g<short commit>`, `-dirty` when the checkout has
/// changes.
fn default_tag() -> Result<String> {
    let root = crate::workspace_root();
    let git = |args: &[&str]| -> Result<String> {
        let out = Command::new("git").current_dir(&root).args(args).output()?;
        ensure!(out.status.success(), "git {args:?} failed");
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let commit = git(&["rev-parse", "--short=10", "HEAD"])?;
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])?.is_empty();
    let manifest = std::fs::read_to_string(root.join("agent/skewless/Cargo.toml"))?;
    let version = manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .context("agent/skewless/Cargo.toml has no version")?;
    Ok(format!(
        "localhost/skewless:{version}-g{commit}{}",
        if dirty { "-dirty" } else { "" }
    ))
}

fn absolute(p: &std::path::Path) -> Result<PathBuf> {
    std::fs::canonicalize(p).with_context(|| format!("{}", p.display()))
}
