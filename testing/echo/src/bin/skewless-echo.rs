//! `skewless-echo`: the echo backend as a process, for the benchmark and the demo.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// gRPC echo server that names itself in every reply.
#[derive(Debug, Parser)]
struct Args {
    /// Address to serve gRPC (Echo + grpc.health.v1) on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// Pod name put in every reply.
    #[arg(long, env = "POD_NAME", default_value = "echo")]
    name: String,
    /// Initial per-call delay in milliseconds (like the seed benchmark's ARTIFICIAL_DELAY_MS).
    #[arg(long, env = "ARTIFICIAL_DELAY_MS", default_value_t = 0)]
    delay_ms: u64,
    /// Send each client connection a graceful GOAWAY once it is this old, in milliseconds
    /// (a gRPC server's MaxConnectionAge; 0: never).
    #[arg(long, default_value_t = 0)]
    max_connection_age_ms: u64,
    /// Optional HTTP/1 admin address (`PUT /delay/<ms>`, `PUT /health/not-serving`, ...).
    #[arg(long)]
    admin: Option<SocketAddr>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let Args {
        listen,
        name,
        delay_ms,
        max_connection_age_ms,
        admin,
    } = Args::parse();
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let (control_tx, control_rx) = oneshot::channel();
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let server = tokio::spawn({
        let name = name.clone();
        async move {
            let options = skewless_echo::ServeOptions {
                initial_delay: Duration::from_millis(delay_ms),
                max_connection_age: (max_connection_age_ms > 0)
                    .then(|| Duration::from_millis(max_connection_age_ms)),
            };
            skewless_echo::serve_with(listener, &name, options, control_tx, shutdown).await
        }
    });
    let control = control_rx.await.context("echo server exited early")?;
    if let Some(admin) = admin {
        let listener = TcpListener::bind(admin)
            .await
            .with_context(|| format!("binding admin {admin}"))?;
        tokio::spawn(skewless_echo::admin::serve(
            listener,
            control,
            std::future::pending(),
        ));
    }
    tracing::info!(%listen, %name, delay_ms, "echo serving");
    server.await.context("echo task")??;
    Ok(())
}
