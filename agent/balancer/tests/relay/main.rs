//! Connection mode's relay against frame-level fake peers (h2's test style: every frame on
//! the wire checked), over in-memory pipes with paused time where the timeouts matter. Its
//! runs between real h2 peers and tonic are `relay_peers.rs`.

#[path = "../support/mod.rs"]
mod support;

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
use support::{STUCK, empty_settings, frame, ping, settings_ack};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream, duplex};
use tokio::task::JoinHandle;
use tokio::time::Instant;

mod frames;
mod hostile;
mod rotation;
mod settling;

/// A graceful GOAWAY with `last`.
fn go_away(last: u32) -> Vec<u8> {
    support::go_away(last, ErrorCode::NO_ERROR)
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

fn rst(stream: u32, code: ErrorCode) -> Vec<u8> {
    let mut f = Vec::new();
    RstStream {
        stream_id: stream,
        error_code: code,
    }
    .encode(&mut f);
    f
}
