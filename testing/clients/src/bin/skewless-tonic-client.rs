//! `skewless-tonic-client`: the tonic echo client of the real-client tests. Same flags and
//! same JSON result as `testing/py/echo_client.py --json` and `testing/node/echo_client.js`.

use std::time::Duration;

use clap::Parser;
use skewless_clients::{ClientSpec, tonic_client};

#[derive(Debug, Parser)]
#[command(about = "tonic echo client: bounded load, per-pod tallies, one JSON result")]
struct Args {
    #[arg(long)]
    target: String,
    #[arg(long, default_value_t = 200)]
    calls: u64,
    #[arg(long, default_value_t = 4)]
    concurrency: u32,
    /// Seconds after which no new call starts (0: until `calls` are done).
    #[arg(long, default_value_t = 0.0)]
    duration: f64,
    /// Per-call deadline, seconds.
    #[arg(long, default_value_t = 5.0)]
    timeout: f64,
    #[arg(long, default_value_t = 1)]
    channels: u32,
    #[arg(long, default_value_t = 2)]
    payload: u32,
    /// Server-side delay of each small call, milliseconds.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
    #[arg(long, default_value_t = 0)]
    large_calls: u32,
    #[arg(long, default_value_t = skewless_clients::FOUR_MIB)]
    large_bytes: u32,
    #[arg(long, default_value_t = 0)]
    stream_ms: u64,
    #[arg(long, default_value_t = 0)]
    bidi_ms: u64,
    #[arg(long, default_value_t = 0)]
    keepalive_ms: u64,
    /// Accepted for the shared command line; tonic reconnects on the next call.
    #[arg(long, default_value_t = 0)]
    reconnect_backoff_ms: u64,
}

fn ms(v: u64) -> Option<Duration> {
    (v > 0).then(|| Duration::from_millis(v))
}

fn secs(v: f64) -> anyhow::Result<Duration> {
    Ok(Duration::try_from_secs_f64(v)?)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let Args {
        target,
        calls,
        concurrency,
        duration,
        timeout,
        channels,
        payload,
        delay_ms,
        large_calls,
        large_bytes,
        stream_ms,
        bidi_ms,
        keepalive_ms,
        reconnect_backoff_ms,
    } = Args::parse();
    let spec = ClientSpec {
        target,
        calls,
        concurrency,
        duration: (duration > 0.0).then(|| secs(duration)).transpose()?,
        timeout: secs(timeout)?,
        channels,
        payload,
        call_delay: ms(delay_ms),
        large_calls,
        large_bytes,
        stream: ms(stream_ms),
        bidi: ms(bidi_ms),
        keepalive: ms(keepalive_ms),
        reconnect_backoff: ms(reconnect_backoff_ms),
    };
    let result = tonic_client::run(&spec).await?;
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}
