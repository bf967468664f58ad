//! What the balancer's test suites share: the bed that serves a balancer of either mode on a
//! loopback listener ([`Serving`]), echo pods and their endpoints, builders of the raw HTTP/2
//! frames the frame-level tests write and read, the checks both request-mode data paths
//! must pass (large messages, a slow reader's backpressure), and the way a suite runs its
//! tests on both ([`DataPath`], `on_both_paths!`).

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the support"
)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};

use skewless_balancer::metrics::{ClientErrorReason, RotationReason, ServiceSnapshot};
use skewless_balancer::{Endpoint, NewConnection};
use skewless_echo::SpawnedEcho;
use skewless_echo::pb::EchoRequest;
use skewless_echo::pb::echo_client::EchoClient;
use skewless_frame::{
    ErrorCode, Frames, GoAway, HEADER_LEN, Head, Kind, MAX_MAX_FRAME_SIZE, PREFACE, Ping, Settings,
};
use tokio::io::{AsyncRead, AsyncReadExt as _};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// Long enough never to fire in a passing test; under paused time it fires only when
/// everything is idle, that is when the balancer is stuck.
pub const STUCK: Duration = Duration::from_secs(3600);

/// `RUST_LOG=skewless_balancer=debug cargo test ...` shows the balancer's view of a test.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// A balancer of either mode serving a loopback listener, whatever the mode, until
/// [`Serving::stop`] (which drains it) or its drop.
pub struct Serving<B> {
    pub addr: SocketAddr,
    pub balancer: Arc<B>,
    /// Publishes the Service's endpoints to the balancer.
    pub endpoints: watch::Sender<Vec<Endpoint>>,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

/// Serves the balancer `make` builds over `endpoints` (the receiver it is given follows
/// [`Serving::endpoints`]) on a fresh loopback port, admitting every peer.
pub async fn serve<B: NewConnection + Send + Sync + 'static>(
    endpoints: Vec<Endpoint>,
    make: impl FnOnce(watch::Receiver<Vec<Endpoint>>) -> B,
) -> Serving<B> {
    init_tracing();
    let (tx, rx) = watch::channel(endpoints);
    let balancer = Arc::new(make(rx));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let b = balancer.clone();
    let task = tokio::spawn(async move {
        let shutdown = async {
            let _ = shutdown_rx.await;
        };
        skewless_balancer::server::serve(&*b, listener, shutdown, |_| true)
            .await
            .expect("serve");
    });
    Serving {
        addr,
        balancer,
        endpoints: tx,
        shutdown: Some(shutdown_tx),
        task,
    }
}

impl<B> Serving<B> {
    /// Starts the drain (once): the listener closes and every connection is wound down.
    pub fn start_drain(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Drains the balancer: `serve` must return within `within`. The balancer stays readable.
    pub async fn stop_within(&mut self, within: Duration) {
        self.start_drain();
        tokio::time::timeout(within, &mut self.task)
            .await
            .expect("serve returns within the drain grace")
            .expect("serve task");
    }
}

/// An upstream on a fresh loopback port that serves every connection it accepts with
/// `serve`, each on a task of its own, and counts them: its address and the count.
pub async fn counting_upstream<F, Fut>(serve: F) -> (SocketAddr, Arc<AtomicUsize>)
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(serve(stream));
        }
    });
    (addr, accepted)
}

/// `n` echo pods on loopback, named `pod-0` ...
pub async fn pods(n: usize) -> Vec<SpawnedEcho> {
    let mut v = Vec::new();
    for i in 0..n {
        v.push(
            SpawnedEcho::start("127.0.0.1:0".parse().expect("addr"), &format!("pod-{i}"))
                .await
                .expect("echo starts"),
        );
    }
    v
}

/// The pods as a Service's endpoints.
pub fn endpoints(pods: &[SpawnedEcho]) -> Vec<Endpoint> {
    pods.iter()
        .map(|p| Endpoint::new(p.addr, &p.name))
        .collect()
}

/// Client connections the Service's numbers count closed for `reason`.
pub fn client_errors(s: &ServiceSnapshot, reason: ClientErrorReason) -> u64 {
    s.client_errors[reason.index()]
}

/// Rotations the Service's numbers count for `reason`.
pub fn rotations(s: &ServiceSnapshot, reason: RotationReason) -> u64 {
    s.rotations[reason.index()]
}

/// A frame of `kind` with `payload` (any bytes: nothing checks them).
pub fn frame(kind: Kind, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).expect("small");
    let mut f = Head::new(kind, flags, stream, len).encode().to_vec();
    f.extend_from_slice(payload);
    f
}

/// A PING (or its ACK) with `opaque`.
pub fn ping(ack: bool, opaque: [u8; 8]) -> Vec<u8> {
    let mut f = Vec::new();
    Ping { ack, opaque }.encode(&mut f);
    f
}

/// A GOAWAY with `last` and `code`, no debug data.
pub fn go_away(last: u32, code: ErrorCode) -> Vec<u8> {
    let mut f = Vec::new();
    GoAway {
        last_stream_id: last,
        error_code: code,
        debug_data: b"",
    }
    .encode(&mut f);
    f
}

/// An empty SETTINGS frame, the first frame after the client preface.
pub fn empty_settings() -> Vec<u8> {
    let mut f = Vec::new();
    Settings::encode(false, &[], &mut f);
    f
}

/// A SETTINGS ACK.
pub fn settings_ack() -> Vec<u8> {
    let mut f = Vec::new();
    Settings::encode(true, &[], &mut f);
    f
}

/// The client preface and an empty SETTINGS, as every client starts.
pub fn hello() -> Vec<u8> {
    let mut v = PREFACE.to_vec();
    v.extend(empty_settings());
    v
}

/// The error codes of the GOAWAY frames in `bytes` (a server's side of an HTTP/2 connection,
/// from its first frame).
pub fn go_away_codes(bytes: &[u8]) -> Vec<ErrorCode> {
    Frames::new(bytes, MAX_MAX_FRAME_SIZE)
        .map_while(Result::ok)
        .filter(|(head, _)| head.kind == Kind::GoAway)
        .filter_map(|(head, payload)| GoAway::decode(&head, payload).ok())
        .map(|g| g.error_code)
        .collect()
}

/// The next frame `io` carries (within [`STUCK`]).
pub async fn next_frame(io: &mut (impl AsyncRead + Unpin)) -> (Head, Vec<u8>) {
    tokio::time::timeout(STUCK, frame_or_end(io))
        .await
        .expect("the balancer is stuck")
        .expect("a frame")
}

/// The next frame `io` carries; `None` once it ends (or breaks) before a whole frame.
pub async fn frame_or_end(io: &mut (impl AsyncRead + Unpin)) -> Option<(Head, Vec<u8>)> {
    let mut header = [0u8; HEADER_LEN];
    io.read_exact(&mut header).await.ok()?;
    let head = Head::decode(&header);
    let mut payload = vec![0u8; head.len as usize];
    io.read_exact(&mut payload).await.ok()?;
    Some((head, payload))
}

/// An HTTP/2 client connection to `addr`, driven on its own task.
pub async fn raw_client(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<Full<Bytes>> {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake(TokioIo::new(tcp))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    send
}

/// A unary Echo call with an empty `EchoRequest` (one gRPC frame: no compression, length 0).
pub fn grpc_request(addr: SocketAddr, timeout: Option<&str>) -> http::Request<Full<Bytes>> {
    let mut b = http::Request::post(format!("http://{addr}/skewless.echo.v1.Echo/Echo"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(t) = timeout {
        b = b.header("grpc-timeout", t);
    }
    b.body(Full::new(Bytes::from_static(&[0, 0, 0, 0, 0])))
        .expect("request")
}

/// A 6 MiB request and an 8 MiB reply pass through whole (both far over every HTTP/2 window,
/// and over gRPC's default 4 MiB message bound, which `c` must lift).
pub async fn large_messages_pass(c: &mut EchoClient<tonic::transport::Channel>) {
    let big = vec![7u8; 6 * 1024 * 1024];
    let r = c
        .echo(EchoRequest {
            payload: big.clone(),
            ..EchoRequest::default()
        })
        .await
        .expect("6 MiB request")
        .into_inner();
    assert_eq!(
        r.payload.len(),
        big.len(),
        "a 6 MiB message comes back whole"
    );
    assert!(r.payload == big, "and unchanged");
    let r = c
        .echo(EchoRequest {
            reply_size: 8 * 1024 * 1024,
            ..EchoRequest::default()
        })
        .await
        .expect("8 MiB reply")
        .into_inner();
    assert_eq!(r.payload.len(), 8 * 1024 * 1024);
}

/// An upstream that answers every request with 64 KiB chunks as fast as it is allowed to
/// send them, counting the bytes it produced.
pub async fn flood_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    struct Flood(Arc<AtomicUsize>);
    impl Body for Flood {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            self.0.fetch_add(64 * 1024, Ordering::Relaxed);
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![0u8; 64 * 1024])))))
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let up = listener.local_addr().expect("addr");
    let produced = Arc::new(AtomicUsize::new(0));
    let count = produced.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |_req: http::Request<Incoming>| {
                    let count = count.clone();
                    async move {
                        let mut resp = http::Response::new(Flood(count));
                        resp.headers_mut()
                            .insert("content-type", "application/grpc".parse().expect("header"));
                        Ok::<_, Infallible>(resp)
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (up, produced)
}

/// Through the balancer at `addr` to a [`flood_upstream`] that counts into `produced`: a
/// client that does not read holds the upstream back (only the HTTP/2 windows' worth is
/// produced, nothing is buffered beyond them), and reading again lets it go on.
pub async fn a_slow_reader_holds_back_the_upstream(addr: SocketAddr, produced: &AtomicUsize) {
    let mut send = raw_client(addr).await;
    let resp = send
        .send_request(grpc_request(addr, None))
        .await
        .expect("response headers");
    // The client does not read for a second.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stalled = produced.load(Ordering::Relaxed);
    assert!(
        stalled < 24 * 1024 * 1024,
        "with a reader that does not read, only the HTTP/2 windows' worth may be produced \
         (client + balancer + upstream buffers), not {stalled} bytes"
    );
    // Reading resumes the flow.
    let mut body = resp.into_body();
    let mut read = 0;
    while read < 8 * 1024 * 1024 {
        let frame = body.frame().await.expect("more").expect("data");
        read += frame.data_ref().map_or(0, Bytes::len);
    }
    assert!(
        produced.load(Ordering::Relaxed) > stalled,
        "reading lets the upstream go on"
    );
}

/// A TCP forwarder in front of one pod that can blackhole it: while the returned flag holds
/// true it moves no byte either way and closes nothing (no RST, no FIN), which is how a lost
/// node or a network partition looks from the balancer's side. Connections made meanwhile
/// complete the TCP handshake (the kernel does it) but are never answered. Bytes sent into the
/// blackhole arrive once it lifts, as TCP's retransmissions would.
pub async fn blackholable(to: SocketAddr) -> (SocketAddr, watch::Sender<bool>) {
    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut dark: watch::Receiver<bool>,
    ) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if dark.wait_for(|d| !*d).await.is_err() {
                return;
            }
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if dark.wait_for(|d| !*d).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (dark, rx) = watch::channel(false);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let rx = rx.clone();
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(to).await else {
                    return;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::join!(pump(cr, sw, rx.clone()), pump(sr, cw, rx));
            });
        }
    });
    (addr, dark)
}

/// Request mode on either data path: h2's (`Balancer`) or the frame codec's
/// (`CodecBalancer`), as the tests that run on both drive it: what the library's
/// `RequestBalancer` reads and tells either, and how to start one.
pub trait DataPath:
    skewless_balancer::NewConnection + skewless_balancer::RequestBalancer + 'static
{
    /// Whether this is the frame codec's path (for the few checks where the paths differ).
    const CODEC: bool;
    fn start(config: skewless_balancer::Config, endpoints: watch::Receiver<Vec<Endpoint>>) -> Self;
}

impl DataPath for skewless_balancer::Balancer {
    const CODEC: bool = false;
    fn start(config: skewless_balancer::Config, endpoints: watch::Receiver<Vec<Endpoint>>) -> Self {
        Self::new(config, endpoints)
    }
}

impl DataPath for skewless_balancer::CodecBalancer {
    const CODEC: bool = true;
    fn start(config: skewless_balancer::Config, endpoints: watch::Receiver<Vec<Endpoint>>) -> Self {
        Self::new(config, endpoints)
    }
}

/// A balancer on data path `P` serving a loopback port.
pub async fn balancer_on<P: DataPath>(
    config: skewless_balancer::Config,
    endpoints: Vec<Endpoint>,
) -> Serving<P> {
    serve(endpoints, |rx| P::start(config, rx)).await
}

/// Runs the tests named, each an `async fn name<P: DataPath>()` of the module, on both data
/// paths: as `h2_path::name` and as `codec_path::name`.
#[allow(
    unused_macros,
    reason = "each test binary uses a different part of the support"
)]
macro_rules! on_both_paths {
    ($($name:ident),* $(,)?) => {
        mod h2_path {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name::<skewless_balancer::Balancer>().await;
                }
            )*
        }
        mod codec_path {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name::<skewless_balancer::CodecBalancer>().await;
                }
            )*
        }
    };
}
#[allow(
    unused_imports,
    reason = "each test binary uses a different part of the support"
)]
pub(crate) use on_both_paths;
