//! Connection mode's relay against frame-level fake peers (h2's test style: every frame on
//! the wire checked), real h2 peers and a real tonic client. In-memory pipes and paused time
//! where the timeouts matter; loopback TCP for tonic.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use skewless_balancer::metrics::{FailureReason, LATENCY_BOUNDS, RotationReason, ServiceMetrics};
use skewless_balancer::relay::{
    Flood, ProtocolError, RelayEnd, RelayError, RelayHandle, RelaySettings, relay,
};
use skewless_frame::{
    ErrorCode, FrameError, Frames, GoAway, Head, Kind, MAX_MAX_FRAME_SIZE, MAX_STREAM_ID, PREFACE,
    Ping, RstStream, Settings, WindowUpdate, flags,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream, duplex};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Long enough never to fire in a passing test; under paused time it fires only when
/// everything is idle, that is when the relay is stuck.
const STUCK: Duration = Duration::from_secs(3600);

fn frame(kind: Kind, fl: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).expect("small");
    let mut f = Head::new(kind, fl, stream, len).encode().to_vec();
    f.extend_from_slice(payload);
    f
}

fn ping(ack: bool, opaque: [u8; 8]) -> Vec<u8> {
    let mut f = Vec::new();
    Ping { ack, opaque }.encode(&mut f);
    f
}

fn go_away(last: u32) -> Vec<u8> {
    let mut f = Vec::new();
    GoAway {
        last_stream_id: last,
        error_code: ErrorCode::NO_ERROR,
        debug_data: b"",
    }
    .encode(&mut f);
    f
}

/// HEADERS with an opaque (never decoded) header block.
fn headers(stream: u32, fl: u8) -> Vec<u8> {
    frame(Kind::Headers, fl, stream, &[0x82, 0x86, 0x84])
}

/// `bytes` for a failure message: the length, and the first and last `EDGE` bytes in hex (a
/// peer's buffer holds up to a megabyte; printed whole it buries the failure).
fn excerpt(bytes: &[u8]) -> String {
    const EDGE: usize = 256;
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    if bytes.len() <= 2 * EDGE {
        return format!("{} bytes: {}", bytes.len(), hex(bytes));
    }
    format!(
        "{} bytes: {} .. {}",
        bytes.len(),
        hex(&bytes[..EDGE]),
        hex(&bytes[bytes.len() - EDGE..])
    )
}

/// One side of the relay, spoken to frame by frame.
struct Peer {
    io: DuplexStream,
    buf: BytesMut,
}

impl Peer {
    async fn send(&mut self, bytes: &[u8]) {
        self.io.write_all(bytes).await.expect("write to the relay");
    }

    /// The next frame, or `None` at EOF.
    async fn next(&mut self) -> Option<(Head, Vec<u8>)> {
        loop {
            if let Some(Ok((head, payload))) = Frames::new(&self.buf, MAX_MAX_FRAME_SIZE).next() {
                let payload = payload.to_vec();
                let _ = self.buf.split_to(head.frame_len());
                return Some((head, payload));
            }
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout(STUCK, self.io.read(&mut chunk))
                .await
                .expect("the relay is stuck")
                .expect("read");
            if n == 0 {
                assert!(
                    self.buf.is_empty(),
                    "EOF inside a frame: {}",
                    excerpt(&self.buf)
                );
                return None;
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    async fn expect(&mut self, kind: Kind) -> (Head, Vec<u8>) {
        let f = self
            .next()
            .await
            .unwrap_or_else(|| panic!("EOF, expected {kind:?}"));
        assert_eq!(f.0.kind, kind, "expected {kind:?}, got {:?}", f.0);
        f
    }

    async fn expect_go_away(&mut self) -> u32 {
        let (head, payload) = self.expect(Kind::GoAway).await;
        let g = GoAway::decode(&head, &payload).expect("GOAWAY");
        assert_eq!(g.error_code, ErrorCode::NO_ERROR);
        g.last_stream_id
    }

    async fn expect_ping(&mut self) -> Ping {
        let (head, payload) = self.expect(Kind::Ping).await;
        Ping::decode(&head, &payload).expect("PING")
    }

    async fn expect_rst(&mut self) -> RstStream {
        let (head, payload) = self.expect(Kind::RstStream).await;
        RstStream::decode(&head, &payload).expect("RST_STREAM")
    }

    async fn expect_eof(&mut self) {
        if let Some(f) = self.next().await {
            panic!("expected EOF, got {f:?}");
        }
    }

    /// Nothing arrives for a while (under paused time: until everything is idle).
    async fn expect_silence(&mut self) {
        let mut byte = [0u8; 1];
        let got = tokio::time::timeout(Duration::from_millis(50), self.io.read(&mut byte)).await;
        assert!(got.is_err(), "expected nothing, got {got:?}");
    }
}

struct Bed {
    client: Peer,
    backend: Peer,
    handle: RelayHandle,
    task: JoinHandle<Result<RelayEnd, RelayError>>,
}

impl Bed {
    /// The rotation's epilogue: both peers get FIN, and the relay task ends cleanly.
    async fn ends_cleanly(&mut self) -> RelayEnd {
        self.client.expect_eof().await;
        self.backend.expect_eof().await;
        (&mut self.task).await.expect("task").expect("clean end")
    }
}

fn bed(settings: RelaySettings) -> Bed {
    bed_with(settings, RelayHandle::new())
}

fn bed_with(settings: RelaySettings, handle: RelayHandle) -> Bed {
    let (client, client_relay) = duplex(1 << 20);
    let (backend, backend_relay) = duplex(1 << 20);
    let h = handle.clone();
    let task = tokio::spawn(async move { relay(client_relay, backend_relay, &settings, h).await });
    Bed {
        client: Peer {
            io: client,
            buf: BytesMut::new(),
        },
        backend: Peer {
            io: backend,
            buf: BytesMut::new(),
        },
        handle,
        task,
    }
}

fn empty_settings() -> Vec<u8> {
    let mut f = Vec::new();
    Settings::encode(false, &[], &mut f);
    f
}

fn settings_ack() -> Vec<u8> {
    let mut f = Vec::new();
    Settings::encode(true, &[], &mut f);
    f
}

/// Preface and SETTINGS both ways, then stream 1 opened with a request DATA frame.
async fn open_bed(settings: RelaySettings) -> Bed {
    open_bed_with(settings, RelayHandle::new()).await
}

/// The client's preface and SETTINGS, checked at the backend.
async fn client_hello(b: &mut Bed) {
    let mut hello = PREFACE.to_vec();
    hello.extend(empty_settings());
    b.client.send(&hello).await;
    let mut preface = [0u8; 24];
    b.backend
        .io
        .read_exact(&mut preface)
        .await
        .expect("preface");
    assert_eq!(&preface, PREFACE, "the preface is forwarded as it is");
    b.backend.expect(Kind::Settings).await;
}

async fn open_bed_with(settings: RelaySettings, handle: RelayHandle) -> Bed {
    let mut b = bed_with(settings, handle);
    client_hello(&mut b).await;
    b.backend.send(&empty_settings()).await;
    b.client.expect(Kind::Settings).await;
    b.client.send(&settings_ack()).await;
    let (ack, _) = b.backend.expect(Kind::Settings).await;
    assert!(
        ack.has(flags::ACK),
        "the client's SETTINGS ACK is forwarded"
    );
    let mut req = headers(1, flags::END_HEADERS);
    req.extend(frame(Kind::Data, flags::END_STREAM, 1, b"ping"));
    b.client.send(&req).await;
    b.backend.expect(Kind::Headers).await;
    b.backend.expect(Kind::Data).await;
    assert_eq!(b.handle.stats().requests(), 1);
    assert_eq!(b.handle.stats().open_streams(), 1);
    b
}

/// [`open_bed`] whose relay records into a Service's cells, returned with it.
async fn open_metered_bed(settings: RelaySettings) -> (Bed, Arc<ServiceMetrics>) {
    let metrics = Arc::new(ServiceMetrics::default());
    let b = open_bed_with(settings, RelayHandle::with_metrics(metrics.clone())).await;
    (b, metrics)
}

/// The backend answers stream `id`: headers, a message, trailers.
fn response(id: u32) -> Vec<u8> {
    let mut r = headers(id, flags::END_HEADERS);
    r.extend(frame(Kind::Data, 0, id, b"pong"));
    r.extend(headers(id, flags::END_HEADERS | flags::END_STREAM));
    r
}

async fn expect_response(peer: &mut Peer, id: u32) {
    for kind in [Kind::Headers, Kind::Data, Kind::Headers] {
        let (head, _) = peer.expect(kind).await;
        assert_eq!(head.stream_id, id);
    }
}

/// The opaque data of the relay's second PING (the quiet check before the final GOAWAY).
const QUIET_PING: [u8; 8] = *b"skwl\x00fin";

/// The client's side of the settling phase, written as grpc-core writes (its `writing.cc`):
/// a write that carries a PING ACK carries nothing of any stream, so `queued` (the frames of
/// streams it created before it read the first GOAWAY and has not written yet) goes out only
/// in a write without one, here the one that acknowledges the relay's SETTINGS. Answers the
/// relay until the final GOAWAY and returns its last-stream-id. Any other frame (a
/// RST_STREAM) fails the test.
async fn settle_as_grpc_core(client: &mut Peer, mut queued: Vec<u8>) -> u32 {
    loop {
        let (head, payload) = client.next().await.expect("EOF before the final GOAWAY");
        match head.kind {
            Kind::Ping => {
                let p = Ping::decode(&head, &payload).expect("PING");
                assert_eq!((p.ack, p.opaque), (false, QUIET_PING), "the quiet PING");
                client.send(&ping(true, p.opaque)).await;
            }
            Kind::Settings => {
                assert!(
                    !head.has(flags::ACK) && head.len == 0,
                    "the relay's SETTINGS is empty: {head:?}"
                );
                let mut write = settings_ack();
                write.extend(std::mem::take(&mut queued));
                client.send(&write).await;
            }
            Kind::GoAway => {
                let g = GoAway::decode(&head, &payload).expect("GOAWAY");
                assert_eq!(g.error_code, ErrorCode::NO_ERROR);
                return g.last_stream_id;
            }
            _ => panic!("expected SETTINGS, the quiet PING or the final GOAWAY, got {head:?}"),
        }
    }
}

/// [`settle_as_grpc_core`] for a client with nothing queued.
async fn settle_until_the_final_go_away(client: &mut Peer) -> u32 {
    settle_as_grpc_core(client, Vec::new()).await
}

/// Starts a rotation and answers its first step: GOAWAY(2^31-1), our PING, its ACK.
async fn rotate_and_ack(b: &mut Bed, reason: RotationReason) {
    b.handle.rotate(reason);
    assert_eq!(b.client.expect_go_away().await, MAX_STREAM_ID);
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
}

/// The backend answers streams 1 and 3; both reach the client, then FIN both ways (the
/// backend got nothing more: no GOAWAY, none of our ACKs) and the rotation's end.
async fn finish_1_and_3(mut b: Bed, reason: RotationReason) {
    b.backend.send(&response(1)).await;
    b.backend.send(&response(3)).await;
    expect_response(&mut b.client, 1).await;
    expect_response(&mut b.client, 3).await;
    let end = b.ends_cleanly().await;
    assert_eq!(end, RelayEnd::Rotated(reason));
}

/// Stream 3's request, created by the client before it read the first GOAWAY.
fn stream_3() -> Vec<u8> {
    let mut req = headers(3, flags::END_HEADERS);
    req.extend(frame(
        Kind::Data,
        flags::END_STREAM,
        3,
        b"created before the GOAWAY",
    ));
    req
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn rotation_is_goaway_max_and_ping_then_settings_and_a_quiet_ping_then_the_final_goaway_then_fin()
 {
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::Skew);
    assert_eq!(
        b.client.expect_go_away().await,
        MAX_STREAM_ID,
        "first GOAWAY refuses nothing"
    );
    let ours = b.client.expect_ping().await;
    assert!(!ours.ack);
    assert_eq!(b.handle.stats().rotating(), Some(RotationReason::Skew));
    b.client.send(&ping(true, ours.opaque)).await;
    // Stream 1 is ended by the client: it has nothing left to send, so the relay checks that
    // nothing it created is still unwritten: an empty SETTINGS (its ACK comes in a write that
    // also carries every queued stream), then, on the ACK, a PING (its ACK comes in a later
    // write), then the final GOAWAY.
    let (head, _) = b.client.expect(Kind::Settings).await;
    assert!(!head.has(flags::ACK) && head.len == 0, "an empty SETTINGS");
    b.client.send(&settings_ack()).await;
    let quiet = b.client.expect_ping().await;
    assert_eq!((quiet.ack, quiet.opaque), (false, QUIET_PING));
    b.client.send(&ping(true, quiet.opaque)).await;
    assert_eq!(
        b.client.expect_go_away().await,
        1,
        "final GOAWAY: the highest stream opened"
    );
    // The stream opened before the final GOAWAY finishes at the backend.
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    b.client.expect_eof().await;
    // The backend saw no GOAWAY, not our PING's ACK and not our SETTINGS' ACK: nothing after
    // the request, then FIN.
    b.backend.expect_eof().await;
    assert_eq!(b.handle.stats().open_streams(), 0);
    let end = b.task.await.expect("task").expect("clean end");
    assert_eq!(end, RelayEnd::Rotated(RotationReason::Skew));
}

/// Issue 13's wire sequence with a stream opened between the two GOAWAYs: GOAWAY(2^31-1) and
/// the relay's own PING come first, in that order; a stream the client opens before it ACKs
/// is relayed like any other, the final GOAWAY (after the quiet PINGs) names it, both streams
/// finish at the backend;
/// the backend sees neither a GOAWAY nor the ACK; the relay ends with FIN once both are done.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stream_opened_between_the_goaways_is_relayed_named_by_the_final_one_and_finished() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::Skew);
    assert_eq!(b.client.expect_go_away().await, MAX_STREAM_ID);
    let ours = b.client.expect_ping().await;
    assert_eq!(
        ours,
        Ping {
            ack: false,
            opaque: *b"skwl\x00rot"
        },
        "the PING right after the first GOAWAY is ours, with opaque data no gRPC server uses"
    );
    // GOAWAY(2^31-1) refuses nothing: the client may still open stream 3 before it ACKs.
    let mut req = headers(3, flags::END_HEADERS);
    req.extend(frame(Kind::Data, flags::END_STREAM, 3, b"late"));
    b.client.send(&req).await;
    let (h, _) = b.backend.expect(Kind::Headers).await;
    assert_eq!(h.stream_id, 3, "relayed to the backend as usual");
    b.backend.expect(Kind::Data).await;
    assert_eq!(b.handle.stats().requests(), 2);
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(
        settle_until_the_final_go_away(&mut b.client).await,
        3,
        "the final GOAWAY names the highest stream the client opened"
    );
    assert_eq!(b.handle.stats().refused(), 0, "nothing was refused");
    // Both streams finish at the backend, in any order, while the connection stays up.
    b.backend.send(&response(3)).await;
    expect_response(&mut b.client, 3).await;
    b.client.expect_silence().await;
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    // Then FIN both ways; the backend never got anything after the two requests (no GOAWAY,
    // not our PING's ACK).
    let end = b.ends_cleanly().await;
    assert_eq!(end, RelayEnd::Rotated(RotationReason::Skew));
}

/// The opaque data of the relay's quiesce PING (a lazy client's rotation starts with it).
const QUIESCE_PING: [u8; 8] = *b"skwl\x00qui";

/// A header block as grpc-js's first request carries it, HPACK-encoded with literals only (no
/// dynamic table): `:method POST`, `:scheme http`, `:path`, `:authority` and grpc-js's
/// `user-agent`, the one the relay looks for.
fn grpc_js_request_block() -> Vec<u8> {
    let mut block = vec![0x83, 0x86];
    for (prefix, value) in [
        (&[0x04][..], &b"/skewless.echo.v1.Echo/Echo"[..]),
        (&[0x01][..], &b"echo"[..]),
        (&[0x0f, 0x2b][..], &b"grpc-node-js/1.14.7"[..]),
    ] {
        block.extend_from_slice(prefix);
        block.push(u8::try_from(value.len()).expect("short"));
        block.extend_from_slice(value);
    }
    block
}

/// [`open_bed`] for a grpc-js client: its first request carries grpc-js's user-agent, and the
/// relay has recognised it as one that writes its requests lazily.
async fn open_grpc_js_bed(settings: RelaySettings) -> Bed {
    let mut b = bed_with(settings, RelayHandle::new());
    client_hello(&mut b).await;
    b.backend.send(&empty_settings()).await;
    b.client.expect(Kind::Settings).await;
    b.client.send(&settings_ack()).await;
    b.backend.expect(Kind::Settings).await;
    let mut req = frame(
        Kind::Headers,
        flags::END_HEADERS,
        1,
        &grpc_js_request_block(),
    );
    req.extend(frame(Kind::Data, flags::END_STREAM, 1, b"ping"));
    b.client.send(&req).await;
    b.backend.expect(Kind::Headers).await;
    b.backend.expect(Kind::Data).await;
    while !b.handle.stats().user_agent_known() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        b.handle.stats().lazy_requests(),
        "grpc-js's user-agent is recognised"
    );
    assert!(!b.handle.stats().unrotatable());
    b
}

/// nghttp2 (under grpc-js) writes a request's HEADERS only at its next send and refuses every
/// request not yet written once it has read any GOAWAY: a call started in reaction to a
/// response read just before GOAWAY(2^31-1) fails unless it fits grpc-js's retry buffer. So a
/// grpc-js rotation starts with a quiesce: the relay's own PING, and nothing of the backend's
/// until its ACK (which Node writes in the same send as the HEADERS it queued meanwhile);
/// then GOAWAY(2^31-1) and our PING go first, ahead of every frame held.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_grpc_js_rotation_holds_the_backends_frames_behind_a_ping_until_its_ack() {
    let mut b = open_grpc_js_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::MaxAge);
    let hold = b.client.expect_ping().await;
    assert_eq!(
        (hold.ack, hold.opaque),
        (false, QUIESCE_PING),
        "a grpc-js rotation starts with the quiesce PING, no GOAWAY yet"
    );
    assert_eq!(b.handle.stats().rotating(), Some(RotationReason::MaxAge));
    // The backend answers stream 1: held until the ACK, so it cannot start another call.
    b.backend.send(&response(1)).await;
    b.client.expect_silence().await;
    // The client's next send: the ACK first, then the request it had queued (stream 3).
    let mut write = ping(true, QUIESCE_PING);
    write.extend(headers(3, flags::END_HEADERS));
    write.extend(frame(Kind::Data, flags::END_STREAM, 3, b"queued"));
    b.client.send(&write).await;
    let (h, _) = b.backend.expect(Kind::Headers).await;
    assert_eq!(h.stream_id, 3, "the ACK is swallowed, stream 3 relayed");
    b.backend.expect(Kind::Data).await;
    assert_eq!(
        b.client.expect_go_away().await,
        MAX_STREAM_ID,
        "on the ACK: GOAWAY(2^31-1) before anything held"
    );
    let ours = b.client.expect_ping().await;
    assert_eq!((ours.ack, ours.opaque), (false, *b"skwl\x00rot"));
    expect_response(&mut b.client, 1).await;
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 3);
    b.backend.send(&response(3)).await;
    expect_response(&mut b.client, 3).await;
    b.client.expect_eof().await;
    b.backend.expect_eof().await;
    assert_eq!(b.handle.stats().refused(), 0);
    let end = b.task.await.expect("task").expect("clean end");
    assert_eq!(end, RelayEnd::Rotated(RotationReason::MaxAge));
}

/// A client whose user-agent is not known yet (here: no request so far) may be a lazy one:
/// its rotation starts with the quiesce too.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_client_whose_user_agent_is_not_known_is_quiesced_too() {
    let mut b = bed(RelaySettings::default());
    client_hello(&mut b).await;
    b.backend.send(&empty_settings()).await;
    b.client.expect(Kind::Settings).await;
    assert!(!b.handle.stats().user_agent_known());
    b.handle.rotate(RotationReason::Drain);
    assert_eq!(b.client.expect_ping().await.opaque, QUIESCE_PING);
    b.client.send(&ping(true, QUIESCE_PING)).await;
    assert_eq!(b.client.expect_go_away().await, MAX_STREAM_ID);
    assert_eq!(b.client.expect_ping().await.opaque, *b"skwl\x00rot");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_quiesce_without_an_ack_ends_after_a_second_with_the_first_goaway() {
    let mut b = open_grpc_js_bed(RelaySettings::default()).await;
    let started = Instant::now();
    b.handle.rotate(RotationReason::Skew);
    assert_eq!(b.client.expect_ping().await.opaque, QUIESCE_PING);
    b.backend.send(&response(1)).await;
    // The client never answers: after the quiesce timeout the rotation goes on as for any client.
    assert_eq!(b.client.expect_go_away().await, MAX_STREAM_ID);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_millis(1100),
        "the quiesce ends at its timeout: {waited:?}"
    );
    let ours = b.client.expect_ping().await;
    assert_eq!(ours.opaque, *b"skwl\x00rot");
    expect_response(&mut b.client, 1).await;
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    let end = b.ends_cleanly().await;
    assert_eq!(end, RelayEnd::Rotated(RotationReason::Skew));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stream_the_client_writes_after_its_ping_ack_is_relayed_and_under_the_final_goaway() {
    // grpc-core writes a PING ACK ahead of the streams queued in the same write: a stream it
    // created before it read GOAWAY(2^31-1) can reach the relay after the ACK, in a later
    // read. The final GOAWAY must not be below it (the client would fail or retry a call it
    // had sent: grpc-core fails one larger than its 256 KiB retry buffer).
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::MaxAge);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
    // The relay acts on the ACK before the rest of the client's write arrives.
    tokio::time::sleep(Duration::from_millis(1)).await;
    let mut late = headers(3, flags::END_HEADERS);
    late.extend(frame(
        Kind::Data,
        flags::END_STREAM,
        3,
        b"sent before the GOAWAY",
    ));
    b.client.send(&late).await;
    let (h, _) = b.backend.expect(Kind::Headers).await;
    assert_eq!(h.stream_id, 3);
    let (d, _) = b.backend.expect(Kind::Data).await;
    assert_eq!(
        d.stream_id, 3,
        "stream 3 is relayed to the backend, not cancelled"
    );
    assert_eq!(
        settle_until_the_final_go_away(&mut b.client).await,
        3,
        "the final GOAWAY covers every stream the client sent"
    );
    assert_eq!(b.handle.stats().refused(), 0);
    assert_eq!(b.handle.stats().requests(), 2);
    b.backend.send(&response(1)).await;
    b.backend.send(&response(3)).await;
    expect_response(&mut b.client, 1).await;
    expect_response(&mut b.client, 3).await;
    let end = b.ends_cleanly().await;
    assert_eq!(end, RelayEnd::Rotated(RotationReason::MaxAge));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stream_the_client_writes_after_the_settings_ack_is_still_under_the_final_goaway() {
    // A stream that comes between the SETTINGS ACK and the quiet PING's ACK (a client that
    // writes them apart): the check starts over and the final GOAWAY covers it.
    let mut b = open_bed(RelaySettings::default()).await;
    rotate_and_ack(&mut b, RotationReason::MaxAge).await;
    b.client.expect(Kind::Settings).await;
    b.client.send(&settings_ack()).await;
    let quiet = b.client.expect_ping().await;
    assert_eq!(quiet.opaque, QUIET_PING);
    b.client.send(&stream_3()).await;
    b.backend.expect(Kind::Headers).await;
    let (d, _) = b.backend.expect(Kind::Data).await;
    assert_eq!(
        d.stream_id, 3,
        "stream 3 is relayed to the backend, not cancelled"
    );
    b.client.send(&ping(true, quiet.opaque)).await;
    assert_eq!(
        settle_until_the_final_go_away(&mut b.client).await,
        3,
        "the final GOAWAY covers every stream the client sent"
    );
    assert_eq!(b.handle.stats().refused(), 0);
    finish_1_and_3(b, RotationReason::MaxAge).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stream_grpc_core_queues_behind_its_ping_acks_is_under_the_final_goaway() {
    // grpc-core writes a stream's frames only in a write with no PING ACK in it. Stream 3 was
    // created before the client read GOAWAY(2^31-1); the client answers every PING at once,
    // each ACK in a write of its own, so however many PINGs the relay sends, stream 3 stays
    // unwritten; only a write without an ACK (the SETTINGS ACK's) carries it. A final GOAWAY
    // before that names 1 and fails the call (a 4 MiB one, beyond the 256 KiB retry buffer).
    let mut b = open_bed(RelaySettings::default()).await;
    rotate_and_ack(&mut b, RotationReason::MaxAge).await;
    assert_eq!(
        settle_as_grpc_core(&mut b.client, stream_3()).await,
        3,
        "the final GOAWAY covers the stream the client had queued"
    );
    let (h, _) = b.backend.expect(Kind::Headers).await;
    assert_eq!(h.stream_id, 3, "stream 3 is relayed to the backend");
    b.backend.expect(Kind::Data).await;
    assert_eq!(b.handle.stats().refused(), 0);
    finish_1_and_3(b, RotationReason::MaxAge).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_settings_ack_written_with_a_ping_ack_proves_nothing_and_the_check_starts_over() {
    // The client reads the backend's PING and our SETTINGS before it writes: grpc-core puts
    // both ACKs in one write, cut to the ACKs, and stream 3 stays queued. That SETTINGS ACK
    // must not count: the relay asks again.
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::MaxAge);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.backend.send(&ping(false, *b"backend!")).await;
    assert_eq!(b.client.expect_ping().await.opaque, *b"backend!");
    b.client.send(&ping(true, ours.opaque)).await;
    b.client.expect(Kind::Settings).await;
    let mut write = ping(true, *b"backend!");
    write.extend(settings_ack());
    b.client.send(&write).await;
    let ack = b.backend.expect_ping().await;
    assert_eq!((ack.ack, ack.opaque), (true, *b"backend!"), "forwarded");
    assert_eq!(
        settle_as_grpc_core(&mut b.client, stream_3()).await,
        3,
        "the final GOAWAY covers the stream the client had queued"
    );
    assert_eq!(b.handle.stats().refused(), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_relays_settings_ack_is_swallowed_and_the_backends_are_forwarded_in_order() {
    // The backend sends SETTINGS mid-rotation, just before ours: the client acknowledges in
    // the order it read them. Its first ACK is the backend's (forwarded at once), the second
    // ours (swallowed: an unsolicited ACK is a connection error for the backend).
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::MaxAge);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.backend.send(&empty_settings()).await;
    let (head, _) = b.client.expect(Kind::Settings).await;
    assert!(!head.has(flags::ACK), "the backend's SETTINGS");
    b.client.send(&ping(true, ours.opaque)).await;
    let (head, _) = b.client.expect(Kind::Settings).await;
    assert!(!head.has(flags::ACK), "the relay's SETTINGS");
    b.client.send(&settings_ack()).await;
    let (ack, _) = b.backend.expect(Kind::Settings).await;
    assert!(
        ack.has(flags::ACK),
        "the first ACK answers the backend's SETTINGS"
    );
    b.client.expect_silence().await;
    b.client.send(&settings_ack()).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    b.client.expect_eof().await;
    b.backend.expect_eof().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_final_goaway_waits_for_the_client_to_end_its_streams_at_most_half_the_grace() {
    let settings = RelaySettings {
        drain_grace: Duration::from_secs(16),
        ..RelaySettings::default()
    };
    let mut b = open_bed(settings).await;
    // Stream 3: the client is still sending its request.
    b.client.send(&headers(3, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    let started = Instant::now();
    b.handle.rotate(RotationReason::Skew);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
    b.client.expect_silence().await;
    // The request ends: now the relay checks the client is quiet.
    b.client
        .send(&frame(Kind::Data, flags::END_STREAM, 3, b"end"))
        .await;
    b.backend.expect(Kind::Data).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 3);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "as soon as it is quiet"
    );

    // A client that never goes quiet (a request body that never ends).
    let mut b = open_bed(RelaySettings {
        drain_grace: Duration::from_secs(16),
        ..RelaySettings::default()
    })
    .await;
    b.client.send(&headers(3, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    let started = Instant::now();
    b.handle.rotate(RotationReason::Skew);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(b.client.expect_go_away().await, 3);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(8) && waited < Duration::from_secs(9),
        "the final GOAWAY comes halfway through the 16 s grace: {waited:?}"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn other_pings_and_acks_pass_through_both_ways_even_during_a_rotation() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.client.send(&ping(false, *b"keepaliv")).await;
    assert_eq!(b.backend.expect_ping().await.opaque, *b"keepaliv");
    b.backend.send(&ping(true, *b"keepaliv")).await;
    assert_eq!(
        b.client.expect_ping().await,
        Ping {
            ack: true,
            opaque: *b"keepaliv"
        }
    );
    b.backend.send(&ping(false, *b"servping")).await;
    assert_eq!(b.client.expect_ping().await.opaque, *b"servping");
    b.client.send(&ping(true, *b"servping")).await;
    assert!(b.backend.expect_ping().await.ack);

    b.handle.rotate(RotationReason::MaxAge);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    // A keepalive PING interleaved with the rotation, answered by the backend.
    b.client.send(&ping(false, *b"interlvd")).await;
    assert_eq!(b.backend.expect_ping().await.opaque, *b"interlvd");
    b.backend.send(&ping(true, *b"interlvd")).await;
    assert_eq!(b.client.expect_ping().await.opaque, *b"interlvd");
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    b.ends_cleanly().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn without_an_ack_the_final_goaway_follows_the_ping_timeout_at_most_half_the_grace() {
    // (PING timeout, drain grace, when the final GOAWAY comes). The defaults are 10 s and
    // 10 s: the final GOAWAY must not wait for the grace to end (the client's streams would
    // only get its resets), it comes at half the grace, and a stream that finishes after it
    // finishes normally.
    for (ping_timeout, grace, at) in [(7, 30, 7), (10, 10, 5)] {
        let settings = RelaySettings {
            ping_timeout: Duration::from_secs(ping_timeout),
            drain_grace: Duration::from_secs(grace),
            ..RelaySettings::default()
        };
        let mut b = open_bed(settings).await;
        let started = Instant::now();
        b.handle.rotate(RotationReason::Skew);
        b.client.expect_go_away().await;
        b.client.expect_ping().await;
        // The client never answers.
        assert_eq!(b.client.expect_go_away().await, 1);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(at) && waited < Duration::from_secs(at + 1),
            "PING timeout {ping_timeout} s, grace {grace} s: the final GOAWAY comes at \
             {at} s, not {waited:?}"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        b.backend.send(&response(1)).await;
        expect_response(&mut b.client, 1).await;
        let end = b.ends_cleanly().await;
        assert_eq!(
            end,
            RelayEnd::Rotated(RotationReason::Skew),
            "the stream finished, nothing was reset"
        );
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn streams_opened_after_the_final_goaway_are_refused_keeping_hpack_and_windows_in_step() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::Skew);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    // A client that ignores the GOAWAY: a new stream with a 100-byte body.
    let mut late = headers(3, flags::END_HEADERS);
    late.extend(frame(Kind::Data, flags::END_STREAM, 3, &[7; 100]));
    b.client.send(&late).await;
    // The backend's HPACK decoder sees the HEADERS, then the stream is cancelled; the DATA
    // never reaches it.
    let (h, _) = b.backend.expect(Kind::Headers).await;
    assert_eq!(h.stream_id, 3);
    let rst = b.backend.expect_rst().await;
    assert_eq!((rst.stream_id, rst.error_code), (3, ErrorCode::CANCEL));
    // The client learns the stream was not processed, and gets its window back.
    let rst = b.client.expect_rst().await;
    assert_eq!(
        (rst.stream_id, rst.error_code),
        (3, ErrorCode::REFUSED_STREAM)
    );
    let (head, payload) = b.client.expect(Kind::WindowUpdate).await;
    let wu = WindowUpdate::decode(&head, &payload).expect("WINDOW_UPDATE");
    assert_eq!(
        (wu.stream_id, wu.increment),
        (0, 100),
        "the dropped DATA is credited back"
    );
    assert_eq!(b.handle.stats().refused(), 1);
    assert_eq!(
        b.handle.stats().requests(),
        1,
        "a refused stream is no request"
    );
    // The backend's answer to the refused stream: headers pass (HPACK), DATA is dropped and
    // credited back to the backend.
    let mut answer = headers(3, flags::END_HEADERS);
    answer.extend(frame(Kind::Data, 0, 3, &[1; 40]));
    b.backend.send(&answer).await;
    b.client.expect(Kind::Headers).await;
    let (head, payload) = b.backend.expect(Kind::WindowUpdate).await;
    let wu = WindowUpdate::decode(&head, &payload).expect("WINDOW_UPDATE");
    assert_eq!((wu.stream_id, wu.increment), (0, 40));
    // The stream opened before the GOAWAY still finishes, then the connection ends.
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    b.ends_cleanly().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn backend_goaways_are_forwarded_and_no_goaway_to_the_client_ever_raises_the_last_id() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::Skew);
    assert_eq!(b.client.expect_go_away().await, MAX_STREAM_ID);
    let ours = b.client.expect_ping().await;
    // The backend's own max connection age, mid-rotation.
    b.backend.send(&go_away(1)).await;
    assert_eq!(b.client.expect_go_away().await, 1, "forwarded");
    assert!(b.handle.stats().backend_go_away());
    b.client.send(&ping(true, ours.opaque)).await;
    // Our final GOAWAY would say 1 again: not sent. A later backend GOAWAY(2^31-1) would
    // raise it: forwarded with the lower id.
    b.backend.send(&go_away(MAX_STREAM_ID)).await;
    assert_eq!(
        b.client.expect_go_away().await,
        1,
        "lowered to what was already sent"
    );
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    b.ends_cleanly().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn nothing_is_injected_inside_a_header_block() {
    let mut b = open_bed(RelaySettings::default()).await;
    // Response headers split over HEADERS and CONTINUATION.
    b.backend.send(&headers(1, 0)).await;
    b.client.expect(Kind::Headers).await;
    b.handle.rotate(RotationReason::Skew);
    b.client.expect_silence().await;
    b.backend
        .send(&frame(Kind::Continuation, flags::END_HEADERS, 1, &[0x88]))
        .await;
    b.client.expect(Kind::Continuation).await;
    assert_eq!(
        b.client.expect_go_away().await,
        MAX_STREAM_ID,
        "only after the block"
    );
    b.client.expect_ping().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn at_the_end_of_the_drain_grace_open_streams_are_reset_both_ways_then_fin() {
    let settings = RelaySettings {
        drain_grace: Duration::from_secs(12),
        ..RelaySettings::default()
    };
    let (mut b, metrics) = open_metered_bed(settings).await;
    let started = Instant::now();
    b.handle.rotate(RotationReason::Drain);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    // The backend never answers stream 1.
    let rst = b.client.expect_rst().await;
    assert_eq!((rst.stream_id, rst.error_code), (1, ErrorCode::CANCEL));
    assert!(
        started.elapsed() >= Duration::from_secs(12),
        "not before the grace"
    );
    let rst = b.backend.expect_rst().await;
    assert_eq!((rst.stream_id, rst.error_code), (1, ErrorCode::CANCEL));
    let end = b.ends_cleanly().await;
    assert_eq!(end, RelayEnd::GraceExpired { reset: 1 });
    let s = metrics.snapshot();
    assert_eq!(s.latency.count(), 1, "the cut stream is timed");
    assert_eq!(s.failures, [0, 0, 1, 0, 0], "and a failed call (reset)");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn end_stream_both_ways_and_resets_close_streams() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    assert_eq!(b.handle.stats().open_streams(), 0, "END_STREAM both ways");
    b.client.send(&headers(3, flags::END_HEADERS)).await;
    b.client.send(&headers(5, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    b.backend.expect(Kind::Headers).await;
    assert_eq!(
        (b.handle.stats().requests(), b.handle.stats().open_streams()),
        (3, 2)
    );
    let mut rst = Vec::new();
    RstStream {
        stream_id: 3,
        error_code: ErrorCode::CANCEL,
    }
    .encode(&mut rst);
    b.client.send(&rst).await;
    b.backend.expect_rst().await;
    assert_eq!(
        b.handle.stats().open_streams(),
        1,
        "a client reset closes the stream"
    );
    rst.clear();
    RstStream {
        stream_id: 5,
        error_code: ErrorCode::INTERNAL_ERROR,
    }
    .encode(&mut rst);
    b.backend.send(&rst).await;
    b.client.expect_rst().await;
    assert_eq!(
        b.handle.stats().open_streams(),
        0,
        "a backend reset closes the stream"
    );
    // A client that closes: FIN goes on to the backend, and back.
    b.client.io.shutdown().await.expect("shutdown");
    b.backend.expect_eof().await;
    b.backend.io.shutdown().await.expect("shutdown");
    b.client.expect_eof().await;
    assert_eq!(
        b.task.await.expect("task").expect("clean end"),
        RelayEnd::Closed
    );
}

async fn broken(bytes: &[u8]) -> RelayError {
    let mut b = bed(RelaySettings::default());
    b.client.send(bytes).await;
    let err = b
        .task
        .await
        .expect("task")
        .expect_err("the connection is refused");
    // Both sides are closed with FIN.
    let mut rest = Vec::new();
    b.backend
        .io
        .read_to_end(&mut rest)
        .await
        .expect("backend EOF");
    b.client
        .io
        .read_to_end(&mut rest)
        .await
        .expect("client EOF");
    err
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn malformed_frames_and_non_http2_clients_close_their_connection() {
    let err = broken(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::Frame(FrameError::BadPreface))
        ),
        "{err:?}"
    );
    assert!(err.is_client());

    let mut big = PREFACE.to_vec();
    big.extend(empty_settings());
    big.extend(Head::new(Kind::Data, 0, 1, 16_385).encode());
    let err = broken(&big).await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::Frame(FrameError::TooLarge { .. }))
        ),
        "a frame above the backend's advertised SETTINGS_MAX_FRAME_SIZE: {err:?}"
    );

    let mut bad_ping = PREFACE.to_vec();
    bad_ping.extend(frame(Kind::Ping, 0, 0, &[0; 3]));
    let err = broken(&bad_ping).await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::Frame(FrameError::BadLength { .. }))
        ),
        "{err:?}"
    );

    // A GOAWAY shorter than its 8 fixed bytes (found by the property test below: it used to
    // panic the relay's task).
    let mut short_go_away = PREFACE.to_vec();
    short_go_away.extend(frame(Kind::GoAway, 0, 0, &[0; 5]));
    let err = broken(&short_go_away).await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::Frame(FrameError::BadLength { .. }))
        ),
        "{err:?}"
    );

    let mut interleaved = PREFACE.to_vec();
    interleaved.extend(empty_settings());
    interleaved.extend(headers(1, 0));
    interleaved.extend(frame(Kind::Data, 0, 1, b"x"));
    let err = broken(&interleaved).await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::InsideHeaderBlock { .. })
        ),
        "{err:?}"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn frames_up_to_the_advertised_max_frame_size_pass() {
    let mut b = open_bed(RelaySettings::default()).await;
    // The backend allows 1 MiB frames: a 100 KB DATA frame (larger than the relay's buffer)
    // streams through.
    let mut s = Vec::new();
    Settings::encode(
        false,
        &[skewless_frame::Setting {
            id: skewless_frame::SettingId::MAX_FRAME_SIZE,
            value: 1 << 20,
        }],
        &mut s,
    );
    b.backend.send(&s).await;
    b.client.expect(Kind::Settings).await;
    b.client.send(&headers(3, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    let body: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
    let big = frame(Kind::Data, 0, 3, &body);
    let writer = async {
        b.client.send(&big).await;
    };
    let reader = async {
        let (head, payload) = b.backend.expect(Kind::Data).await;
        assert_eq!(head.len, 100_000);
        assert_eq!(payload, body, "the payload is forwarded byte for byte");
    };
    tokio::join!(writer, reader);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_peer_that_never_follows_a_close_is_dropped_after_the_drain_grace() {
    let settings = RelaySettings {
        drain_grace: Duration::from_secs(9),
        ..RelaySettings::default()
    };
    let mut b = open_bed(settings).await;
    let started = Instant::now();
    b.client.io.shutdown().await.expect("shutdown");
    b.backend.expect_eof().await;
    // The backend keeps its side open and never answers.
    let end = tokio::time::timeout(STUCK, b.task)
        .await
        .expect("the relay ends")
        .expect("task")
        .expect("clean end");
    assert_eq!(end, RelayEnd::Closed);
    assert!(
        started.elapsed() >= Duration::from_secs(9),
        "not before the grace"
    );
    b.client.expect_eof().await;
}

/// Runs the relay between two peers that send `client` (after the preface) and `backend`,
/// rotating after the first `rotate_after` client bytes when set, and reading everything the
/// relay sends; returns how it ended (`None`: with an error), within a bounded (paused) time.
fn run_hostile(client: &[u8], backend: &[u8], rotate_after: Option<usize>) -> Option<RelayEnd> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    rt.block_on(async {
        let b = bed(RelaySettings::default());
        let (c_read, mut c_write) = tokio::io::split(b.client.io);
        let (b_read, mut b_write) = tokio::io::split(b.backend.io);
        let handle = b.handle;
        let client_side = async {
            let _ = c_write.write_all(PREFACE).await;
            let cut = rotate_after.unwrap_or(client.len()).min(client.len());
            let _ = c_write.write_all(&client[..cut]).await;
            if rotate_after.is_some() {
                handle.rotate(RotationReason::Skew);
            }
            let _ = c_write.write_all(&client[cut..]).await;
            let _ = c_write.shutdown().await;
        };
        let backend_side = async {
            let _ = b_write.write_all(backend).await;
            let _ = b_write.shutdown().await;
        };
        let drain = |mut r: tokio::io::ReadHalf<DuplexStream>| async move {
            let mut sink = Vec::new();
            let _ = r.read_to_end(&mut sink).await;
        };
        let ((), (), (), (), end) = tokio::join!(
            client_side,
            backend_side,
            drain(c_read),
            drain(b_read),
            tokio::time::timeout(Duration::from_secs(120), b.task),
        );
        end.expect("the relay always ends")
            .expect("the relay never panics")
            .ok()
    })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    #[test]
    fn any_bytes_from_either_peer_end_the_relay_without_a_panic(
        client in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
        backend in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
        rotate_after in proptest::option::of(0usize..400),
    ) {
        let _ = run_hostile(&client, &backend, rotate_after);
    }

    #[test]
    fn any_frames_from_either_peer_end_the_relay_without_a_panic(
        client in proptest::collection::vec((0u8..12, proptest::prelude::any::<u8>(), 0u32..8, proptest::collection::vec(proptest::prelude::any::<u8>(), 0..24)), 0..24),
        backend in proptest::collection::vec((0u8..12, proptest::prelude::any::<u8>(), 0u32..8, proptest::collection::vec(proptest::prelude::any::<u8>(), 0..24)), 0..24),
        rotate_after in proptest::option::of(0usize..600),
    ) {
        // Valid framing, arbitrary types, flags, streams and payloads: the frame rules are
        // exercised, not only the framing check.
        let wire = |frames: &[(u8, u8, u32, Vec<u8>)]| -> Vec<u8> {
            let mut w = empty_settings();
            for (kind, fl, stream, payload) in frames {
                w.extend(frame(Kind::from(*kind), *fl, *stream, payload));
            }
            w
        };
        let _ = run_hostile(&wire(&client), &wire(&backend), rotate_after);
    }
}

fn rst(stream: u32, code: ErrorCode) -> Vec<u8> {
    let mut f = Vec::new();
    RstStream {
        stream_id: stream,
        error_code: code,
    }
    .encode(&mut f);
    f
}

/// In a balancer the relay records every stream into the Service's cells: its duration from
/// the client's HEADERS to its end both ways (or its reset), and a reset or refusal by the
/// backend as a failed call; a client's cancellation is no failure.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn streams_are_timed_from_headers_to_their_end_and_backend_resets_are_failures() {
    let (mut b, metrics) = open_metered_bed(RelaySettings::default()).await;
    tokio::time::advance(Duration::from_millis(30)).await;
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    let s = metrics.snapshot();
    assert_eq!(s.latency.count(), 1, "stream 1 is over");
    let bucket = LATENCY_BOUNDS.iter().position(|b| *b == 0.05).unwrap();
    assert_eq!(s.latency.counts[bucket], 1, "30 ms: the (25, 50] ms bucket");

    b.client
        .send(&headers(3, flags::END_HEADERS | flags::END_STREAM))
        .await;
    b.backend.expect(Kind::Headers).await;
    b.backend.send(&rst(3, ErrorCode::REFUSED_STREAM)).await;
    assert_eq!(
        b.client.expect_rst().await.error_code,
        ErrorCode::REFUSED_STREAM
    );

    b.client.send(&headers(5, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    b.backend.send(&rst(5, ErrorCode::INTERNAL_ERROR)).await;
    b.client.expect_rst().await;

    b.client.send(&headers(7, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    b.client.send(&rst(7, ErrorCode::CANCEL)).await;
    b.backend.expect_rst().await;

    let s = metrics.snapshot();
    assert_eq!(s.latency.count(), 4, "every stream is timed once");
    let failed =
        |r: FailureReason| s.failures[FailureReason::ALL.iter().position(|x| *x == r).unwrap()];
    assert_eq!(failed(FailureReason::Refused), 1, "{:?}", s.failures);
    assert_eq!(failed(FailureReason::Reset), 1, "{:?}", s.failures);
    assert_eq!(
        s.failures.iter().sum::<u64>(),
        2,
        "the cancel is no failure"
    );
    assert_eq!(b.handle.stats().open_streams(), 0);
}

/// Streams still open when the relay ends are over too: lost with the backend (it closed
/// first) they are failed calls (`connect`, as in request mode); abandoned by the client
/// they are timed but no failure.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn streams_open_when_the_backend_closes_fail_and_those_the_client_leaves_do_not() {
    let (mut b, metrics) = open_metered_bed(RelaySettings::default()).await;
    b.backend.io.shutdown().await.expect("shutdown");
    b.client.expect_eof().await;
    b.client.io.shutdown().await.expect("shutdown");
    b.backend.expect_eof().await;
    assert_eq!(
        b.task.await.expect("task").expect("clean end"),
        RelayEnd::Closed
    );
    let s = metrics.snapshot();
    assert_eq!(s.latency.count(), 1, "stream 1 is over");
    let connect = FailureReason::ALL
        .iter()
        .position(|r| *r == FailureReason::Connect)
        .unwrap();
    assert_eq!(s.failures[connect], 1, "{:?}", s.failures);
    assert_eq!(s.failures.iter().sum::<u64>(), 1, "{:?}", s.failures);

    let (mut b, metrics) = open_metered_bed(RelaySettings::default()).await;
    b.client.io.shutdown().await.expect("shutdown");
    b.backend.expect_eof().await;
    b.backend.io.shutdown().await.expect("shutdown");
    b.client.expect_eof().await;
    b.task.await.expect("task").expect("clean end");
    let s = metrics.snapshot();
    assert_eq!(s.latency.count(), 1, "stream 1 is over");
    assert_eq!(s.failures, [0; 5], "the client left: no failure");
}

/// A backend that closes its socket right after its last response, while the client reads
/// that response slowly (the 4 MiB grpc-js call of the rotation stress: an h2 backend closes
/// once its last stream has ended when it has received a GOAWAY, and Node's http2 sends one
/// as it closes on the rotation's first GOAWAY). The client's WINDOW_UPDATEs for the rest of
/// the response then meet a closed socket (a reset, on a real one) while the relay still
/// holds that rest. It must still reach the client, whole, then FIN: the call is not lost.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_response_the_backend_sent_before_closing_reaches_a_slow_client_whole_then_fin() {
    let (mut b, metrics) = open_metered_bed(RelaySettings::default()).await;
    rotate_and_ack(&mut b, RotationReason::MaxAge).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    // 1.5 MiB of DATA: more than the client's socket and the relay's buffer hold, so the
    // rest waits in the backend's socket while the client reads nothing.
    let chunk = vec![7u8; 16 * 1024];
    let frames = 96;
    let mut response = headers(1, flags::END_HEADERS);
    for _ in 0..frames {
        response.extend(frame(Kind::Data, 0, 1, &chunk));
    }
    response.extend(headers(1, flags::END_HEADERS | flags::END_STREAM));
    b.backend.send(&response).await;
    let Bed {
        mut client,
        backend,
        task,
        ..
    } = b;
    drop(backend);
    // The client grants the window its reads free; the relay's write of it fails.
    let mut update = Vec::new();
    WindowUpdate {
        stream_id: 0,
        increment: 1 << 20,
    }
    .encode(&mut update);
    client.send(&update).await;
    tokio::time::sleep(Duration::from_millis(1)).await;
    client.expect(Kind::Headers).await;
    let mut data = 0;
    loop {
        let (head, payload) = client
            .next()
            .await
            .unwrap_or_else(|| panic!("EOF after {data} bytes of DATA, before the trailers"));
        match head.kind {
            Kind::Data => data += payload.len(),
            Kind::Headers => {
                assert!(head.is_end_stream(), "the trailers end the stream");
                break;
            }
            _ => panic!("expected DATA or the trailers, got {head:?}"),
        }
    }
    assert_eq!(
        data,
        frames * chunk.len(),
        "every byte of the response arrives"
    );
    client.expect_eof().await;
    client.io.shutdown().await.expect("shutdown");
    let end = task.await.expect("task").expect("a clean end");
    assert_eq!(
        end,
        RelayEnd::Rotated(RotationReason::MaxAge),
        "the backend closed first, with every stream done: the rotation's end"
    );
    let s = metrics.snapshot();
    assert_eq!(s.latency.count(), 1, "stream 1 is over");
    assert_eq!(s.failures, [0; 5], "and did not fail");
}

/// A backend that closes during a rotation once every stream is done (an h2 server closes
/// after its last stream once a GOAWAY reached it), before the relay's final GOAWAY: the
/// connection ends as rotated, as when the relay closes both sides itself. The rotation asked
/// for the end and nothing was lost; which side closes first is timing.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_that_closes_mid_rotation_with_every_stream_done_ends_it_as_rotated() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    rotate_and_ack(&mut b, RotationReason::Skew).await;
    b.backend.io.shutdown().await.expect("shutdown");
    // The settling's own frames may come first; then FIN.
    while let Some((head, _)) = b.client.next().await {
        assert!(
            matches!(head.kind, Kind::Settings | Kind::Ping),
            "only the settling's frames before FIN, got {head:?}"
        );
    }
    b.client.io.shutdown().await.expect("shutdown");
    b.backend.expect_eof().await;
    assert_eq!(
        b.task.await.expect("task").expect("clean end"),
        RelayEnd::Rotated(RotationReason::Skew)
    );
}

/// A client that answers the rotation's GOAWAY with a GOAWAY of its own (Node's http2 closes
/// its session on a NO_ERROR GOAWAY, and its close() sends one): the relay does not forward
/// it, so the backend (an h2 server closes once its last stream ends after a GOAWAY) is
/// closed by the relay, with FIN, once the streams are done and delivered. Outside a
/// rotation a client's GOAWAY goes to the backend as every other frame.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_clients_goaway_in_answer_to_a_rotation_is_not_forwarded_to_the_backend() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::MaxAge);
    assert_eq!(b.client.expect_go_away().await, MAX_STREAM_ID);
    b.client.send(&go_away(0)).await;
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    // The backend gets nothing after the request (no GOAWAY), then FIN.
    let end = b.ends_cleanly().await;
    assert_eq!(end, RelayEnd::Rotated(RotationReason::MaxAge));

    let mut b = open_bed(RelaySettings::default()).await;
    b.client.send(&go_away(0)).await;
    assert_eq!(
        b.backend.expect_go_away().await,
        0,
        "outside a rotation the client's GOAWAY is forwarded"
    );
}

// Hostile clients (issue 11 section 3): each is cut off, bounded in what the relay carries for
// it, and told why when it spoke HTTP/2.

/// Reads every frame `peer` gets until EOF; the number of frames of `kind`, and the last frame.
async fn drain(mut peer: Peer, kind: Kind) -> (usize, Option<(Head, Vec<u8>)>) {
    let (mut n, mut last) = (0, None);
    while let Some(f) = peer.next().await {
        n += usize::from(f.0.kind == kind);
        last = Some(f);
    }
    (n, last)
}

/// Sends `bytes` from the client after [`open_bed`] while both peers read what they get;
/// the relay's error, how many frames of `kind` reached the backend, and the client's last
/// frame (which must be the GOAWAY the relay ended with).
async fn hostile(bytes: Vec<u8>, kind: Kind) -> (RelayError, usize, GoAway<'static>, RelayHandle) {
    let Bed {
        client,
        backend,
        handle,
        task,
    } = open_bed(RelaySettings::default()).await;
    let Peer { io, buf } = client;
    let (mut read, mut write) = tokio::io::split(io);
    // The relay stops reading mid-flood: the rest of the write may fail.
    let writer = tokio::spawn(async move {
        let _ = write.write_all(&bytes).await;
        write
    });
    let backend = tokio::spawn(drain(backend, kind));
    let mut rest = buf.to_vec();
    tokio::time::timeout(STUCK, read.read_to_end(&mut rest))
        .await
        .expect("the relay is stuck")
        .expect("client EOF");
    let err = task
        .await
        .expect("task")
        .expect_err("the client is cut off");
    let (forwarded, _) = backend.await.expect("backend reader");
    drop(writer.await.expect("writer"));
    let frames: Vec<_> = Frames::new(&rest, MAX_MAX_FRAME_SIZE)
        .map(|f| f.expect("whole frames to the client"))
        .map(|(h, p)| (h, p.to_vec()))
        .collect();
    let (head, payload) = frames.last().expect("a GOAWAY before the FIN").clone();
    let g = GoAway::decode(&head, &payload).expect("the last frame is a GOAWAY");
    let g = GoAway {
        last_stream_id: g.last_stream_id,
        error_code: g.error_code,
        debug_data: b"",
    };
    (err, forwarded, g, handle)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn ping_settings_and_rst_stream_floods_are_cut_off_at_their_budget_with_enhance_your_calm() {
    // The budgets (request mode's): 1,000 PINGs, 100 SETTINGS (the client's first included),
    // 10,000 RST_STREAMs; acks and other frames are free. Time stands still (paused), so
    // nothing refills: exactly the burst is relayed, the next frame cuts the client off.
    let pings: Vec<u8> = (0..5_000).flat_map(|_| ping(false, [7; 8])).collect();
    let settings: Vec<u8> = (0..5_000).flat_map(|_| empty_settings()).collect();
    let resets: Vec<u8> = (0..50_000)
        .flat_map(|_| rst(1, ErrorCode::CANCEL))
        .collect();
    for (bytes, kind, flood, relayed) in [
        (pings, Kind::Ping, Flood::Ping, 1_000),
        (settings, Kind::Settings, Flood::Settings, 99),
        (resets, Kind::RstStream, Flood::RstStream, 10_000),
    ] {
        let (err, forwarded, go_away, _) = hostile(bytes, kind).await;
        assert!(
            matches!(err, RelayError::ClientProtocol(ProtocolError::Flood(f)) if f == flood),
            "{err:?}"
        );
        assert_eq!(
            forwarded, relayed,
            "{kind:?}: the budget is relayed, no more"
        );
        assert_eq!(go_away.error_code, ErrorCode::ENHANCE_YOUR_CALM);
        assert_eq!(
            go_away.last_stream_id, 1,
            "the one stream the client opened"
        );
    }
    // Acks cost nothing: 5,000 PING ACKs and SETTINGS ACKs pass.
    let Bed {
        mut client,
        backend,
        task,
        ..
    } = open_bed(RelaySettings::default()).await;
    let backend = tokio::spawn(drain(backend, Kind::Ping));
    let mut acks = Vec::new();
    for _ in 0..5_000 {
        acks.extend(ping(true, [7; 8]));
        Settings::encode(true, &[], &mut acks);
    }
    client.send(&acks).await;
    client.io.shutdown().await.expect("shutdown");
    client.expect_eof().await;
    assert_eq!(backend.await.expect("backend").0, 5_000);
    task.await.expect("task").expect("acks are no flood");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn rapid_reset_is_cut_off_by_the_rst_stream_budget_and_never_holds_streams() {
    // HEADERS then RST_STREAM on 100,000 new streams (CVE-2023-44487's shape).
    let mut bytes = Vec::new();
    for i in 0..100_000u32 {
        let id = 3 + 2 * i;
        bytes.extend(headers(id, flags::END_HEADERS));
        bytes.extend(rst(id, ErrorCode::CANCEL));
    }
    let (err, forwarded, go_away, handle) = hostile(bytes, Kind::Headers).await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::Flood(Flood::RstStream))
        ),
        "{err:?}"
    );
    assert_eq!(
        forwarded, 10_001,
        "10,000 reset streams, and the HEADERS of the one whose reset trips the budget"
    );
    assert_eq!(go_away.error_code, ErrorCode::ENHANCE_YOUR_CALM);
    assert_eq!(
        handle.stats().requests(),
        10_002,
        "stream 1 and the reset ones"
    );
    assert_eq!(handle.stats().open_streams(), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_hundred_thousand_open_streams_are_cut_off_at_max_streams() {
    // A backend that never answers and a client that opens 100,000 streams: the relay tracks
    // `max_streams` (8,192, stream 1 included) and closes the connection at the next one.
    let bytes: Vec<u8> = (0..100_000u32)
        .flat_map(|i| headers(3 + 2 * i, flags::END_HEADERS))
        .collect();
    let (err, forwarded, go_away, handle) = hostile(bytes, Kind::Headers).await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::TooManyStreams { max: 8192 })
        ),
        "{err:?}"
    );
    assert_eq!(forwarded, 8_191, "the streams tracked besides stream 1");
    assert_eq!(go_away.error_code, ErrorCode::ENHANCE_YOUR_CALM);
    assert_eq!(handle.stats().requests(), 8_192);
    assert_eq!(handle.stats().open_streams(), 0, "abandoned at the close");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_client_that_sends_no_preface_is_closed_after_the_handshake_timeout() {
    for sent in [&b""[..], &PREFACE[..12], &PREFACE[..]] {
        let mut b = bed(RelaySettings::default());
        let t0 = Instant::now();
        b.client.send(sent).await;
        let mut rest = Vec::new();
        tokio::time::timeout(STUCK, b.client.io.read_to_end(&mut rest))
            .await
            .expect("the relay never closes the silent client")
            .expect("client EOF");
        let waited = t0.elapsed();
        assert!(
            waited >= Duration::from_secs(10) && waited < Duration::from_millis(10_100),
            "closed at the 10 s handshake timeout, after {waited:?}"
        );
        assert!(
            rest.is_empty(),
            "no GOAWAY to a client that never spoke HTTP/2"
        );
        b.backend
            .io
            .read_to_end(&mut rest)
            .await
            .expect("backend EOF");
        drop(b.client);
        let err = b.task.await.expect("task").expect_err("closed");
        assert!(
            matches!(err, RelayError::ClientProtocol(ProtocolError::NoPreface(_))),
            "{} preface bytes: {err:?}",
            sent.len()
        );
        assert!(err.is_client());
    }

    // A slow but complete handshake is no offence.
    let mut b = bed(RelaySettings::default());
    tokio::time::sleep(Duration::from_secs(9)).await;
    client_hello(&mut b).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    b.client.send(&headers(1, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    assert!(!b.task.is_finished(), "still relaying after the timeout");
}
