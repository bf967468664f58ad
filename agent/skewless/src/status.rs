//! `skewless status`: asks the agent's admin API and prints what it says.

use std::net::SocketAddr;

use anyhow::{Context as _, Result};
use http_body_util::{BodyExt as _, Full};
use hyper::{Request, body::Bytes};
use hyper_util::rt::TokioIo;
use skewless_admin::{json::Status, render};
use tokio::net::TcpStream;

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The agent's admin address.
    #[arg(long, default_value = "127.0.0.1:9990", env = "SKEWLESS_ADMIN_ADDR")]
    admin_addr: SocketAddr,
    /// Print the raw JSON.
    #[arg(long)]
    json: bool,
}

pub async fn status(args: StatusArgs) -> Result<()> {
    let StatusArgs { admin_addr, json } = args;
    let body = get(admin_addr, "/status").await?;
    if json {
        println!("{}", String::from_utf8_lossy(&body));
        return Ok(());
    }
    let s: Status = serde_json::from_slice(&body).context("decoding /status")?;
    print!("{}", render::status_text(&s));
    Ok(())
}

async fn get(addr: SocketAddr, path: &str) -> Result<Bytes> {
    let stream = TcpStream::connect(addr).await.with_context(|| {
        format!("connecting to the agent's admin API at {addr} (is `skewless agent` running?)")
    })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let req = Request::get(path)
        .header("host", addr.to_string())
        .body(Full::new(Bytes::new()))?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    anyhow::ensure!(
        status.is_success(),
        "{path}: {status}: {}",
        String::from_utf8_lossy(&body)
    );
    Ok(body)
}
