//! `skewless status`: asks the agent's admin API and prints what it says.

use std::{io::Write as _, net::SocketAddr, time::Duration};

use anyhow::{Context as _, Result};
use http_body_util::{BodyExt as _, Full};
use hyper::{Request, body::Bytes};
use hyper_util::rt::TokioIo;
use skewless_admin::{json::Status, render};
use tokio::net::TcpStream;

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The agent's local admin address (its `--admin-addr`).
    #[arg(long, default_value = crate::agent::DEFAULT_ADMIN_ADDR, env = "SKEWLESS_ADMIN_ADDR")]
    admin_addr: SocketAddr,
    /// Print the raw JSON (one reading, no rates).
    #[arg(long)]
    json: bool,
    /// Calls per second, success rate and p50/p99 are measured over this interval: two
    /// readings of the agent's counters this far apart (`0s`: one reading, no rates).
    #[arg(long, default_value = "1s", value_parser = parse_interval)]
    interval: Duration,
    /// Refresh in place every interval until interrupted.
    #[arg(long, conflicts_with = "json")]
    watch: bool,
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    let (n, scale) = if let Some(ms) = s.strip_suffix("ms") {
        (ms, 1e-3)
    } else if let Some(secs) = s.strip_suffix('s') {
        (secs, 1.0)
    } else {
        (s, 1.0)
    };
    let secs: f64 = n
        .parse()
        .map_err(|_| format!("{s:?}: expected a duration like 1s, 500ms or 2"))?;
    if !(0.0..=3600.0).contains(&(secs * scale)) {
        return Err(format!("{s:?}: between 0s and 1h"));
    }
    Ok(Duration::from_secs_f64(secs * scale))
}

pub async fn status(args: StatusArgs) -> Result<()> {
    let StatusArgs {
        admin_addr,
        json,
        interval,
        watch,
    } = args;
    if json {
        let body = get(admin_addr, "/status").await?;
        println!("{}", String::from_utf8_lossy(&body));
        return Ok(());
    }
    let read = || async {
        let body = get(admin_addr, "/status").await?;
        let s: Status = serde_json::from_slice(&body).context("decoding /status")?;
        anyhow::Ok((s, tokio::time::Instant::now()))
    };
    let mut earlier = read().await?;
    if interval.is_zero() {
        print!("{}", render::status_text(&earlier.0, None));
        return Ok(());
    }
    loop {
        tokio::time::sleep(interval).await;
        let now = read().await?;
        let text = render::status_text(&now.0, Some((&earlier.0, now.1 - earlier.1)));
        if watch {
            // Home and clear the screen, then the new reading: refreshed in place.
            print!("\x1b[H\x1b[2J{text}");
            let _ = std::io::stdout().flush();
        } else {
            print!("{text}");
            return Ok(());
        }
        earlier = now;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_parse_in_seconds_or_milliseconds_and_garbage_is_refused() {
        assert_eq!(parse_interval("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_interval("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_interval("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_interval("0s"), Ok(Duration::ZERO));
        assert!(parse_interval("soon").is_err());
        assert!(parse_interval("-1s").is_err());
        assert!(parse_interval("2h").is_err());
    }
}
