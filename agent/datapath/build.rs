//! Builds the eBPF programs from source on every build of this crate (never a committed
//! binary) with Debian's rustc-web, linked as the rustup toolchain "debian" by
//! `cargo xtask setup`.
//!
//! Every flavour of this crate's build (clippy, tests, docs, `release`, `dist`) runs this
//! script in its own `OUT_DIR`; aya-build keeps its cargo target under `OUT_DIR/aya-build`.
//! That directory is a link to one `ebpf-target` beside the profiles in the target directory,
//! so the programs and their build dependencies are compiled once, and every later flavour
//! finds them fresh (cargo's own lock serialises flavours built at the same time).
use std::path::{Path, PathBuf};

use anyhow::{Context as _, anyhow};
use aya_build::Toolchain;

fn main() -> anyhow::Result<()> {
    // aya-ebpf needs `asm_experimental_arch`; this unlocks unstable features for that crate
    // only and makes aya-build use Debian's prebuilt `core` for bpfel-unknown-none.
    if std::env::var_os("RUSTC_BOOTSTRAP").is_none() {
        // SAFETY: build scripts are single-threaded; nothing reads the environment concurrently.
        unsafe { std::env::set_var("RUSTC_BOOTSTRAP", "aya_ebpf") };
    }
    share_ebpf_target(Path::new(&std::env::var_os("OUT_DIR").context("OUT_DIR")?))?;
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let root = manifest_dir.join("../../ebpf/programs");
    let root = root
        .to_str()
        .ok_or_else(|| anyhow!("non-UTF-8 path {}", root.display()))?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "skewless-ebpf",
            root_dir: root,
            ..Default::default()
        }],
        Toolchain::Custom("debian"),
    )
    .context(
        "building the eBPF programs failed; run `cargo xtask setup` to install Debian's \
         rustc-web, libstd-rust-web-dev-bpf and bpf-linker",
    )
}

/// Points `OUT_DIR/aya-build` at the target directory's shared `ebpf-target`.
///
/// `OUT_DIR` is `<target>/[<triple>/]<profile>/build/<crate>-<hash>/out`; the shared
/// directory sits beside `<profile>`. A real directory left by an earlier build (before the
/// link) is replaced.
fn share_ebpf_target(out_dir: &Path) -> anyhow::Result<()> {
    let profiles = out_dir.ancestors().nth(4).ok_or_else(|| {
        anyhow!(
            "OUT_DIR {} is not inside a target directory",
            out_dir.display()
        )
    })?;
    let shared = profiles.join("ebpf-target");
    std::fs::create_dir_all(&shared).with_context(|| format!("creating {}", shared.display()))?;
    let link = out_dir.join("aya-build");
    match std::fs::read_link(&link) {
        Ok(to) if to == shared => return Ok(()),
        Ok(_) => std::fs::remove_file(&link)?,
        Err(_) if link.is_dir() => std::fs::remove_dir_all(&link)?,
        Err(_) => {}
    }
    std::os::unix::fs::symlink(&shared, &link)
        .with_context(|| format!("linking {} to {}", link.display(), shared.display()))
}
