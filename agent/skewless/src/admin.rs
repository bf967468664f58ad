//! The admin API (`/live`, `/ready`, `/status`) and the `skewless status` client.

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{Arc, Mutex, atomic::AtomicBool, atomic::Ordering},
};

use anyhow::{Context as _, Result};
use http_body_util::{BodyExt as _, Full};
use hyper::{Request, Response, StatusCode, body::Bytes, service::service_fn};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use skewless_datapath::Datapath;
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

pub struct State {
    pub node: String,
    pub datapath: Mutex<Datapath>,
    pub ready: AtomicBool,
}

/// What `/status` returns.
#[derive(Debug, Serialize, Deserialize)]
pub struct Status {
    pub node: String,
    pub redirects: Vec<RedirectStatus>,
    pub connect4_seen: u64,
    pub connect4_redirected: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct RedirectStatus {
    pub service: String,
    pub target: String,
}

pub async fn serve(addr: SocketAddr, state: Arc<State>) -> Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the admin API to {addr}"))?;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                warn!(error = %e, "admin accept");
                continue;
            }
        };
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let state = Arc::clone(&state);
                async move { Ok::<_, Infallible>(route(&req, &state)) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                debug!(%peer, error = %e, "admin connection");
            }
        });
    }
}

fn route(req: &Request<hyper::body::Incoming>, state: &State) -> Response<Full<Bytes>> {
    match req.uri().path() {
        "/live" => text(StatusCode::OK, "live\n"),
        "/ready" if state.ready.load(Ordering::Relaxed) => text(StatusCode::OK, "ready\n"),
        "/ready" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        "/status" => match status_of(state) {
            Ok(s) => Response::builder()
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(
                    serde_json::to_vec_pretty(&s).unwrap_or_default(),
                )))
                .unwrap_or_default(),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e:#}\n")),
        },
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

fn status_of(state: &State) -> Result<Status> {
    let dp = state
        .datapath
        .lock()
        .map_err(|_| anyhow::anyhow!("datapath lock poisoned"))?;
    let counters = dp.counters()?;
    Ok(Status {
        node: state.node.clone(),
        redirects: dp
            .redirects()
            .into_iter()
            .map(|(s, t)| RedirectStatus {
                service: s.to_string(),
                target: t.to_string(),
            })
            .collect(),
        connect4_seen: counters.connect4_seen,
        connect4_redirected: counters.connect4_redirected,
    })
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_owned())));
    *r.status_mut() = status;
    r
}

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
    println!(
        "node {}: {} connect()s seen, {} redirected",
        s.node, s.connect4_seen, s.connect4_redirected
    );
    println!("{:<24} {:<24}", "SERVICE", "REDIRECTED TO");
    for r in &s.redirects {
        println!("{:<24} {:<24}", r.service, r.target);
    }
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
