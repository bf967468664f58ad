//! `skewless`: the node agent (`skewless agent`) and its command-line tools.
#![forbid(unsafe_code)]

mod admin;
mod agent;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    version,
    about = "skewless: per-request balancing for gRPC Services, without a mesh"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the node agent: load the eBPF hooks, attach them to pod cgroups, redirect opted-in
    /// Services, and serve the admin API.
    Agent(agent::Args),
    /// Print what the agent on this node is doing (queries its admin API).
    Status(admin::StatusArgs),
}

fn main() -> anyhow::Result<()> {
    let Cli { cmd } = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cmd {
        Cmd::Agent(args) => rt.block_on(agent::run(args)),
        Cmd::Status(args) => rt.block_on(admin::status(args)),
    }
}
