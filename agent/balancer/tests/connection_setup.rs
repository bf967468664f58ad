//! Connection mode before the relay: what a new client connection costs until it has sent its
//! connection preface and first SETTINGS frame. A `ConnectionBalancer` served like the agent
//! serves it, on loopback, with a frame-level fake backend (its listener records every
//! connection the balancer opens) and raw TCP clients; paused time, so the 10 s handshake
//! timeout costs nothing.

use std::net::SocketAddr;
use std::time::Duration;

use skewless_balancer::Endpoint;
use skewless_balancer::connection::{ConnectionBalancer, ConnectionConfig};
use skewless_balancer::metrics::{ClientErrorReason, RotationReason};
use skewless_frame::{Head, Kind, PREFACE, Settings, flags};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

mod support;
use support::{STUCK, hello, next_frame};

struct Bed {
    addr: SocketAddr,
    balancer: ConnectionBalancer,
    /// Every connection the balancer opened to the backend, with when it was accepted.
    backend: mpsc::UnboundedReceiver<(Instant, TcpStream)>,
    /// Starts the server's drain.
    drain: Option<oneshot::Sender<()>>,
    /// The server; it returns once its drain is over.
    serving: JoinHandle<()>,
    tasks: Vec<JoinHandle<()>>,
}

impl Bed {
    /// No connection reached the backend so far.
    fn assert_no_backend_connection(&mut self, when: &str) {
        assert!(
            self.backend.try_recv().is_err(),
            "{when}: the balancer opened a backend connection"
        );
        assert_eq!(
            self.balancer.stats().connections,
            0,
            "{when}: a client is placed only once its preface is in"
        );
    }

    fn client_errors(&self, reason: ClientErrorReason) -> u64 {
        support::client_errors(&self.balancer.metrics(), reason)
    }

    fn rotations(&self, reason: RotationReason) -> u64 {
        support::rotations(&self.balancer.metrics(), reason)
    }

    async fn stop(mut self) {
        if !self.serving.is_finished() {
            self.serving.abort();
            let _ = (&mut self.serving).await;
        }
        for t in self.tasks.drain(..) {
            t.abort();
            let _ = t.await;
        }
    }
}

async fn bed() -> Bed {
    bed_with(ConnectionConfig::default()).await
}

async fn bed_with(config: ConnectionConfig) -> Bed {
    let backend = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    // The sender goes at once: the balancer keeps the last list it was given.
    let (_, rx) = tokio::sync::watch::channel(vec![Endpoint::new(
        backend.local_addr().expect("addr"),
        "pod-0",
    )]);
    let balancer = ConnectionBalancer::new(config, rx);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (accepted_tx, accepted) = mpsc::unbounded_channel();
    let accepting = tokio::spawn(async move {
        while let Ok((s, _)) = backend.accept().await {
            let _ = accepted_tx.send((Instant::now(), s));
        }
    });
    let b = balancer.clone();
    let (drain, drained) = oneshot::channel::<()>();
    let serving = tokio::spawn(async move {
        let shutdown = async {
            let _ = drained.await;
        };
        skewless_balancer::server::serve(&b, listener, shutdown, |_| true)
            .await
            .expect("serve");
    });
    Bed {
        addr,
        balancer,
        backend: accepted,
        drain: Some(drain),
        serving,
        tasks: vec![accepting],
    }
}

/// Reads until the balancer closes `s`; what came before.
async fn until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    tokio::time::timeout(STUCK, s.read_to_end(&mut got))
        .await
        .expect("the balancer never closes the client")
        .expect("read");
    got
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_client_without_a_preface_holds_no_backend_connection_until_it_is_closed() {
    let mut b = bed().await;
    let t0 = Instant::now();
    let mut clients = Vec::new();
    for sent in [&b""[..], &PREFACE[..12], &PREFACE[..], &hello()[..30]] {
        let mut c = TcpStream::connect(b.addr).await.expect("connects");
        c.write_all(sent).await.expect("write");
        clients.push(c);
    }
    tokio::time::sleep(Duration::from_secs(9)).await;
    b.assert_no_backend_connection("9 s in");
    for c in &mut clients {
        let got = until_closed(c).await;
        assert!(got.is_empty(), "nothing is sent to such a client: {got:?}");
    }
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_secs(10) && waited < Duration::from_secs(12),
        "closed at the 10 s handshake timeout: {waited:?}"
    );
    b.assert_no_backend_connection("after the close");
    assert_eq!(
        b.client_errors(ClientErrorReason::NoPreface),
        4,
        "each counted once as no_preface"
    );
    b.stop().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_client_that_is_not_speaking_http2_is_closed_at_once_without_a_backend_connection() {
    let mut b = bed().await;
    let mut ping_first = PREFACE.to_vec();
    ping_first.extend(Head::new(Kind::Ping, 0, 0, 8).encode());
    ping_first.extend([0; 8]);
    let t0 = Instant::now();
    for sent in [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), ping_first] {
        let mut c = TcpStream::connect(b.addr).await.expect("connects");
        c.write_all(&sent).await.expect("write");
        let got = until_closed(&mut c).await;
        assert!(got.is_empty(), "just FIN: {got:?}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "closed at once, not at the handshake timeout: {:?}",
        t0.elapsed()
    );
    b.assert_no_backend_connection("after the close");
    assert_eq!(b.client_errors(ClientErrorReason::Malformed), 2);
    b.stop().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_client_whose_preface_comes_late_is_placed_then_and_relayed_as_usual() {
    let mut b = bed().await;
    let mut c = TcpStream::connect(b.addr).await.expect("connects");
    let t0 = Instant::now();
    // Half the preface after 5 s, the rest with SETTINGS and a request at 9 s: within the
    // 10 s handshake timeout.
    tokio::time::sleep(Duration::from_secs(5)).await;
    c.write_all(&PREFACE[..12]).await.expect("write");
    tokio::time::sleep(Duration::from_secs(4)).await;
    b.assert_no_backend_connection("before the preface is complete");
    let mut rest = hello()[12..].to_vec();
    rest.extend(Head::new(Kind::Headers, flags::END_HEADERS, 1, 3).encode());
    rest.extend([0x82, 0x86, 0x84]);
    c.write_all(&rest).await.expect("write");

    let (at, mut s) = tokio::time::timeout(STUCK, b.backend.recv())
        .await
        .expect("the balancer is stuck")
        .expect("a backend connection");
    assert!(
        at - t0 >= Duration::from_secs(9),
        "connected once the preface was in: {:?}",
        at - t0
    );
    let mut preface = [0u8; 24];
    s.read_exact(&mut preface).await.expect("preface");
    assert_eq!(&preface, PREFACE, "the bytes read before are relayed first");
    let (head, payload) = next_frame(&mut s).await;
    assert_eq!((head.kind, payload.len()), (Kind::Settings, 0));
    let (head, payload) = next_frame(&mut s).await;
    assert_eq!((head.kind, head.stream_id), (Kind::Headers, 1));
    assert_eq!(
        payload,
        [0x82, 0x86, 0x84],
        "then what the client sent after them"
    );
    assert_eq!(b.balancer.stats().connections, 1, "placed");

    // Relayed both ways, and long after the handshake timeout.
    let mut settings = Vec::new();
    Settings::encode(false, &[], &mut settings);
    s.write_all(&settings).await.expect("write");
    let (head, _) = next_frame(&mut c).await;
    assert_eq!(head.kind, Kind::Settings);
    tokio::time::sleep(Duration::from_secs(30)).await;
    let mut req = Head::new(Kind::Headers, flags::END_HEADERS, 3, 3)
        .encode()
        .to_vec();
    req.extend([0x82, 0x86, 0x84]);
    c.write_all(&req).await.expect("write");
    let (head, _) = next_frame(&mut s).await;
    assert_eq!((head.kind, head.stream_id), (Kind::Headers, 3));
    assert_eq!(
        b.balancer.metrics().client_errors.iter().sum::<u64>(),
        0,
        "no client error counted"
    );
    assert!(b.backend.try_recv().is_err(), "one backend connection");
    b.stop().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_drain_closes_clients_without_a_preface_at_once_and_counts_them_drained() {
    // Such a connection has no stream and no backend: nothing to wind down gracefully, so the
    // drain must not wait for its handshake timeout (or its grace) to end it.
    let mut b = bed().await;
    let mut clients = Vec::new();
    for sent in [&b""[..], &PREFACE[..12], &hello()[..30]] {
        let mut c = TcpStream::connect(b.addr).await.expect("connects");
        c.write_all(sent).await.expect("write");
        clients.push(c);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        b.balancer.metrics().client_connections,
        3,
        "all three accepted"
    );
    let t0 = Instant::now();
    let _ = b.drain.take().expect("not drained yet").send(());
    for c in &mut clients {
        let got = until_closed(c).await;
        assert!(got.is_empty(), "nothing is sent to such a client: {got:?}");
    }
    tokio::time::timeout(STUCK, &mut b.serving)
        .await
        .expect("the drain never ends")
        .expect("serve task");
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "closed and the drain over at once, not at the 10 s handshake timeout: {:?}",
        t0.elapsed()
    );
    b.assert_no_backend_connection("after the drain");
    assert_eq!(
        b.rotations(RotationReason::Drain),
        3,
        "each wound down by the drain"
    );
    assert_eq!(
        b.balancer.metrics().client_errors.iter().sum::<u64>(),
        0,
        "the clients did nothing wrong: no no_preface"
    );
    assert_eq!(b.balancer.metrics().client_connections, 0, "none open");
    b.stop().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_client_whose_preface_comes_after_its_max_age_is_relayed_then_rotated_not_closed() {
    // A client starved right after its connect (seen at load 11-17) sends its preface later
    // than a short max age. Closing it then is no rotation: the client sees its connect fail
    // (grpc-js fails its waiting calls "No connection established"). The max age counts from
    // the preface: the client is relayed, then wound down with a GOAWAY.
    let mut b = bed_with(ConnectionConfig {
        max_connection_age: Some(Duration::from_secs(1)),
        ..ConnectionConfig::default()
    })
    .await;
    let mut c = TcpStream::connect(b.addr).await.expect("connects");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let t0 = Instant::now();
    c.write_all(&hello()).await.expect("write");
    let (_, mut s) = tokio::time::timeout(STUCK, b.backend.recv())
        .await
        .expect("the client was closed before its preface, not relayed")
        .expect("a backend connection");
    let mut preface = [0u8; 24];
    s.read_exact(&mut preface).await.expect("preface");
    assert_eq!(&preface, PREFACE, "relayed");
    let mut settings = Vec::new();
    Settings::encode(false, &[], &mut settings);
    s.write_all(&settings).await.expect("write");
    let (head, _) = next_frame(&mut c).await;
    assert_eq!(
        head.kind,
        Kind::Settings,
        "the backend's SETTINGS reach the client"
    );
    // Then the rotation: a GOAWAY, about a max age after the preface.
    loop {
        let (head, _) = next_frame(&mut c).await;
        if head.kind == Kind::GoAway {
            break;
        }
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "the max age counts from the preface: GOAWAY after {:?}",
        t0.elapsed()
    );
    assert_eq!(
        b.rotations(RotationReason::MaxAge),
        1,
        "rotated for its max age"
    );
    b.stop().await;
}
