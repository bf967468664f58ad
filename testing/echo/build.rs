//! Compiles the shared echo proto with `protox` (pure Rust), so no system `protoc` is needed.

use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let file = root.join("skewless/echo/v1/echo.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
