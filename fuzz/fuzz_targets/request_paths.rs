//! Request mode's two data paths on the same inputs: one client connection's frames, written
//! to the h2-based path (`Balancer`) and to the frame-codec path (`CodecBalancer`), both in
//! front of the same upstream over loopback. What each client sees must agree: how the
//! connection ends (a GOAWAY's error code) and, for every stream the client finished, its
//! answer (`:status`, `content-type`, `grpc-status`, the response body, or the RST_STREAM code).
//!
//! The input is a list of steps, mostly well-formed gRPC calls whose header lists are edited
//! (fields removed, replaced, duplicated, inserted), among raw frames of any kind. Divergences
//! the paths are allowed (documented in docs/balancer.md, "Data path on the frame codec") are
//! named in [`Written::divergence`]; an input with one is still run on both paths (neither may
//! panic, and each must answer every stream the client finished or end the connection) but its
//! answers are not compared.
#![no_main]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use skewless_balancer::{Balancer, CodecBalancer, Config, Endpoint, NewConnection};
use skewless_frame::{ErrorCode, HEADER_LEN, Head, Kind, PREFACE, Ping, flags};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Steps of one input at most.
const MAX_STEPS: usize = 24;
/// How long a path may take to answer every stream the client finished.
const SETTLE: Duration = Duration::from_secs(2);
/// The PING the harness ends its input with: its ACK says every frame before it was read.
const SENTINEL: [u8; 8] = *b"sentinel";
/// The request every `Call` step starts from.
const GRPC_REQUEST: &[(&[u8], &[u8])] = &[
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/skewless.echo.Echo/Echo"),
    (b":authority", b"echo.test:50051"),
    (b"content-type", b"application/grpc"),
    (b"te", b"trailers"),
];

#[derive(Arbitrary, Debug)]
struct Input {
    steps: Vec<Step>,
}

#[derive(Arbitrary, Debug)]
enum Step {
    /// A gRPC call: HEADERS from [`GRPC_REQUEST`] with `edits`, its messages in one DATA frame
    /// or none (END_STREAM on the HEADERS), and trailers when there are any.
    Call {
        stream: StreamId,
        edits: Vec<Edit>,
        messages: Vec<Vec<u8>>,
        trailers: Vec<Field>,
    },
    /// A HEADERS frame of `fields` alone.
    Headers {
        stream: StreamId,
        fields: Vec<Field>,
        end_stream: bool,
    },
    Data {
        stream: StreamId,
        payload: Vec<u8>,
        end_stream: bool,
        padding: Option<u8>,
    },
    Reset {
        stream: StreamId,
        code: u8,
    },
    Ping {
        ack: bool,
        opaque: [u8; 8],
    },
    Settings {
        ack: bool,
        params: Vec<(u8, u32)>,
    },
    WindowUpdate {
        stream: StreamId,
        increment: u32,
    },
    /// Any frame at all.
    Raw {
        kind: u8,
        flags: u8,
        stream: StreamId,
        payload: Vec<u8>,
    },
}

/// Stream ids: mostly the client's first few, sometimes 0, even or the largest.
#[derive(Arbitrary, Debug, Clone, Copy)]
struct StreamId(u8);

impl StreamId {
    fn id(self) -> u32 {
        match self.0 {
            0 => 0,
            1 => 2,
            2 => skewless_frame::MAX_STREAM_ID,
            n => 2 * u32::from((n - 3) % 12) + 1,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Edit {
    Remove(u8),
    Replace(u8, Field),
    Insert(u8, Field),
    Duplicate(u8),
}

#[derive(Arbitrary, Debug, Clone)]
enum Field {
    Method(Choice),
    Scheme(Choice),
    Path(Choice),
    Authority(Choice),
    ContentType(Choice),
    Te(Choice),
    GrpcTimeout(Choice),
    ContentLength(u16),
    Status,
    UnknownPseudo,
    Connection,
    Uppercase,
    Other { name: Vec<u8>, value: Vec<u8> },
}

/// A field's value: a usual one, an unusual one, or any bytes.
#[derive(Arbitrary, Debug, Clone)]
enum Choice {
    Usual,
    Unusual,
    Empty,
    Bytes(Vec<u8>),
}

impl Field {
    fn encode(&self) -> (Vec<u8>, Vec<u8>) {
        fn pick(c: &Choice, usual: &[u8], unusual: &[u8]) -> Vec<u8> {
            match c {
                Choice::Usual => usual.to_vec(),
                Choice::Unusual => unusual.to_vec(),
                Choice::Empty => Vec::new(),
                Choice::Bytes(b) => b.clone(),
            }
        }
        let (name, value): (&[u8], Vec<u8>) = match self {
            Self::Method(c) => (b":method", pick(c, b"POST", b"GET")),
            Self::Scheme(c) => (b":scheme", pick(c, b"http", b"https")),
            Self::Path(c) => (b":path", pick(c, b"/skewless.echo.Echo/Echo", b"*")),
            Self::Authority(c) => (b":authority", pick(c, b"echo.test", b"a b")),
            Self::ContentType(c) => (
                b"content-type",
                pick(c, b"application/grpc+proto", b"text/plain"),
            ),
            Self::Te(c) => (b"te", pick(c, b"trailers", b"gzip")),
            Self::GrpcTimeout(c) => (b"grpc-timeout", pick(c, b"30S", b"123456789S")),
            Self::ContentLength(n) => (b"content-length", n.to_string().into_bytes()),
            Self::Status => (b":status", b"200".to_vec()),
            Self::UnknownPseudo => (b":protocol", b"websocket".to_vec()),
            Self::Connection => (b"connection", b"keep-alive".to_vec()),
            Self::Uppercase => (b"X-Upper", b"1".to_vec()),
            Self::Other { name, value } => return (name.clone(), value.clone()),
        };
        (name.to_vec(), value)
    }
}

/// What one client connection wrote: its bytes, and the streams it finished (its last frame on
/// them carried END_STREAM) or reset.
#[derive(Default)]
struct Written {
    bytes: Vec<u8>,
    finished: BTreeMap<u32, bool>,
    reset: Vec<u32>,
    /// Streams with a deadline short enough to race their answer.
    timed: Vec<u32>,
    /// Streams a header block was sent on (a second one is trailers).
    opened: Vec<u32>,
    /// A header block of any bytes went out (a raw HEADERS, CONTINUATION or PUSH_PROMISE).
    raw_block: bool,
    /// Why the paths may answer these frames differently, when they may (see
    /// docs/balancer.md, "Data path on the frame codec").
    divergence: Option<&'static str>,
}

impl Written {
    fn frame(&mut self, kind: Kind, flags: u8, stream: u32, payload: &[u8]) {
        let len = u32::try_from(payload.len()).expect("inputs are small");
        self.bytes
            .extend_from_slice(&Head::new(kind, flags, stream, len).encode());
        self.bytes.extend_from_slice(payload);
        if matches!(kind, Kind::Headers | Kind::Data) && stream != 0 {
            let before = self.finished.insert(stream, flags & flags::END_STREAM != 0);
            if before == Some(true) {
                self.divergence.get_or_insert(
                    "h2 makes DATA or HEADERS after the client ended a stream it has not \
                     closed a connection error (RFC 9113 section 5.1: a stream error, \
                     STREAM_CLOSED)",
                );
            }
        }
        if kind == Kind::RstStream {
            self.reset.push(stream);
        }
        if kind == Kind::Headers && stream != 0 {
            let opened = self.opened.contains(&stream);
            let going_back = !opened && self.opened.iter().any(|&o| o > stream);
            if stream.is_multiple_of(2) || going_back {
                self.divergence.get_or_insert(
                    "h2 checks a header block before its stream id: a malformed one on an even \
                     stream or one the client can no longer open is reset, not the connection \
                     error of RFC 9113 section 5.1.1",
                );
            }
            if !opened {
                self.opened.push(stream);
            }
        }
        if kind == Kind::PushPromise {
            self.divergence.get_or_insert(
                "h2 decodes a client's PUSH_PROMISE as a header block first, and may reset a \
                 stream for it instead of the connection error of RFC 9113 section 8.4",
            );
        }
        if kind == Kind::Priority && stream != 0 && payload.len() != 5 {
            self.divergence.get_or_insert(
                "h2 makes a PRIORITY frame of a length other than 5 a connection error \
                 (RFC 9113 section 6.3: a stream error)",
            );
        }
    }

    fn headers(
        &mut self,
        encoder: &mut httlib_hpack::Encoder<'static>,
        flags: u8,
        stream: u32,
        fields: &[(Vec<u8>, Vec<u8>)],
    ) {
        let timed = fields.iter().any(|(n, v)| {
            n == b"grpc-timeout"
                && skewless_balancer::grpc::parse_timeout_bytes(v).is_some_and(|d| d < 5 * SETTLE)
        });
        if timed {
            self.timed.push(stream);
        }
        let trailers = self.opened.contains(&stream);
        if !trailers && !fields.iter().any(|(n, _)| n == b":path") {
            self.divergence.get_or_insert(
                "h2 takes a request without :path (RFC 9113 section 8.3.1: malformed)",
            );
        }
        for (name, value) in fields {
            let why = if h2_refuses(name, value) {
                "h2 makes a field its header types refuse a connection error (RFC 9113 section \
                 8.2.1: a malformed message, a stream error; h2 also refuses controls the RFC \
                 allows in values)"
            } else if name.starts_with(b":") && trailers {
                "h2 takes pseudo-header fields in trailers (RFC 9113 section 8.1: malformed)"
            } else if name.starts_with(b":")
                && ![&b":method"[..], b":scheme", b":path", b":authority"]
                    .contains(&name.as_slice())
            {
                "h2 makes an unknown pseudo-header field a connection error (RFC 9113 section \
                 8.1.1: a malformed request, a stream error)"
            } else if name.iter().any(u8::is_ascii_uppercase) {
                "h2 takes field names with uppercase letters (RFC 9113 section 8.2.1: malformed)"
            } else {
                continue;
            };
            self.divergence.get_or_insert(why);
        }
        let mut block = Vec::new();
        for (name, value) in fields {
            // Without indexing: a field the encoder refuses leaves the table as it was.
            let _ = encoder.encode(
                (
                    name.clone(),
                    value.clone(),
                    httlib_hpack::Encoder::BEST_FORMAT,
                ),
                &mut block,
            );
        }
        self.frame(Kind::Headers, flags, stream, &block);
    }
}

/// [`GRPC_REQUEST`] as a header list to edit.
fn grpc_request() -> Vec<(Vec<u8>, Vec<u8>)> {
    GRPC_REQUEST
        .iter()
        .map(|(n, v)| (n.to_vec(), v.to_vec()))
        .collect()
}

/// Whether h2's decoder refuses the field (its `Header::new`): an empty name, an unknown
/// pseudo-header, a known one whose value does not parse, a name or value `http` refuses.
fn h2_refuses(name: &[u8], value: &[u8]) -> bool {
    match name {
        [] => true,
        b":method" => http::Method::from_bytes(value).is_err(),
        b":status" => http::StatusCode::from_bytes(value).is_err(),
        b":authority" | b":scheme" | b":path" | b":protocol" => std::str::from_utf8(value).is_err(),
        [b':', ..] => true,
        _ => {
            http::HeaderName::from_bytes(name).is_err()
                || http::HeaderValue::from_bytes(value).is_err()
        }
    }
}

/// The client's frames for `steps` (after the preface and the handshake).
fn client_frames(steps: &[Step]) -> Written {
    let mut w = Written::default();
    let mut encoder = httlib_hpack::Encoder::with_dynamic_size(4096);
    for step in steps {
        match step {
            Step::Call {
                stream,
                edits,
                messages,
                trailers,
            } => {
                let mut fields = grpc_request();
                for edit in edits.iter().take(4) {
                    let at = |i: &u8, len: usize| usize::from(*i) % len.max(1);
                    match edit {
                        Edit::Remove(i) if !fields.is_empty() => {
                            fields.remove(at(i, fields.len()));
                        }
                        Edit::Replace(i, f) if !fields.is_empty() => {
                            let i = at(i, fields.len());
                            fields[i] = f.encode();
                        }
                        Edit::Insert(i, f) => {
                            let i = at(i, fields.len() + 1);
                            fields.insert(i, f.encode());
                        }
                        Edit::Duplicate(i) if !fields.is_empty() => {
                            let f = fields[at(i, fields.len())].clone();
                            fields.push(f);
                        }
                        _ => {}
                    }
                }
                let id = stream.id();
                let body: Vec<u8> = messages
                    .iter()
                    .take(4)
                    .flat_map(|m| {
                        let mut framed = vec![0];
                        framed.extend_from_slice(&(m.len() as u32).to_be_bytes());
                        framed.extend_from_slice(m);
                        framed
                    })
                    .collect();
                let no_body = messages.is_empty() && trailers.is_empty();
                let end = if no_body { flags::END_STREAM } else { 0 };
                w.headers(&mut encoder, flags::END_HEADERS | end, id, &fields);
                if !body.is_empty() || !no_body {
                    let end = if trailers.is_empty() {
                        flags::END_STREAM
                    } else {
                        0
                    };
                    w.frame(Kind::Data, end, id, &body);
                }
                if !trailers.is_empty() {
                    let t: Vec<_> = trailers.iter().take(4).map(Field::encode).collect();
                    w.headers(&mut encoder, flags::END_HEADERS | flags::END_STREAM, id, &t);
                }
            }
            Step::Headers {
                stream,
                fields,
                end_stream,
            } => {
                let f: Vec<_> = fields.iter().take(8).map(Field::encode).collect();
                let end = if *end_stream { flags::END_STREAM } else { 0 };
                w.headers(&mut encoder, flags::END_HEADERS | end, stream.id(), &f);
            }
            Step::Data {
                stream,
                payload,
                end_stream,
                padding,
            } => {
                let mut p = Vec::new();
                let mut fl = if *end_stream { flags::END_STREAM } else { 0 };
                if let Some(pad) = padding {
                    fl |= flags::PADDED;
                    p.push(*pad);
                    p.extend_from_slice(payload);
                    p.resize(p.len() + usize::from(*pad % 16), 0);
                } else {
                    p.extend_from_slice(payload);
                }
                w.frame(Kind::Data, fl, stream.id(), &p);
            }
            Step::Reset { stream, code } => {
                w.frame(
                    Kind::RstStream,
                    0,
                    stream.id(),
                    &u32::from(*code % 16).to_be_bytes(),
                );
            }
            Step::Ping { ack, opaque } => {
                let opaque = if *opaque == SENTINEL { [0; 8] } else { *opaque };
                Ping { ack: *ack, opaque }.encode(&mut w.bytes);
            }
            Step::Settings { ack, params } => {
                let mut p = Vec::new();
                for (id, value) in params.iter().take(6) {
                    p.extend_from_slice(&u16::from(*id % 10).to_be_bytes());
                    p.extend_from_slice(&value.to_be_bytes());
                }
                let fl = if *ack { flags::ACK } else { 0 };
                w.frame(Kind::Settings, fl, 0, &p);
            }
            Step::WindowUpdate { stream, increment } => {
                w.frame(
                    Kind::WindowUpdate,
                    0,
                    stream.id(),
                    &(increment & 0x7fff_ffff).to_be_bytes(),
                );
            }
            Step::Raw {
                kind,
                flags,
                stream,
                payload,
            } => {
                let kind = Kind::from(*kind % 12);
                w.raw_block |=
                    matches!(kind, Kind::Headers | Kind::Continuation | Kind::PushPromise);
                if kind == Kind::Headers && flags & flags::END_HEADERS == 0 {
                    w.divergence.get_or_insert(
                        "h2 resets the stream of a malformed header block before its \
                         CONTINUATION comes, and so misses the connection error of a frame that \
                         is not one (RFC 9113 section 6.10)",
                    );
                }
                w.frame(kind, *flags, stream.id(), payload);
            }
        }
    }
    w
}

/// How a stream ended for the client.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Answer {
    status: Option<Vec<u8>>,
    content_type: Option<Vec<u8>>,
    grpc_status: Option<Vec<u8>>,
    body: Vec<u8>,
    end: End,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
enum End {
    #[default]
    Open,
    Stream,
    Reset(u32),
}

/// What one path's client saw.
#[derive(Debug, Default)]
struct Seen {
    answers: BTreeMap<u32, Answer>,
    /// `grpc-message` by stream: not compared (the paths word their own errors), shown when
    /// answers differ.
    messages: BTreeMap<u32, String>,
    /// The first GOAWAY's error code.
    go_away: Option<u32>,
    closed: bool,
    sentinel_acked: bool,
    settled: bool,
}

/// Runs the input on one path's balancer at `addr`.
async fn run(addr: SocketAddr, input: &Written) -> Seen {
    let mut seen = Seen::default();
    let Ok(tcp) = TcpStream::connect(addr).await else {
        seen.closed = true;
        return seen;
    };
    let _ = tcp.set_nodelay(true);
    let mut hello = PREFACE.to_vec();
    hello.extend_from_slice(&Head::new(Kind::Settings, 0, 0, 0).encode());
    let (mut rd, mut wr) = tcp.into_split();
    if wr.write_all(&hello).await.is_err() {
        seen.closed = true;
        return seen;
    }
    // The server's SETTINGS come first; the input goes out once they are acknowledged, on a
    // task of its own (the server may answer before it has read it all), and the write side
    // stays open until the reader is done.
    let (settings_seen, wait_settings) = tokio::sync::oneshot::channel::<()>();
    let (reader_done, wait_reader) = tokio::sync::oneshot::channel::<()>();
    let mut out = Head::new(Kind::Settings, flags::ACK, 0, 0)
        .encode()
        .to_vec();
    out.extend_from_slice(&input.bytes);
    // The client's window back to the default, should the input have closed it, then the
    // sentinel PING.
    out.extend_from_slice(&Head::new(Kind::Settings, 0, 0, 6).encode());
    out.extend_from_slice(&[0, 4, 0, 0, 0xff, 0xff]);
    Ping {
        ack: false,
        opaque: SENTINEL,
    }
    .encode(&mut out);
    tokio::spawn(async move {
        if wait_settings.await.is_ok() {
            let _ = wr.write_all(&out).await;
        }
        let _ = wait_reader.await;
    });
    let mut settings_seen = Some(settings_seen);
    let mut decoder = httlib_hpack::Decoder::with_dynamic_size(4096);
    let mut block = Vec::new();
    let mut block_stream = 0;
    let deadline = tokio::time::Instant::now() + SETTLE;
    let mut header = [0u8; HEADER_LEN];
    loop {
        if seen.sentinel_acked
            && input
                .finished
                .iter()
                .filter(|(id, fin)| **fin && !input.reset.contains(id))
                .all(|(id, _)| seen.answers.get(id).is_some_and(|a| a.end != End::Open))
        {
            seen.settled = true;
            break;
        }
        let read = tokio::time::timeout_at(deadline, rd.read_exact(&mut header)).await;
        let Ok(read) = read else { break };
        if read.is_err() {
            seen.closed = true;
            break;
        }
        let head = Head::decode(&header);
        let mut payload = vec![0u8; head.len as usize];
        if rd.read_exact(&mut payload).await.is_err() {
            seen.closed = true;
            break;
        }
        match head.kind {
            Kind::Settings if !head.is_ack() => {
                if let Some(tx) = settings_seen.take() {
                    let _ = tx.send(());
                }
            }
            Kind::Ping if head.is_ack() && payload == SENTINEL => seen.sentinel_acked = true,
            Kind::GoAway => {
                if seen.go_away.is_none() && payload.len() >= 8 {
                    let code = u32::from_be_bytes(payload[4..8].try_into().expect("4 bytes"));
                    if code != ErrorCode::NO_ERROR.0 {
                        seen.go_away = Some(code);
                    }
                }
            }
            Kind::RstStream if payload.len() == 4 => {
                let code = u32::from_be_bytes(payload[..4].try_into().expect("4 bytes"));
                seen.answers.entry(head.stream_id).or_default().end = End::Reset(code);
            }
            Kind::Data => {
                let a = seen.answers.entry(head.stream_id).or_default();
                let mut p = payload.as_slice();
                if head.has(flags::PADDED) && !p.is_empty() {
                    let pad = usize::from(p[0]);
                    p = &p[1..p.len().saturating_sub(pad).max(1)];
                }
                a.body.extend_from_slice(p);
                if head.is_end_stream() {
                    a.end = End::Stream;
                }
            }
            Kind::Headers | Kind::Continuation => {
                if head.kind == Kind::Headers {
                    block.clear();
                    block_stream = head.stream_id;
                    let mut p = payload.as_slice();
                    let mut pad = 0;
                    if head.has(flags::PADDED) && !p.is_empty() {
                        pad = usize::from(p[0]);
                        p = &p[1..];
                    }
                    if head.has(flags::PRIORITY) && p.len() >= 5 {
                        p = &p[5..];
                    }
                    block.extend_from_slice(&p[..p.len().saturating_sub(pad)]);
                } else {
                    block.extend_from_slice(&payload);
                }
                let a = seen.answers.entry(block_stream).or_default();
                if head.is_end_stream() {
                    a.end = End::Stream;
                }
                if head.is_end_headers() {
                    let mut out = Vec::new();
                    decoder
                        .decode(&mut block, &mut out)
                        .expect("the balancer's header blocks decode");
                    for (name, value, _) in out {
                        match name.as_slice() {
                            b":status" => a.status = Some(value),
                            b"content-type" => a.content_type = Some(value),
                            b"grpc-status" => a.grpc_status = Some(value),
                            b"grpc-message" => {
                                seen.messages.insert(
                                    block_stream,
                                    String::from_utf8_lossy(&value).into_owned(),
                                );
                            }
                            _ => {}
                        }
                    }
                }
            }
            _ => {}
        }
    }
    drop(reader_done);
    seen
}

/// The upstream both paths balance to: an HTTP/2 server that answers every request with its
/// own body, `content-type: application/grpc` and `grpc-status: 0`.
async fn echo_upstream(listener: TcpListener) {
    while let Ok((tcp, _)) = listener.accept().await {
        tokio::spawn(async move {
            // No reset-flood limits: the balancers cancel upstream streams by the thousand as
            // inputs end, and an upstream that cut them off would make the answers depend on
            // earlier inputs.
            let handshake = h2::server::Builder::new()
                .max_pending_accept_reset_streams(usize::MAX)
                .max_local_error_reset_streams(None)
                .handshake(tcp);
            let Ok(mut conn) = handshake.await else {
                return;
            };
            while let Some(Ok((req, mut respond))) = conn.accept().await {
                tokio::spawn(async move {
                    let mut body = req.into_body();
                    let mut data = Vec::new();
                    while let Some(chunk) = body.data().await {
                        let Ok(chunk) = chunk else { return };
                        let _ = body.flow_control().release_capacity(chunk.len());
                        data.extend_from_slice(&chunk);
                    }
                    let response = http::Response::builder()
                        .status(200)
                        .header("content-type", "application/grpc")
                        .body(())
                        .expect("a response");
                    let Ok(mut send) = respond.send_response(response, false) else {
                        return;
                    };
                    if !data.is_empty() {
                        let _ = send.send_data(Bytes::from(data), false);
                    }
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                    let _ = send.send_trailers(trailers);
                });
            }
        });
    }
}

struct Harness {
    rt: tokio::runtime::Runtime,
    h2: SocketAddr,
    codec: SocketAddr,
    codec_balancer: Arc<CodecBalancer>,
}

async fn serve<B: NewConnection + Send + Sync + 'static>(balancer: Arc<B>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ =
            skewless_balancer::server::serve(&*balancer, listener, std::future::pending(), |_| {
                true
            })
            .await;
    });
    addr
}

fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let (h2, codec, codec_balancer) = rt.block_on(async {
            let upstream = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let endpoint = Endpoint::new(upstream.local_addr().expect("addr"), "echo");
            tokio::spawn(echo_upstream(upstream));
            let (tx, rx) = watch::channel(vec![endpoint]);
            // The sender lives as long as the process: the endpoints never change.
            std::mem::forget(tx);
            let h2 = serve(Arc::new(Balancer::new(Config::default(), rx.clone()))).await;
            let codec_balancer = Arc::new(CodecBalancer::new(Config::default(), rx));
            let codec = serve(codec_balancer.clone()).await;
            // Both paths up and serving a plain call before any input.
            let mut ok = Written::default();
            let mut encoder = httlib_hpack::Encoder::with_dynamic_size(4096);
            let fields = grpc_request();
            ok.headers(
                &mut encoder,
                flags::END_HEADERS | flags::END_STREAM,
                1,
                &fields,
            );
            for addr in [h2, codec] {
                let mut ready = false;
                for _ in 0..100 {
                    let seen = run(addr, &ok).await;
                    if seen
                        .answers
                        .get(&1)
                        .is_some_and(|a| a.grpc_status.as_deref() == Some(b"0"))
                    {
                        ready = true;
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                assert!(ready, "the balancer at {addr} never served a call");
            }
            (h2, codec, codec_balancer)
        });
        let (h2, codec, codec_balancer) = (h2, codec, codec_balancer);
        Harness {
            rt,
            h2,
            codec,
            codec_balancer,
        }
    })
}

fuzz_target!(|input: Input| {
    let steps = &input.steps[..input.steps.len().min(MAX_STEPS)];
    let written = client_frames(steps);
    let h = harness();
    let (h2, codec) =
        h.rt.block_on(async { tokio::join!(run(h.h2, &written), run(h.codec, &written)) });
    for (path, seen) in [("h2", &h2), ("codec", &codec)] {
        assert!(
            seen.settled || seen.closed || seen.go_away.is_some(),
            "the {path} path left streams the client finished unanswered for {SETTLE:?}: {seen:?}"
        );
    }
    if written.divergence.is_some() {
        return;
    }
    // h2 answers a field block that does not decode with PROTOCOL_ERROR; RFC 9113 section
    // 4.3 says COMPRESSION_ERROR, which the codec path sends.
    if written.raw_block
        && codec.go_away.is_none()
        && h2.go_away.is_some_and(|c| {
            c == ErrorCode::PROTOCOL_ERROR.0 || c == ErrorCode::COMPRESSION_ERROR.0
        })
    {
        // h2's HPACK decoder refuses blocks httlib-hpack takes (a table size update after
        // the block's first field, RFC 7541 section 4.2); telling them apart would take an
        // HPACK parser of our own.
        return;
    }
    let h2_go_away = match (h2.go_away, codec.go_away) {
        (Some(p), Some(c))
            if p == ErrorCode::PROTOCOL_ERROR.0 && c == ErrorCode::COMPRESSION_ERROR.0 =>
        {
            Some(c)
        }
        (h2, _) => h2,
    };
    assert_eq!(
        h2_go_away, codec.go_away,
        "the paths end the connection differently (h2 left, codec right)"
    );
    if h2.go_away.is_some() || h2.closed || codec.closed {
        // Calls in flight when a connection ends are cut wherever they were.
        return;
    }
    for (id, finished) in &written.finished {
        if !finished || written.reset.contains(id) || written.timed.contains(id) {
            continue;
        }
        let (a, b) = (h2.answers.get(id), codec.answers.get(id));
        assert_eq!(
            a,
            b,
            "stream {id} is answered differently (h2 left, codec right; messages {:?} and {:?}; \
             the codec path's endpoints {:?})",
            h2.messages.get(id),
            codec.messages.get(id),
            h.codec_balancer.stats(),
        );
    }
});
