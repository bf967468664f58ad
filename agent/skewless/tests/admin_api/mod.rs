//! What the unprivileged-namespace agent tests (`kubernetes`, `services_file`) share: an agent
//! process that is killed (and its temp dir removed) on drop, a free admin address, and a
//! client for the agent's admin API.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of these helpers"
)]

use std::{
    net::TcpListener,
    path::PathBuf,
    process::Child,
    time::{Duration, Instant},
};

use http_body_util::{BodyExt as _, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

/// The agent process and its temp dir: killed and removed on drop, also when the test fails.
pub struct AgentProcess {
    pub child: Child,
    pub dir: PathBuf,
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A loopback address free for the agent's admin API.
pub fn free_admin_addr() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// `GET path` from the admin API; `None` while the agent is not up.
pub async fn get(admin: &str, path: &str) -> Option<Bytes> {
    let stream = tokio::net::TcpStream::connect(admin).await.ok()?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(conn);
    let req = http::Request::get(path)
        .header("host", admin)
        .body(Empty::<Bytes>::new())
        .ok()?;
    Some(
        sender
            .send_request(req)
            .await
            .ok()?
            .into_body()
            .collect()
            .await
            .ok()?
            .to_bytes(),
    )
}

/// `/status` as JSON; `None` while the agent is not up.
pub async fn status(admin: &str) -> Option<serde_json::Value> {
    serde_json::from_slice(&get(admin, "/status").await?).ok()
}

/// Polls `/status` every 2 ms until `f` holds, failing after `limit`; returns how long it took.
pub async fn until(
    admin: &str,
    what: &str,
    limit: Duration,
    f: impl Fn(&serde_json::Value) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        if let Some(s) = status(admin).await
            && f(&s)
        {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
