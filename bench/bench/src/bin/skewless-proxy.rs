//! `skewless-proxy`: one skewless balancer as its own process, so the benchmark can measure
//! its CPU and memory the way it measures HAProxy's and nginx's: request mode (a [`Balancer`]
//! per worker) or connection mode (one [`ConnectionBalancer`] shared by the workers, its
//! controller on the main thread's runtime, as in the agent). The endpoint set comes from
//! the command line, and with `--endpoints-from-stdin` every line read later replaces it (the
//! benchmark's scale-up); the agent proper follows Kubernetes instead. Like the agent, it runs
//! its data-plane workers (a single-threaded runtime each, on its own thread) on `SO_REUSEPORT`
//! listeners of one address.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Parser;
use skewless_balancer::{
    Balancer, BalancerError, CodecBalancer, Config, ConnectionBalancer, ConnectionConfig, DataPath,
    Endpoint, NewConnection, RotationConfig, Served, Workers,
};

/// Serve one skewless balancer over a fixed set of endpoints (HTTP/2 cleartext both sides).
#[derive(Debug, Parser)]
struct Args {
    /// Address to accept client connections on.
    #[arg(long)]
    listen: SocketAddr,
    /// An endpoint as NAME=ADDR (repeat for each).
    #[arg(long = "endpoint", value_parser = parse_endpoint, required = true)]
    endpoints: Vec<Endpoint>,
    /// Data-plane worker threads, each with its own listener (and in request mode its own
    /// balancer; connection mode's one balancer is shared by the workers).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Read new endpoint sets from standard input, one per line (NAME=ADDR separated by
    /// spaces), each replacing the last; a line that does not parse is reported and ignored.
    #[arg(long)]
    endpoints_from_stdin: bool,
    /// `request`: terminate HTTP/2 and balance every call; `connection`: relay each client
    /// connection to one backend and rotate connections when the skew stays high.
    #[arg(long, value_enum, default_value_t = Mode::Request)]
    mode: Mode,
    /// Connection mode: rotate when the skew (largest share / fair share) is above this ...
    #[arg(long, default_value_t = RotationConfig::default().skew_threshold)]
    skew_threshold: f64,
    /// ... for this many seconds.
    #[arg(long, default_value_t = RotationConfig::default().hold_time.as_secs_f64())]
    hold_time: f64,
    /// Connection mode: most skew rotations in any minute.
    #[arg(long, default_value_t = RotationConfig::default().max_rotations_per_minute)]
    max_rotations_per_minute: u32,
    /// Connection mode: connections younger than this many seconds are never rotated for skew.
    #[arg(long, default_value_t = RotationConfig::default().min_connection_age.as_secs_f64())]
    min_connection_age: f64,
    /// Connection mode: rotate every client connection once it is this many seconds old
    /// (+-10% jitter; `skewless.io/max-connection-age`); 0: never.
    #[arg(long, default_value_t = 0.0)]
    max_connection_age: f64,
    /// Request mode's data path: `h2` (the default), or `codec`, the experimental one on the
    /// project's frame codec (see docs/configuration.md).
    #[arg(long, default_value_t = DataPath::H2)]
    data_path: DataPath,
}

/// How the balancer serves a client connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    Request,
    Connection,
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
        mode,
        skew_threshold,
        hold_time,
        max_rotations_per_minute,
        min_connection_age,
        max_connection_age,
        data_path,
    } = Args::parse();
    let secs = |s: f64, what: &str| {
        Duration::try_from_secs_f64(s).with_context(|| format!("{what} must be seconds >= 0"))
    };
    let rotation = RotationConfig {
        skew_threshold,
        hold_time: secs(hold_time, "--hold-time")?,
        max_rotations_per_minute,
        min_connection_age: secs(min_connection_age, "--min-connection-age")?,
    };
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
    // The main thread waits for Ctrl-C (or SIGTERM, which ends the process); in connection
    // mode it also runs the controller, as the agent's control plane does.
    let control = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("runtime")?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (failed_tx, failed) = tokio::sync::mpsc::unbounded_channel();
    let on_error = move |error| {
        let _ = failed_tx.send(error);
    };
    match mode {
        Mode::Request if data_path == DataPath::Codec => {
            let served = workers
                .serve(
                    listen,
                    || CodecBalancer::new(Config::default(), rx.clone()),
                    &stop_rx,
                    |_| true,
                    on_error,
                )
                .with_context(|| format!("binding {listen}"))?;
            run(&control, served, threads, &stop_tx, failed)
        }
        Mode::Request => {
            let served = workers
                .serve(
                    listen,
                    || Balancer::new(Config::default(), rx.clone()),
                    &stop_rx,
                    |_| true,
                    on_error,
                )
                .with_context(|| format!("binding {listen}"))?;
            run(&control, served, threads, &stop_tx, failed)
        }
        Mode::Connection => {
            let max_age = secs(max_connection_age, "--max-connection-age")?;
            let config = ConnectionConfig {
                rotation,
                max_connection_age: (!max_age.is_zero()).then_some(max_age),
                ..ConnectionConfig::default()
            };
            let balancer = {
                let _control = control.enter();
                ConnectionBalancer::new(config, rx.clone())
            };
            let served = workers
                .serve(listen, || balancer.clone(), &stop_rx, |_| true, on_error)
                .with_context(|| format!("binding {listen}"))?;
            run(&control, served, threads, &stop_tx, failed)
        }
    }
}

/// Serves until Ctrl-C or a worker's failure, then drains.
fn run<B: NewConnection + Send + Sync + 'static>(
    control: &tokio::runtime::Runtime,
    served: Served<B>,
    threads: usize,
    stop: &tokio::sync::watch::Sender<bool>,
    mut failed: tokio::sync::mpsc::UnboundedReceiver<BalancerError>,
) -> anyhow::Result<()> {
    tracing::info!(listen = %served.addr, threads, "skewless-proxy serving");
    control.block_on(async {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            Some(error) = failed.recv() => return Err(error).context("serve"),
        }
        let _ = stop.send(true);
        for task in served.tasks {
            task.await.context("balancer task")?;
        }
        if let Ok(error) = failed.try_recv() {
            return Err(error).context("serve");
        }
        anyhow::Ok(())
    })
}
