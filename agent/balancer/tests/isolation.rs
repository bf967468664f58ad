//! One client can never hurt another, in both modes: a client that leaves its responses unread
//! (large unary replies, flow-control windows at zero or never topped up) holds only what is
//! its own, and a healthy client of the same balancer, calling all along with a 2 s deadline,
//! loses no call. The slow reader is h2's client driven frame by frame from the test (it never
//! releases what it received, so its windows never move), on loopback, bounded in calls and
//! time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::{BufMut as _, Bytes, BytesMut};
use prost::Message as _;
use skewless_balancer::connection::{ConnectionBalancer, ConnectionConfig};
use skewless_balancer::metrics::FailureReason;
use skewless_balancer::{Balancer, Config, Endpoint};
use skewless_echo::SpawnedEcho;
use skewless_echo::pb::EchoRequest;
use skewless_echo::pb::echo_client::EchoClient;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tonic::transport::Channel;

/// Which balancer a bed serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Request,
    Connection,
}

struct Bed {
    addr: SocketAddr,
    /// The request-mode balancer, for its metrics.
    balancer: Option<Arc<Balancer>>,
    _pod: SpawnedEcho,
    _endpoints: watch::Sender<Vec<Endpoint>>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Bed {
    async fn start(mode: Mode) -> Self {
        Self::start_with(mode, Config::default()).await
    }

    /// A bed whose request-mode balancer runs `config` (connection mode: the defaults).
    async fn start_with(mode: Mode, config: Config) -> Self {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let pod = SpawnedEcho::start("127.0.0.1:0".parse().expect("addr"), "pod-0")
            .await
            .expect("echo starts");
        let (tx, rx) = watch::channel(vec![Endpoint::new(pod.addr, "pod-0")]);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async {
            let _ = stopped.await;
        };
        let mut balancer = None;
        let task = match mode {
            Mode::Request => {
                let b = Arc::new(Balancer::new(config, rx));
                balancer = Some(b.clone());
                tokio::spawn(async move {
                    skewless_balancer::server::serve(&*b, listener, shutdown, |_| true)
                        .await
                        .expect("serve");
                })
            }
            Mode::Connection => {
                let b = ConnectionBalancer::new(ConnectionConfig::default(), rx);
                tokio::spawn(async move {
                    skewless_balancer::server::serve(&b, listener, shutdown, |_| true)
                        .await
                        .expect("serve");
                })
            }
        };
        Self {
            addr,
            balancer,
            _pod: pod,
            _endpoints: tx,
            stop: Some(stop),
            task,
        }
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(15), &mut self.task)
            .await
            .expect("the balancer drains")
            .expect("serve task");
    }
}

/// A gRPC request message (the 5-byte length prefix and the protobuf).
fn grpc_message(req: &EchoRequest) -> Bytes {
    let body = req.encode_to_vec();
    let mut b = BytesMut::with_capacity(5 + body.len());
    b.put_u8(0);
    b.put_u32(u32::try_from(body.len()).expect("small"));
    b.put_slice(&body);
    b.freeze()
}

/// How the slow reader sets up its windows.
#[derive(Debug, Clone, Copy)]
enum Windows {
    /// SETTINGS_INITIAL_WINDOW_SIZE 0: no response byte may come.
    Zero,
    /// The defaults (64 KiB per stream and per connection), never topped up.
    NeverToppedUp,
}

/// Connects with `windows`, sends `calls` unary calls whose replies are `reply_size` bytes
/// (`payload` in each request), and returns each call's response and request stream, and the
/// task driving the connection.
async fn unary_calls(
    addr: SocketAddr,
    windows: Windows,
    calls: usize,
    reply_size: u32,
    payload: &[u8],
) -> (
    Vec<(h2::client::ResponseFuture, h2::SendStream<Bytes>)>,
    tokio::task::JoinHandle<()>,
) {
    let tcp = TcpStream::connect(addr).await.expect("connects");
    let mut builder = h2::client::Builder::new();
    if let Windows::Zero = windows {
        builder.initial_window_size(0);
    }
    let (mut send, conn) = builder.handshake::<_, Bytes>(tcp).await.expect("handshake");
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let body = grpc_message(&EchoRequest {
        payload: payload.to_vec(),
        reply_size,
        ..EchoRequest::default()
    });
    let mut sent = Vec::new();
    for _ in 0..calls {
        send = send.ready().await.expect("the connection takes streams");
        let req = http::Request::post(format!("http://{addr}/skewless.echo.v1.Echo/Echo"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .expect("request");
        let (response, mut stream) = send.send_request(req, false).expect("send");
        stream.send_data(body.clone(), true).expect("body");
        sent.push((response, stream));
    }
    (sent, driver)
}

/// Opens one connection, sends `calls` unary calls whose replies are `reply_size` bytes, waits
/// for their response headers and holds the responses unread (the h2 client never releases
/// what it received, so no WINDOW_UPDATE goes out) until `hold` has passed.
async fn slow_reader(
    addr: SocketAddr,
    calls: usize,
    reply_size: u32,
    windows: Windows,
    hold: Duration,
) {
    let (held, driver) = unary_calls(addr, windows, calls, reply_size, b"slow").await;
    let until = tokio::time::Instant::now() + hold;
    let mut responses = Vec::new();
    for (response, stream) in held {
        // The headers are not flow controlled: they come; the body never can.
        if let Ok(Ok(r)) = tokio::time::timeout_at(until, response).await {
            responses.push((r, stream));
        }
    }
    tokio::time::sleep_until(until).await;
    drop(responses);
    driver.abort();
}

/// A healthy client calling about 100 times a second with a 2 s deadline until told to stop;
/// the calls it made, and those that failed.
fn healthy_client(
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(usize, Vec<tonic::Status>)> {
    tokio::spawn(async move {
        let channel = Channel::from_shared(format!("http://{addr}"))
            .expect("uri")
            .timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect("the healthy client connects");
        let mut c = EchoClient::new(channel);
        let (mut calls, mut failed) = (0, Vec::new());
        while !stop.load(Ordering::Relaxed) {
            let r = c
                .echo(EchoRequest {
                    payload: b"healthy".to_vec(),
                    ..EchoRequest::default()
                })
                .await;
            calls += 1;
            if let Err(status) = r {
                failed.push(status);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (calls, failed)
    })
}

/// A slow reader holds `calls` x `reply_size` bytes of responses unread for 4 s while a healthy
/// client calls; checks the healthy client lost nothing.
async fn slow_reader_beside_a_healthy_client(
    mode: Mode,
    calls: usize,
    reply_size: u32,
    windows: Windows,
) {
    let bed = Bed::start(mode).await;
    let stop = Arc::new(AtomicBool::new(false));
    let healthy = healthy_client(bed.addr, stop.clone());
    // The healthy client is up before the slow reader starts.
    tokio::time::sleep(Duration::from_millis(200)).await;
    slow_reader(bed.addr, calls, reply_size, windows, Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    let (made, failed) = healthy.await.expect("healthy client");
    assert!(
        failed.is_empty(),
        "{mode:?}, {calls} x {reply_size} B unread ({windows:?}): {} of {made} healthy calls \
         failed, first {:?}",
        failed.len(),
        failed.first()
    );
    assert!(
        made >= 100,
        "{mode:?}: the healthy client kept calling at its pace: {made} calls in 4 s"
    );
    bed.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_unread_megabyte_replies_at_window_zero_cost_a_healthy_client_nothing() {
    for mode in [Mode::Request, Mode::Connection] {
        slow_reader_beside_a_healthy_client(mode, 16, 1_000_000, Windows::Zero).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_unread_100_kb_replies_in_windows_never_topped_up_cost_a_healthy_client_nothing()
{
    for mode in [Mode::Request, Mode::Connection] {
        slow_reader_beside_a_healthy_client(mode, 100, 100_000, Windows::NeverToppedUp).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_unread_megabyte_replies_in_windows_never_topped_up_cost_a_healthy_client_nothing()
{
    for mode in [Mode::Request, Mode::Connection] {
        slow_reader_beside_a_healthy_client(mode, 16, 1_000_000, Windows::NeverToppedUp).await;
    }
}

/// Opens `per_connection` unary calls on each of `connections` connections whose request body
/// never comes (HEADERS without END_STREAM, then nothing), holds them for `hold`, and returns
/// how many streams the balancer took.
async fn bodiless_streams(
    addr: SocketAddr,
    connections: usize,
    per_connection: usize,
    hold: Duration,
) -> usize {
    let mut tasks = Vec::new();
    for _ in 0..connections {
        tasks.push(tokio::spawn(async move {
            let tcp = TcpStream::connect(addr).await.expect("connects");
            let (mut send, conn) = h2::client::handshake(tcp).await.expect("handshake");
            let driver = tokio::spawn(async move {
                let _ = conn.await;
            });
            let mut held = Vec::new();
            for _ in 0..per_connection {
                let Ok(ready) = send.clone().ready().await else {
                    break;
                };
                send = ready;
                let req = http::Request::post(format!("http://{addr}/skewless.echo.v1.Echo/Echo"))
                    .header("content-type", "application/grpc")
                    .header("te", "trailers")
                    .body(())
                    .expect("request");
                match send.send_request(req, false) {
                    Ok(stream) => held.push(stream),
                    Err(_) => break,
                }
            }
            let opened = held.len();
            tokio::time::sleep(hold).await;
            drop(held);
            driver.abort();
            opened
        }));
    }
    let mut opened = 0;
    for t in tasks {
        opened += t.await.expect("holder");
    }
    opened
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_thousand_streams_whose_body_never_comes_cost_a_healthy_client_nothing() {
    for mode in [Mode::Request, Mode::Connection] {
        let bed = Bed::start(mode).await;
        let stop = Arc::new(AtomicBool::new(false));
        let healthy = healthy_client(bed.addr, stop.clone());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let opened = bodiless_streams(bed.addr, 8, 1024, Duration::from_secs(4)).await;
        stop.store(true, Ordering::Relaxed);
        let (made, failed) = healthy.await.expect("healthy client");
        assert_eq!(opened, 8 * 1024, "{mode:?}: every held stream was opened");
        assert!(
            failed.is_empty(),
            "{mode:?}, 8,192 streams held: {} of {made} healthy calls failed, first {:?}",
            failed.len(),
            failed.first()
        );
        assert!(
            made >= 100,
            "{mode:?}: the healthy client kept calling at its pace: {made} calls in 4 s"
        );
        bed.stop().await;
    }
}

/// Sends `calls` unary calls whose replies are `reply_size` bytes at window 0, makes no room
/// for them, and returns, per call, how its response ended once `wait` has passed: the
/// balancer's reset (its reason), or `None` while it is still held.
async fn never_reading(
    addr: SocketAddr,
    calls: usize,
    reply_size: u32,
    wait: Duration,
) -> Vec<Option<h2::Reason>> {
    let (responses, driver) =
        unary_calls(addr, Windows::Zero, calls, reply_size, b"never reads").await;
    let until = tokio::time::Instant::now() + wait;
    let mut ends = Vec::new();
    for (response, _stream) in responses {
        let ended = match tokio::time::timeout_at(until, response).await {
            Ok(Ok(r)) => {
                let mut body = r.into_body();
                // At window 0 no byte of the body can come: the next thing is its end.
                match tokio::time::timeout_at(until, body.data()).await {
                    Ok(Some(Err(e))) => e.reason(),
                    Ok(_) => panic!("a body byte came through a window of 0"),
                    Err(_) => None,
                }
            }
            Ok(Err(e)) => e.reason(),
            Err(_) => None,
        };
        ends.push(ended);
    }
    driver.abort();
    ends
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_makes_no_room_for_its_replies_is_reset_after_the_stalled_reader_timeout() {
    let config = Config {
        stalled_reader_timeout: Some(Duration::from_secs(1)),
        ..Config::default()
    };
    let bed = Bed::start_with(Mode::Request, config).await;
    let stop = Arc::new(AtomicBool::new(false));
    let healthy = healthy_client(bed.addr, stop.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = tokio::time::Instant::now();
    let ends = never_reading(bed.addr, 8, 1_000_000, Duration::from_secs(4)).await;
    // The healthy client calls on for the whole 4 s, resets or not.
    tokio::time::sleep_until(started + Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    let (made, failed) = healthy.await.expect("healthy client");
    assert!(
        ends.iter().all(|e| *e == Some(h2::Reason::CANCEL)),
        "every response the client made no room for is reset (CANCEL) within the 1 s timeout \
         and its slack: {ends:?}"
    );
    assert!(
        failed.is_empty() && made >= 100,
        "the healthy client loses nothing: {} of {made} failed, first {:?}",
        failed.len(),
        failed.first()
    );
    let metrics = bed.balancer.as_ref().expect("request mode").metrics();
    let stalled = FailureReason::ALL
        .iter()
        .position(|r| *r == FailureReason::StalledReader)
        .expect("a reason");
    assert_eq!(
        metrics.failures[stalled], 8,
        "each reset is counted as a stalled reader: {:?}",
        metrics.failures
    );
    bed.stop().await;
}
