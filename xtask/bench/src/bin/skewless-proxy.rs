//! `skewless-proxy`: one skewless [`Balancer`] as its own process, so the benchmark can measure
//! its CPU and memory the way it measures HAProxy's and nginx's. The endpoint set is fixed on
//! the command line; the agent proper follows Kubernetes instead.

use std::net::SocketAddr;

use anyhow::{Context as _, bail};
use clap::Parser;
use skewless_balancer::{Balancer, Config, Endpoint};

/// Serve one skewless balancer over a fixed set of endpoints (HTTP/2 cleartext both sides).
#[derive(Debug, Parser)]
struct Args {
    /// Address to accept client connections on.
    #[arg(long)]
    listen: SocketAddr,
    /// An endpoint as NAME=ADDR (repeat for each).
    #[arg(long = "endpoint", value_parser = parse_endpoint, required = true)]
    endpoints: Vec<Endpoint>,
    /// Runtime worker threads (default: one per CPU).
    #[arg(long)]
    threads: Option<usize>,
}

fn parse_endpoint(s: &str) -> anyhow::Result<Endpoint> {
    let Some((name, addr)) = s.split_once('=') else {
        bail!("expected NAME=ADDR, got {s:?}");
    };
    let addr: SocketAddr = addr.parse().with_context(|| format!("address in {s:?}"))?;
    Ok(Endpoint::new(addr, name))
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let Args {
        listen,
        endpoints,
        threads,
    } = Args::parse();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = threads {
        rt.worker_threads(n);
    }
    let rt = rt.enable_all().build().context("runtime")?;
    rt.block_on(async {
        // The sender stays alive for the life of the process: the endpoint set never changes.
        let (_tx, rx) = tokio::sync::watch::channel(endpoints);
        let balancer = Balancer::new(Config::default(), rx);
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding {listen}"))?;
        tracing::info!(%listen, "skewless-proxy serving");
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        balancer.serve(listener, shutdown).await.context("serve")
    })
}
