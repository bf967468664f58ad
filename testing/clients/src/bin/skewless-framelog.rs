//! `skewless-framelog`: the frame-logging HTTP/2 tap (see `skewless_clients::framelog`).

use std::{net::SocketAddr, path::PathBuf};

use clap::Parser;
use skewless_clients::framelog::{self, Withhold};

#[derive(Debug, Parser)]
#[command(about = "TCP relay that logs every HTTP/2 frame each way as JSON lines")]
struct Args {
    /// Where clients connect.
    #[arg(long)]
    listen: SocketAddr,
    /// Where each connection is relayed to.
    #[arg(long)]
    upstream: SocketAddr,
    /// The JSON-lines log.
    #[arg(long)]
    log: PathBuf,
    /// Do not pass GOAWAY frames on to the client.
    #[arg(long)]
    withhold_goaway: bool,
    /// Do not pass the server's PINGs (not ACKs) on to the client.
    #[arg(long)]
    withhold_ping: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let Args {
        listen,
        upstream,
        log,
        withhold_goaway,
        withhold_ping,
    } = Args::parse();
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let withhold = Withhold {
        goaway: withhold_goaway,
        ping: withhold_ping,
    };
    framelog::serve(listener, upstream, withhold, &log).await?;
    Ok(())
}
