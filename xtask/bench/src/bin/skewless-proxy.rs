//! `skewless-proxy`: one skewless [`Balancer`] as its own process, so the benchmark can measure
//! its CPU and memory the way it measures HAProxy's and nginx's. The endpoint set comes from
//! the command line, and with `--endpoints-from-stdin` every line read later replaces it (the
//! benchmark's scale-up); the agent proper follows Kubernetes instead. Like the agent, it runs one
//! balancer per data-plane worker (a single-threaded runtime on its own thread) on
//! `SO_REUSEPORT` listeners of one address.

use std::net::SocketAddr;

use anyhow::{Context as _, bail};
use clap::Parser;
use skewless_balancer::{Balancer, Config, Endpoint, Workers};

/// Serve one skewless balancer over a fixed set of endpoints (HTTP/2 cleartext both sides).
#[derive(Debug, Parser)]
struct Args {
    /// Address to accept client connections on.
    #[arg(long)]
    listen: SocketAddr,
    /// An endpoint as NAME=ADDR (repeat for each).
    #[arg(long = "endpoint", value_parser = parse_endpoint, required = true)]
    endpoints: Vec<Endpoint>,
    /// Data-plane worker threads, each with its own balancer and listener.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Read new endpoint sets from standard input, one per line (NAME=ADDR separated by
    /// spaces), each replacing the last; a line that does not parse is reported and ignored.
    #[arg(long)]
    endpoints_from_stdin: bool,
}

/// An endpoint set from one line of NAME=ADDR words.
fn parse_endpoints(line: &str) -> anyhow::Result<Vec<Endpoint>> {
    let set = line
        .split_whitespace()
        .map(parse_endpoint)
        .collect::<anyhow::Result<Vec<_>>>()?;
    if set.is_empty() {
        bail!("an empty endpoint set");
    }
    Ok(set)
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
        endpoints_from_stdin,
    } = Args::parse();
    let workers = Workers::start(threads, "skewless-proxy").context("worker threads")?;
    // The sender stays alive for the life of the process (an endpoint set that never changes
    // unless --endpoints-from-stdin).
    let (tx, rx) = tokio::sync::watch::channel(endpoints);
    if endpoints_from_stdin {
        let tx = tx.clone();
        std::thread::Builder::new()
            .name("endpoints".into())
            .spawn(move || {
                for line in std::io::stdin().lines() {
                    let Ok(line) = line else { break };
                    match parse_endpoints(&line) {
                        Ok(set) => {
                            tracing::info!(endpoints = set.len(), "endpoint set replaced");
                            let _ = tx.send(set);
                        }
                        Err(error) => tracing::warn!(%error, "endpoint line ignored"),
                    }
                }
            })
            .context("endpoint reader thread")?;
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (failed_tx, mut failed) = tokio::sync::mpsc::unbounded_channel();
    let served = workers
        .serve(
            listen,
            || Balancer::new(Config::default(), rx.clone()),
            &stop_rx,
            |_| true,
            move |error| {
                let _ = failed_tx.send(error);
            },
        )
        .with_context(|| format!("binding {listen}"))?;
    let bound = served.addr;
    tracing::info!(listen = %bound, threads, "skewless-proxy serving");
    // The main thread only waits for Ctrl-C (or SIGTERM, which ends the process).
    let control = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("runtime")?;
    control.block_on(async {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            Some(error) = failed.recv() => return Err(error).context("serve"),
        }
        let _ = stop_tx.send(true);
        for task in served.tasks {
            task.await.context("balancer task")?;
        }
        if let Ok(error) = failed.try_recv() {
            return Err(error).context("serve");
        }
        anyhow::Ok(())
    })
}
