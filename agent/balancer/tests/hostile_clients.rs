//! Hostile clients, in both modes: a client that floods its connection with PINGs, SETTINGS
//! or RST_STREAMs, opens streams without end, or sends no preface (or a SETTINGS ACK for one)
//! is cut off with a GOAWAY that says why and counted, and a well-behaved client of the same
//! balancer is served all along. The hostile client is a raw TCP peer writing frames
//! (skewless-frame's codec; the one header block is a static-table constant, never HPACK
//! encoding), on loopback, bounded in bytes and time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use skewless_balancer::connection::{ConnectionBalancer, ConnectionConfig};
use skewless_balancer::metrics::{ClientErrorReason, RotationReason, ServiceSnapshot};
use skewless_balancer::{Balancer, CodecBalancer, Config, Endpoint};
use skewless_echo::SpawnedEcho;
use skewless_echo::pb::EchoRequest;
use skewless_echo::pb::echo_client::EchoClient;
use skewless_frame::{ErrorCode, GoAway, HEADER_LEN, Head, Kind, PREFACE, flags};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tonic::transport::Channel;

mod support;
use support::{Serving, client_errors, frame, hello, pods, rotations};

/// Frames the flooder may send before the test calls the balancer unbounded.
const MAX_FRAMES: usize = 2_000_000;
/// Frames per write.
const CHUNK: usize = 2_000;

fn ping() -> Vec<u8> {
    support::ping(false, [7; 8])
}

/// Which balancer a bed serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Request,
    Connection,
    /// Request mode on the frame codec (experimental), where it already has the guard.
    Codec,
}

enum Served {
    Request(Serving<Balancer>),
    Connection(Serving<ConnectionBalancer>),
    Codec(Serving<CodecBalancer>),
}

struct Bed {
    addr: SocketAddr,
    served: Served,
    _pod: SpawnedEcho,
}

impl Bed {
    async fn start() -> Self {
        Self::start_with(Config::default()).await
    }

    async fn start_with(config: Config) -> Self {
        Self::serving(Mode::Request, config, ConnectionConfig::default()).await
    }

    async fn mode(mode: Mode) -> Self {
        Self::serving(mode, Config::default(), ConnectionConfig::default()).await
    }

    async fn serving(mode: Mode, config: Config, connection: ConnectionConfig) -> Self {
        let pod = pods(1).await.pop().expect("a pod");
        let endpoints = vec![Endpoint::new(pod.addr, "pod-0")];
        let (addr, served) = match mode {
            Mode::Request => {
                let s = support::serve(endpoints, |rx| Balancer::new(config, rx)).await;
                (s.addr, Served::Request(s))
            }
            Mode::Connection => {
                let s =
                    support::serve(endpoints, |rx| ConnectionBalancer::new(connection, rx)).await;
                (s.addr, Served::Connection(s))
            }
            Mode::Codec => {
                let s = support::serve(endpoints, |rx| CodecBalancer::new(config, rx)).await;
                // A call that finds no upstream connection up yet fails at once on this path:
                // the bed is ready when one succeeds.
                let channel = Channel::from_shared(format!("http://{}", s.addr))
                    .expect("uri")
                    .connect()
                    .await
                    .expect("connects");
                let mut c = EchoClient::new(channel);
                let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
                while c.echo(EchoRequest::default()).await.is_err() {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "the codec path serves no call within 5 s"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                (s.addr, Served::Codec(s))
            }
        };
        Self {
            addr,
            served,
            _pod: pod,
        }
    }

    /// The Service's numbers.
    fn metrics(&self) -> ServiceSnapshot {
        match &self.served {
            Served::Request(s) => s.balancer.metrics(),
            Served::Connection(s) => s.balancer.metrics(),
            Served::Codec(s) => s.balancer.metrics(),
        }
    }

    /// Client connections closed for `reason`, wherever the mode counts them (request mode
    /// counts its floods in `BalancerCounters`, the rest in the Service's cells).
    fn client_errors(&self, reason: ClientErrorReason) -> u64 {
        let flood = |c: skewless_balancer::BalancerCounters| match reason {
            ClientErrorReason::PingFlood => c.ping_floods,
            ClientErrorReason::SettingsFlood => c.settings_floods,
            ClientErrorReason::RstStreamFlood => c.rst_stream_floods,
            _ => 0,
        };
        let counted = match &self.served {
            Served::Request(s) => flood(s.balancer.counters()),
            Served::Connection(_) | Served::Codec(_) => 0,
        };
        counted + client_errors(&self.metrics(), reason)
    }

    /// Every client connection closed for something the client did, whatever the reason.
    fn all_client_errors(&self) -> u64 {
        ClientErrorReason::ALL
            .iter()
            .map(|r| self.client_errors(*r))
            .sum()
    }

    /// Starts the drain.
    fn start_drain(&mut self) {
        match &mut self.served {
            Served::Request(s) => s.start_drain(),
            Served::Connection(s) => s.start_drain(),
            Served::Codec(s) => s.start_drain(),
        }
    }

    /// The drain is over within `within`.
    async fn drained_within(&mut self, within: Duration) {
        match &mut self.served {
            Served::Request(s) => s.stop_within(within).await,
            Served::Connection(s) => s.stop_within(within).await,
            Served::Codec(s) => s.stop_within(within).await,
        }
    }

    async fn stop(mut self) {
        self.drained_within(Duration::from_secs(15)).await;
    }
}

/// What the balancer wrote to a hostile client, followed frame by frame as it comes: the
/// GOAWAYs' error codes (a flood's PONGs and ACKs are read and dropped, never kept).
#[derive(Debug, Default)]
struct Received {
    pending: Vec<u8>,
    go_aways: Vec<ErrorCode>,
}

impl Received {
    fn feed(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
        let mut at = 0;
        while self.pending.len() >= at + HEADER_LEN {
            let header: &[u8; HEADER_LEN] = self.pending[at..at + HEADER_LEN]
                .try_into()
                .expect("a header");
            let head = Head::decode(header);
            let end = at + HEADER_LEN + head.len as usize;
            if end > self.pending.len() {
                break;
            }
            if head.kind == Kind::GoAway
                && let Ok(g) = GoAway::decode(&head, &self.pending[at + HEADER_LEN..end])
            {
                self.go_aways.push(g.error_code);
            }
            at = end;
        }
        self.pending.drain(..at);
    }
}

/// Reads everything the balancer sends on `rd` until it closes (EOF or a reset), following
/// its frames.
async fn read_all(mut rd: impl tokio::io::AsyncRead + Unpin) -> Received {
    let mut got = Received::default();
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n) = rd.read(&mut buf).await {
        if n == 0 {
            break;
        }
        got.feed(&buf[..n]);
    }
    got
}

/// A well-behaved client calling in a loop until told to stop; the calls it made, and those
/// that failed.
fn good_client(
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(usize, Vec<tonic::Status>)> {
    tokio::spawn(async move {
        let channel = Channel::from_shared(format!("http://{addr}"))
            .expect("uri")
            .timeout(Duration::from_secs(10))
            .connect()
            .await
            .expect("the good client connects");
        let mut c = EchoClient::new(channel);
        let (mut calls, mut failed) = (0, Vec::new());
        while !stop.load(Ordering::Relaxed) || calls < 20 {
            let r = c
                .echo(EchoRequest {
                    payload: b"good".to_vec(),
                    ..EchoRequest::default()
                })
                .await;
            calls += 1;
            if let Err(status) = r {
                failed.push(status);
            }
        }
        (calls, failed)
    })
}

/// Connects, writes `opening`, then `unit(0)`, `unit(1)`, ... (reading everything the
/// balancer answers, so its PONGs and ACKs never push back) until the balancer closes the
/// connection; the number of units written and what the balancer sent. Panics if it never
/// closes within `MAX_FRAMES` or 30 s.
async fn flood(
    addr: SocketAddr,
    opening: &[u8],
    unit: impl Fn(usize) -> Vec<u8>,
) -> (usize, Received) {
    let stream = TcpStream::connect(addr)
        .await
        .expect("the flooder connects");
    let (rd, mut wr) = stream.into_split();
    let closed = Arc::new(AtomicBool::new(false));
    let reader = tokio::spawn({
        let closed = closed.clone();
        async move {
            let got = read_all(rd).await;
            closed.store(true, Ordering::Relaxed);
            got
        }
    });
    wr.write_all(opening).await.expect("the opening is written");
    let sent = AtomicUsize::new(0);
    let flooding = async {
        while sent.load(Ordering::Relaxed) < MAX_FRAMES && !closed.load(Ordering::Relaxed) {
            let from = sent.load(Ordering::Relaxed);
            let chunk: Vec<u8> = (from..from + CHUNK).flat_map(&unit).collect();
            if wr.write_all(&chunk).await.is_err() {
                break;
            }
            sent.fetch_add(CHUNK, Ordering::Relaxed);
        }
    };
    tokio::time::timeout(Duration::from_secs(30), flooding)
        .await
        .expect("the flood is bounded in time");
    let got = tokio::time::timeout(Duration::from_secs(10), reader)
        .await
        .expect("the balancer closes the flooding connection")
        .expect("reader");
    let sent = sent.load(Ordering::Relaxed);
    assert!(
        sent < MAX_FRAMES,
        "the balancer cut the flood off before {MAX_FRAMES} frames"
    );
    (sent, got)
}

/// Runs `flood` against a balancer in `mode` that a good client uses all along, and checks
/// that the good client lost nothing and the flooder got one GOAWAY(`code`); the flood's frame
/// count, and the bed to read its numbers from (stop it after).
async fn flooded_while_serving(
    mode: Mode,
    opening: Vec<u8>,
    unit: impl Fn(usize) -> Vec<u8>,
    code: ErrorCode,
) -> (usize, Bed) {
    let bed = Bed::mode(mode).await;
    let stop = Arc::new(AtomicBool::new(false));
    let good = good_client(bed.addr, stop.clone());
    let (sent, got) = flood(bed.addr, &opening, unit).await;
    stop.store(true, Ordering::Relaxed);
    let (calls, failed) = good.await.expect("good client");
    assert!(
        failed.is_empty(),
        "{mode:?}: the good client is unaffected: {} of {calls} calls failed, first {:?}",
        failed.len(),
        failed.first()
    );
    assert_eq!(
        got.go_aways,
        [code],
        "{mode:?}: the flooder is told why it is cut off, once"
    );
    (sent, bed)
}

/// Runs `case` for each mode, one after the other.
async fn both_modes<F: std::future::Future<Output = ()>>(case: impl Fn(Mode) -> F) {
    for mode in [Mode::Request, Mode::Connection] {
        case(mode).await;
    }
}

/// Runs `case` for each mode and for request mode on the frame codec, one after the other.
async fn both_modes_and_codec<F: std::future::Future<Output = ()>>(case: impl Fn(Mode) -> F) {
    for mode in [Mode::Request, Mode::Connection, Mode::Codec] {
        case(mode).await;
    }
}

/// Checks that exactly one client connection was closed, for `reason` (counted by the time
/// its client saw the close, or a moment after: h2 counts once the connection's task sees the
/// end it wrote).
async fn assert_cut_off_once(bed: &Bed, mode: Mode, reason: ClientErrorReason) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while bed.client_errors(reason) == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        bed.client_errors(reason),
        1,
        "{mode:?}: counted once as {reason:?}"
    );
    assert_eq!(
        bed.all_client_errors(),
        1,
        "{mode:?}: and nothing else: {:?}",
        bed.metrics().client_errors
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ping_flood_is_cut_off_with_enhance_your_calm_and_counted_and_other_clients_are_served() {
    both_modes_and_codec(|mode| async move {
        let (sent, bed) =
            flooded_while_serving(mode, hello(), |_| ping(), ErrorCode::ENHANCE_YOUR_CALM).await;
        assert_cut_off_once(&bed, mode, ClientErrorReason::PingFlood).await;
        eprintln!("{mode:?}: PING flood cut off after {sent} frames written");
        bed.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settings_flood_is_cut_off_with_enhance_your_calm_and_counted_and_other_clients_are_served()
 {
    both_modes_and_codec(|mode| async move {
        let settings = frame(Kind::Settings, 0, 0, &[]);
        let (sent, bed) = flooded_while_serving(
            mode,
            hello(),
            move |_| settings.clone(),
            ErrorCode::ENHANCE_YOUR_CALM,
        )
        .await;
        assert_cut_off_once(&bed, mode, ClientErrorReason::SettingsFlood).await;
        eprintln!("{mode:?}: SETTINGS flood cut off after {sent} frames written");
        bed.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rst_stream_flood_on_a_closed_stream_is_cut_off_with_enhance_your_calm_and_counted() {
    // One stream (GET /, a static-table header block), then RST_STREAM on it again and
    // again: h2 ignores a reset of a closed stream, so only the guard can stop this.
    both_modes_and_codec(|mode| async move {
        let mut opening = hello();
        opening.extend(frame(
            Kind::Headers,
            flags::END_HEADERS | flags::END_STREAM,
            1,
            &[0x82, 0x86, 0x84],
        ));
        let rst = frame(Kind::RstStream, 0, 1, &8u32.to_be_bytes());
        let (sent, bed) = flooded_while_serving(
            mode,
            opening,
            move |_| rst.clone(),
            ErrorCode::ENHANCE_YOUR_CALM,
        )
        .await;
        assert_cut_off_once(&bed, mode, ClientErrorReason::RstStreamFlood).await;
        eprintln!("{mode:?}: RST_STREAM flood cut off after {sent} frames written");
        bed.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_streams_on_one_connection_are_cut_off_and_counted() {
    // 100,000 requests opened and never finished (GET /, a static-table header block, no
    // END_STREAM). Request mode: h2 takes 1,024 at once (MAX_CLIENT_STREAMS), refuses the
    // next ones, and at 1,024 refusals (MAX_LOCAL_ERROR_RESETS) ends the connection with
    // ENHANCE_YOUR_CALM. Connection mode: the relay tracks 8,192 open streams and closes the
    // connection at the next one, with ENHANCE_YOUR_CALM.
    both_modes(|mode| async move {
        let headers = |i: usize| {
            let id = u32::try_from(1 + 2 * i).expect("small");
            frame(Kind::Headers, flags::END_HEADERS, id, &[0x82, 0x86, 0x84])
        };
        let (sent, bed) =
            flooded_while_serving(mode, hello(), headers, ErrorCode::ENHANCE_YOUR_CALM).await;
        assert!(
            sent <= 100_000,
            "{mode:?}: cut off before 100,000 streams, after {sent} were written"
        );
        assert_cut_off_once(&bed, mode, ClientErrorReason::TooManyStreams).await;
        eprintln!("{mode:?}: stream flood cut off after {sent} HEADERS written");
        bed.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settings_ack_instead_of_the_preface_is_closed_at_once_and_counted() {
    // The magic, then a SETTINGS ACK (acknowledging the server's SETTINGS) and never a
    // SETTINGS of its own, then a request: no preface (RFC 9113 section 3.4), closed by the
    // handshake deadline (at once) and counted, while a good client loses nothing.
    both_modes_and_codec(|mode| async move {
        let bed = Bed::mode(mode).await;
        let stop = Arc::new(AtomicBool::new(false));
        let good = good_client(bed.addr, stop.clone());
        let t0 = tokio::time::Instant::now();
        let mut c = TcpStream::connect(bed.addr).await.expect("connects");
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(Kind::Settings, flags::ACK, 0, &[]));
        hello.extend(frame(
            Kind::Headers,
            flags::END_HEADERS | flags::END_STREAM,
            1,
            &[0x82, 0x86, 0x84],
        ));
        c.write_all(&hello).await.expect("the fake preface");
        let got = tokio::time::timeout(Duration::from_secs(30), read_all(c))
            .await
            .expect("the balancer closes the connection");
        let waited = t0.elapsed();
        assert!(
            waited < Duration::from_secs(9),
            "{mode:?}: closed by the 10 s handshake deadline, at once: {waited:?}"
        );
        if mode != Mode::Connection {
            assert_eq!(
                got.go_aways,
                [ErrorCode::PROTOCOL_ERROR],
                "request mode spoke first: told why"
            );
        }
        stop.store(true, Ordering::Relaxed);
        let (calls, failed) = good.await.expect("good client");
        assert!(
            failed.is_empty(),
            "{mode:?}: {} of {calls} calls failed",
            failed.len()
        );
        assert_cut_off_once(&bed, mode, ClientErrorReason::Malformed).await;
        bed.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_send_no_preface_are_closed_after_the_handshake_timeout_and_counted() {
    // 50 connections that send nothing, one that sends half the magic and one the whole
    // magic but no SETTINGS (h2's handshake is over then: the preface is not), beside a good
    // client: each is closed at the 10 s handshake timeout (not before), counted once. Both
    // modes and the codec path at once (each waits the same 10 s).
    let cases = [Mode::Request, Mode::Connection, Mode::Codec].map(|mode| async move {
        let bed = Bed::mode(mode).await;
        let stop = Arc::new(AtomicBool::new(false));
        let good = good_client(bed.addr, stop.clone());
        let t0 = tokio::time::Instant::now();
        let mut silent = Vec::new();
        for i in 0..52 {
            let mut s = TcpStream::connect(bed.addr).await.expect("connects");
            if i == 50 {
                s.write_all(&PREFACE[..12]).await.expect("half the magic");
            }
            if i == 51 {
                s.write_all(&PREFACE[..])
                    .await
                    .expect("the magic, no SETTINGS");
            }
            silent.push(tokio::spawn(async move {
                let mut rest = Vec::new();
                // EOF or a reset: either way the balancer closed it.
                let _ = s.read_to_end(&mut rest).await;
                (rest.len(), t0.elapsed())
            }));
        }
        for s in silent {
            // What came before the close is h2's SETTINGS in request mode (a server sends its
            // own preface at once), nothing in connection mode.
            let (_, waited) = tokio::time::timeout(Duration::from_secs(30), s)
                .await
                .expect("the balancer closes a silent client")
                .expect("reader");
            assert!(
                waited >= Duration::from_millis(9_900),
                "{mode:?}: closed at the 10 s handshake timeout, not before: {waited:?}"
            );
        }
        stop.store(true, Ordering::Relaxed);
        let (calls, failed) = good.await.expect("good client");
        assert!(
            failed.is_empty(),
            "{mode:?}: {} of {calls} calls failed",
            failed.len()
        );
        assert_eq!(
            bed.client_errors(ClientErrorReason::NoPreface),
            52,
            "{mode:?}: {:?}",
            bed.metrics().client_errors
        );
        bed.stop().await;
    });
    let [a, b, c] = cases;
    tokio::join!(a, b, c);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_drain_closes_clients_without_a_preface_at_once_and_counts_them_drained() {
    // Such a connection has no stream: nothing to wind down gracefully, so the drain must not
    // wait for its handshake timeout (or its grace) to end it. h2's handshake ends with the
    // 24-byte magic, before the client's SETTINGS (the preface's end): the last client sent
    // the magic only, and is closed at once like the others. Paused time: the 10 s timeout
    // costs nothing, and "at once" is measured on the runtime's clock.
    let mut bed = Bed::start().await;
    let mut clients = Vec::new();
    for sent in [&b""[..], &PREFACE[..12], &PREFACE[..23], &PREFACE[..]] {
        let mut c = TcpStream::connect(bed.addr).await.expect("connects");
        c.write_all(sent).await.expect("write");
        clients.push(c);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(bed.metrics().client_connections, 4, "all four accepted");
    let t0 = tokio::time::Instant::now();
    bed.start_drain();
    for c in &mut clients {
        // h2's SETTINGS (a server sends its own preface at once), then FIN.
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(3600), c.read_to_end(&mut got))
            .await
            .expect("the balancer never closes the client")
            .expect("FIN, not a reset");
    }
    bed.drained_within(Duration::from_secs(3600)).await;
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "closed and the drain over at once, not at the 10 s handshake timeout: {:?}",
        t0.elapsed()
    );
    let service = bed.metrics();
    assert_eq!(
        rotations(&service, RotationReason::Drain),
        4,
        "each wound down by the drain"
    );
    assert_eq!(
        service.client_errors.iter().sum::<u64>(),
        0,
        "the clients did nothing wrong: no no_preface"
    );
    assert_eq!(service.client_connections, 0, "none open");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_client_whose_preface_comes_after_its_max_age_is_wound_down_with_a_goaway_not_closed() {
    // A client starved right after its connect (seen at load 15-20) sends its preface later
    // than a short max age. Closing it then is no rotation: the client sees its connect fail
    // and fails its waiting calls. The max age counts from the preface: the connection is
    // served, then wound down with h2's GOAWAY. Paused time: the ages cost nothing.
    let bed = Bed::start_with(Config {
        max_connection_age: Some(Duration::from_secs(1)),
        ..Config::default()
    })
    .await;
    let mut c = TcpStream::connect(bed.addr).await.expect("connects");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let t0 = tokio::time::Instant::now();
    c.write_all(&hello()).await.expect("the preface, late");
    let mut kinds = Vec::new();
    loop {
        let mut header = [0u8; skewless_frame::HEADER_LEN];
        tokio::time::timeout(Duration::from_secs(3600), c.read_exact(&mut header))
            .await
            .expect("the balancer is stuck")
            .unwrap_or_else(|e| panic!("closed without a GOAWAY after {kinds:?}: {e}"));
        let head = Head::decode(&header);
        let mut payload = vec![0u8; head.len as usize];
        c.read_exact(&mut payload).await.expect("the payload");
        kinds.push(head.kind);
        if head.kind == Kind::GoAway {
            break;
        }
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "the max age counts from the preface: GOAWAY after {:?}",
        t0.elapsed()
    );
    let service = bed.metrics();
    assert_eq!(
        rotations(&service, RotationReason::MaxAge),
        1,
        "rotated for its max age"
    );
    assert_eq!(
        service.client_errors.iter().sum::<u64>(),
        0,
        "the client did nothing wrong"
    );
    drop(c);
    bed.stop().await;
}

/// Reads frames from `c` until a GOAWAY comes; its error code, and the kinds before it. Each
/// PING gets its ACK, as a client's stack answers (`ack_pings`).
async fn until_go_away(c: &mut TcpStream, ack_pings: bool) -> (ErrorCode, Vec<Kind>) {
    let mut kinds = Vec::new();
    loop {
        let mut header = [0u8; HEADER_LEN];
        tokio::time::timeout(Duration::from_secs(24 * 3600), c.read_exact(&mut header))
            .await
            .expect("the balancer never sends a GOAWAY")
            .unwrap_or_else(|e| panic!("closed without a GOAWAY after {kinds:?}: {e}"));
        let head = Head::decode(&header);
        let mut payload = vec![0u8; head.len as usize];
        c.read_exact(&mut payload).await.expect("the payload");
        if head.kind == Kind::GoAway {
            let g = GoAway::decode(&head, &payload).expect("a GOAWAY");
            return (g.error_code, kinds);
        }
        if ack_pings && head.kind == Kind::Ping && !head.is_ack() {
            c.write_all(&frame(Kind::Ping, flags::ACK, 0, &payload))
                .await
                .expect("PING ACK");
        }
        kinds.push(head.kind);
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_idle_connection_gets_a_goaway_after_the_idle_timeout_and_keepalive_pings_keep_it() {
    // Paused time: ten minutes of idleness cost nothing. Two clients send their preface: one
    // then nothing (GOAWAY(NO_ERROR) between the idle timeout and an eighth of it later), one
    // a keepalive PING every 4 minutes for 30 minutes (kept all along), then nothing.
    for mode in [Mode::Request, Mode::Connection, Mode::Codec] {
        let bed = Bed::mode(mode).await;
        let idle = skewless_balancer::config::DEFAULT_IDLE_TIMEOUT;
        let t0 = tokio::time::Instant::now();
        let mut quiet = TcpStream::connect(bed.addr).await.expect("connects");
        quiet.write_all(&hello()).await.expect("preface");
        let mut pinging = TcpStream::connect(bed.addr).await.expect("connects");
        pinging.write_all(&hello()).await.expect("preface");
        // The pinging client: a PING every 4 minutes for 30 minutes, what comes back read.
        let (mut rd, mut wr) = pinging.into_split();
        let reader = tokio::spawn(async move {
            let mut header = [0u8; HEADER_LEN];
            loop {
                if rd.read_exact(&mut header).await.is_err() {
                    return None;
                }
                let head = Head::decode(&header);
                let mut payload = vec![0u8; head.len as usize];
                if rd.read_exact(&mut payload).await.is_err() {
                    return None;
                }
                if head.kind == Kind::GoAway {
                    return Some(tokio::time::Instant::now());
                }
            }
        });
        let pinger = tokio::spawn(async move {
            let mut last = tokio::time::Instant::now();
            while tokio::time::Instant::now() < t0 + Duration::from_secs(30 * 60) {
                wr.write_all(&ping()).await.expect("keepalive PING");
                last = tokio::time::Instant::now();
                tokio::time::sleep(Duration::from_secs(4 * 60)).await;
            }
            (last, wr)
        });
        let (code, _) = until_go_away(&mut quiet, false).await;
        let waited = t0.elapsed();
        assert_eq!(code, ErrorCode::NO_ERROR, "{mode:?}: a graceful GOAWAY");
        assert!(
            waited >= idle && waited <= idle + idle / 8 + Duration::from_secs(1),
            "{mode:?}: GOAWAY at the idle timeout ({idle:?}), within an eighth of it: {waited:?}"
        );
        assert_eq!(
            rotations(&bed.metrics(), RotationReason::Idle),
            1,
            "{mode:?}: counted as an idle rotation, and the pinging client kept"
        );
        let (last_ping, wr) = pinger.await.expect("pinger");
        let go_away_at = tokio::time::timeout(Duration::from_secs(3600), reader)
            .await
            .expect("the pinging client is wound down once it stops")
            .expect("reader")
            .expect("with a GOAWAY");
        assert!(
            go_away_at >= last_ping + idle,
            "{mode:?}: kept while it pinged, wound down an idle timeout after its last PING: \
             {:?} after it",
            go_away_at - last_ping
        );
        assert_eq!(
            rotations(&bed.metrics(), RotationReason::Idle),
            2,
            "{mode:?}"
        );
        drop((quiet, wr));
        bed.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_are_closed_at_once_and_counted_and_served_ones_lose_nothing() {
    // A cap of 50: a good client and 49 connections that sent their preface hold it; the next
    // connection is closed at once, counted, and the good client keeps calling. One holder
    // leaves: a new connection is served again.
    for mode in [Mode::Request, Mode::Connection] {
        let bed = Bed::serving(
            mode,
            Config {
                max_client_connections: 50,
                ..Config::default()
            },
            ConnectionConfig {
                max_client_connections: 50,
                ..ConnectionConfig::default()
            },
        )
        .await;
        let stop = Arc::new(AtomicBool::new(false));
        let good = good_client(bed.addr, stop.clone());
        let mut holders = Vec::new();
        for _ in 0..49 {
            let mut c = TcpStream::connect(bed.addr).await.expect("connects");
            c.write_all(&hello()).await.expect("preface");
            holders.push(c);
        }
        let open = |bed: &Bed| bed.metrics().client_connections;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while open(&bed) < 50 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(open(&bed), 50, "{mode:?}: the cap is reached");
        let t0 = tokio::time::Instant::now();
        let mut extra = TcpStream::connect(bed.addr)
            .await
            .expect("the TCP connect succeeds");
        extra.write_all(&hello()).await.expect("preface");
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), extra.read_to_end(&mut got))
            .await
            .expect("the connection past the cap is closed");
        assert!(
            got.is_empty() && t0.elapsed() < Duration::from_secs(2),
            "{mode:?}: closed at once, nothing spoken: {} bytes after {:?}",
            got.len(),
            t0.elapsed()
        );
        assert_eq!(
            bed.client_errors(ClientErrorReason::ConnectionLimit),
            1,
            "{mode:?}: counted"
        );
        drop(holders.pop());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while open(&bed) >= 50 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut again = TcpStream::connect(bed.addr).await.expect("connects");
        again.write_all(&hello()).await.expect("preface");
        let mut header = [0u8; HEADER_LEN];
        tokio::time::timeout(Duration::from_secs(5), again.read_exact(&mut header))
            .await
            .expect("served again below the cap")
            .expect("the server's first frame");
        assert_eq!(Head::decode(&header).kind, Kind::Settings, "{mode:?}");
        stop.store(true, Ordering::Relaxed);
        let (calls, failed) = good.await.expect("good client");
        assert!(
            failed.is_empty(),
            "{mode:?}: {} of {calls} calls failed",
            failed.len()
        );
        drop((holders, again));
        bed.stop().await;
    }
}
