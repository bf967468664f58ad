//! Request mode's suite, end to end over loopback: real tonic clients, real echo servers (or a
//! minimal hyper upstream where a test must see exactly what the upstream receives), and the
//! balancer in between. Every test is bounded to a few seconds and a few thousand calls.

#[path = "../support/mod.rs"]
mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::{Body, Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use skewless_balancer::{Balancer, Config, Endpoint, RetryBudgetConfig};
use skewless_echo::SpawnedEcho;
use skewless_echo::pb::EchoRequest;
use skewless_echo::pb::echo_client::EchoClient;
use skewless_frame::{
    ErrorCode, Frames, GoAway, Head, Kind, MAX_MAX_FRAME_SIZE, MAX_STREAM_ID, PREFACE, Ping,
    Settings,
};
use support::{
    DataPath, balancer_on, empty_settings, endpoints, grpc_request, on_both_paths, pods, raw_client,
};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tonic::Code;
use tonic::transport::Channel;

mod calls;
mod health;
mod lifecycle;
mod picking;
mod retries;

async fn client(addr: SocketAddr) -> EchoClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        // A hung call fails its test instead of hanging the suite.
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .expect("client connects to the balancer");
    EchoClient::new(channel)
        .max_decoding_message_size(skewless_echo::MAX_MESSAGE_SIZE)
        .max_encoding_message_size(skewless_echo::MAX_MESSAGE_SIZE)
}

fn req(payload: &[u8]) -> EchoRequest {
    EchoRequest {
        payload: payload.to_vec(),
        ..EchoRequest::default()
    }
}

fn tally(names: &[String], n: usize) -> Vec<usize> {
    (0..n)
        .map(|i| names.iter().filter(|p| **p == format!("pod-{i}")).count())
        .collect()
}

/// The hanging upstream keeps calls open: let the balancer cut them soon when a test stops it.
fn short_drain() -> Config {
    Config {
        drain_grace: Duration::from_millis(200),
        ..Config::default()
    }
}

/// A TCP relay from `listener` to `target` that counts the connections it accepts. Dropping it
/// closes the listener and every relayed connection at once (an endpoint that goes away).
struct Relay {
    _tasks: tokio::task::JoinSet<()>,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
}

fn relay(listener: TcpListener, target: SocketAddr) -> Relay {
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    let mut set = tokio::task::JoinSet::new();
    set.spawn(async move {
        // Dropped with this task: aborts every relayed connection.
        let mut conns = tokio::task::JoinSet::new();
        while let Ok((mut inbound, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            conns.spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    Relay {
        _tasks: set,
        accepted,
    }
}

impl<P> support::Serving<P> {
    async fn stop(mut self) {
        self.stop_within(Duration::from_secs(5)).await;
    }
}

/// Whether `bytes` (a server's side of an HTTP/2 connection) hold a GOAWAY frame with `reason`.
fn has_go_away(bytes: &[u8], reason: h2::Reason) -> bool {
    support::go_away_codes(bytes).contains(&ErrorCode(u32::from(reason)))
}
