//! Builds the eBPF programs from source on every build of this crate (never a committed
//! binary) with Debian's rustc-web, linked as the rustup toolchain "debian" by
//! `cargo xtask setup`.
use std::path::PathBuf;

use anyhow::{Context as _, anyhow};
use aya_build::Toolchain;

fn main() -> anyhow::Result<()> {
    // aya-ebpf needs `asm_experimental_arch`; this unlocks unstable features for that crate
    // only and makes aya-build use Debian's prebuilt `core` for bpfel-unknown-none.
    if std::env::var_os("RUSTC_BOOTSTRAP").is_none() {
        // SAFETY: build scripts are single-threaded; nothing reads the environment concurrently.
        unsafe { std::env::set_var("RUSTC_BOOTSTRAP", "aya_ebpf") };
    }
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
