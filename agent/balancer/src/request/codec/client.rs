//! One client connection on the frame codec: the server side of its HTTP/2, every request
//! stream opened on an upstream connection as its HEADERS arrive, and the state upstream
//! readers write responses into ([`ClientState`]).

use std::sync::Arc;

use bytes::{Buf as _, BytesMut};
use skewless_frame::{
    ErrorCode, Frames, GoAway, Head, Kind, PREFACE, RstStream, Setting, SettingId, Settings,
    WindowUpdate, flags,
};
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::fields::{self, Fields, HpackDecoder, HpackEncoder};
use super::frames::{self, DEFAULT_WINDOW, HeaderBlocks, SendLimits};
use super::out::{HasOut, Out, Shared};
use super::upstream::{HEADER_TABLE_SIZE, MAX_FRAME, UpShared};
use super::{CodecPool, StreamMap};
use crate::request::config::Config;
use crate::request::picker::Outcome;
use crate::server::Stop;
use crate::upstream::{CONNECTION_WINDOW, MAX_HEADER_LIST, STREAM_WINDOW};

pub(crate) type ClientShared = Shared<ClientState>;

/// Most streams one client connection may have open at once (as on the h2 path).
const MAX_CLIENT_STREAMS: u32 = 1024;

/// What upstream readers write responses into.
pub(crate) struct ClientState {
    out: Out,
    encoder: HpackEncoder,
    streams: StreamMap<ClientStream>,
    /// What may be sent to the client.
    limits: SendLimits,
}

impl HasOut for ClientState {
    fn out(&mut self) -> &mut Out {
        &mut self.out
    }
}

/// One open client stream.
struct ClientStream {
    /// The upstream stream carrying it.
    up: Arc<UpShared>,
    up_stream: u32,
    /// Send window of this stream (towards the client).
    window: i64,
    /// The client's side ended (END_STREAM seen).
    request_ended: bool,
    /// Request bytes received and not yet given back in a WINDOW_UPDATE.
    unacked: u32,
}

impl ClientState {
    fn new() -> Self {
        Self {
            out: Out::default(),
            encoder: HpackEncoder::new(),
            streams: StreamMap::default(),
            limits: SendLimits::new(),
        }
    }

    /// Sends response headers (or trailers) on `stream`; `false` when the stream is gone.
    pub(crate) fn respond_headers(
        &mut self,
        stream: u32,
        fields: &Fields,
        end_stream: bool,
    ) -> bool {
        if !self.streams.contains_key(&stream) {
            return false;
        }
        let forwarded = fields.iter().filter(|(n, _)| !is_connection_specific(n));
        fields::put_headers(
            &mut self.out.buf,
            &mut self.encoder,
            stream,
            end_stream,
            forwarded,
        );
        if end_stream {
            self.streams.remove(&stream);
        }
        true
    }

    /// Sends response body bytes on `stream`; `false` when the stream is gone or the bytes do
    /// not fit the client's window (then the stream is reset).
    pub(crate) fn respond_data(&mut self, stream: u32, data: &[u8], end_stream: bool) -> bool {
        let Some(s) = self.streams.get_mut(&stream) else {
            return false;
        };
        if !self.limits.take(&mut s.window, data.len()) {
            tracing::debug!(
                stream,
                len = data.len(),
                "response does not fit the client's window"
            );
            self.streams.remove(&stream);
            RstStream {
                stream_id: stream,
                error_code: ErrorCode::INTERNAL_ERROR,
            }
            .encode(&mut self.out.buf);
            return false;
        }
        fields::put_data(
            &mut self.out.buf,
            stream,
            data,
            end_stream,
            self.limits.max_frame,
        );
        if end_stream {
            self.streams.remove(&stream);
        }
        true
    }

    /// The upstream reset the stream (or failed): reset it for the client.
    pub(crate) fn reset(&mut self, stream: u32, code: ErrorCode) {
        if self.streams.remove(&stream).is_some() {
            RstStream {
                stream_id: stream,
                error_code: code,
            }
            .encode(&mut self.out.buf);
        }
    }
}

/// Connection-specific header fields (RFC 9113 section 8.2.2), which are never forwarded.
fn is_connection_specific(name: &[u8]) -> bool {
    matches!(
        name,
        b"connection" | b"keep-alive" | b"proxy-connection" | b"transfer-encoding" | b"upgrade"
    )
}

/// Serves one client connection until it closes.
pub(crate) async fn serve(pool: Arc<CodecPool>, stream: TcpStream, _stop: Stop<Config>) {
    // The reader reads through `AsyncRead`, which takes a short read as "drained" (no read
    // that would find nothing); writers share the write half.
    let (mut read, write) = stream.into_split();
    let shared = Shared::new(write, ClientState::new());
    {
        let mut state = shared.lock();
        Settings::encode(
            false,
            &[
                Setting {
                    id: SettingId::MAX_CONCURRENT_STREAMS,
                    value: MAX_CLIENT_STREAMS,
                },
                Setting {
                    id: SettingId::INITIAL_WINDOW_SIZE,
                    value: STREAM_WINDOW,
                },
                Setting {
                    id: SettingId::MAX_HEADER_LIST_SIZE,
                    value: MAX_HEADER_LIST,
                },
            ],
            &mut state.out.buf,
        );
        WindowUpdate {
            stream_id: 0,
            increment: CONNECTION_WINDOW - DEFAULT_WINDOW as u32,
        }
        .encode(&mut state.out.buf);
        shared.flush_locked(&mut state);
    }
    let mut conn = Conn {
        pool,
        shared: shared.clone(),
        decoder: HpackDecoder::new(HEADER_TABLE_SIZE as u32),
        fields: Fields::default(),
        dirty: Vec::new(),
        blocks: HeaderBlocks::default(),
        last_stream: 0,
        unacked: 0,
    };
    let mut rbuf = BytesMut::with_capacity(64 * 1024);
    let mut preface = 0usize;
    loop {
        if rbuf.capacity() - rbuf.len() < 16 * 1024 {
            rbuf.reserve(64 * 1024);
        }
        match read.read_buf(&mut rbuf).await {
            Ok(0) => break,
            Ok(_) => {}
            Err(error) => {
                tracing::debug!(%error, "client read failed");
                break;
            }
        }
        if preface < PREFACE.len() {
            let n = (PREFACE.len() - preface).min(rbuf.len());
            if rbuf[..n] != PREFACE[preface..preface + n] {
                tracing::debug!("client sent no HTTP/2 preface");
                break;
            }
            preface += n;
            rbuf.advance(n);
            if preface < PREFACE.len() {
                continue;
            }
        }
        let now = Instant::now();
        let mut frames = Frames::new(&rbuf, MAX_FRAME);
        let mut failed = None;
        for frame in &mut frames {
            let result = match frame {
                Ok((head, payload)) => conn.frame(head, payload, now),
                Err(_) => Err(ErrorCode::FRAME_SIZE_ERROR),
            };
            if let Err(code) = result {
                failed = Some(code);
                break;
            }
        }
        let used = rbuf.len() - frames.rest().len();
        rbuf.advance(used);
        for up in conn.dirty.drain(..) {
            up.flush();
        }
        if let Some(code) = failed {
            let mut state = shared.lock();
            GoAway {
                last_stream_id: conn.last_stream,
                error_code: code,
                debug_data: b"",
            }
            .encode(&mut state.out.buf);
            shared.flush_locked(&mut state);
            break;
        }
        shared.flush();
    }
    conn.close();
}

/// The client reader's own state.
struct Conn {
    pool: Arc<CodecPool>,
    shared: Arc<ClientShared>,
    decoder: HpackDecoder,
    fields: Fields,
    /// Upstream connections written to in this batch, flushed at its end.
    dirty: Vec<Arc<UpShared>>,
    blocks: HeaderBlocks,
    /// The highest stream id the client opened.
    last_stream: u32,
    /// Request bytes received on the connection not yet given back.
    unacked: u32,
}

impl Conn {
    fn touch(&mut self, up: &Arc<UpShared>) {
        if !self.dirty.iter().any(|u| Arc::ptr_eq(u, up)) {
            self.dirty.push(up.clone());
        }
    }

    fn frame(&mut self, head: Head, payload: &[u8], now: Instant) -> Result<(), ErrorCode> {
        if self.blocks.open() || matches!(head.kind, Kind::Headers | Kind::Continuation) {
            if let Some((stream, end_stream, block)) = self.blocks.frame(head, payload)? {
                return self.headers(stream, &block, end_stream, now);
            }
            return Ok(());
        }
        match head.kind {
            Kind::Data => {
                let data = frames::strip(head, payload)?;
                self.data(
                    head.stream_id,
                    data,
                    payload.len(),
                    head.has(flags::END_STREAM),
                    now,
                );
                Ok(())
            }
            Kind::RstStream => {
                let rst =
                    RstStream::decode(&head, payload).map_err(|_| ErrorCode::PROTOCOL_ERROR)?;
                self.cancel(rst.stream_id, now);
                Ok(())
            }
            Kind::Settings => {
                let settings =
                    Settings::decode(&head, payload).map_err(|_| ErrorCode::PROTOCOL_ERROR)?;
                if settings.ack {
                    return Ok(());
                }
                let mut state = self.shared.lock();
                for s in settings.iter() {
                    let delta = state.limits.apply(s);
                    if delta != 0 {
                        for st in state.streams.values_mut() {
                            st.window += delta;
                        }
                    }
                    match s.id {
                        SettingId::HEADER_TABLE_SIZE if (s.value as usize) < HEADER_TABLE_SIZE => {
                            // No size update can be sent yet: refuse the connection.
                            return Err(ErrorCode::INTERNAL_ERROR);
                        }
                        _ => {}
                    }
                }
                Settings::encode(true, &[], &mut state.out.buf);
                Ok(())
            }
            Kind::Ping => frames::answer_ping(&head, payload, &mut self.shared.lock().out.buf),
            Kind::WindowUpdate => {
                let (stream, inc) = frames::window_update(&head, payload)?;
                let mut state = self.shared.lock();
                if stream == 0 {
                    state.limits.window += inc;
                } else if let Some(s) = state.streams.get_mut(&stream) {
                    s.window += inc;
                }
                Ok(())
            }
            Kind::GoAway => Ok(()),
            Kind::PushPromise => Err(ErrorCode::PROTOCOL_ERROR),
            Kind::Headers | Kind::Continuation | Kind::Priority | Kind::Unknown(_) => Ok(()),
        }
    }

    /// A request's header block: pick an endpoint and open the stream there.
    fn headers(
        &mut self,
        stream: u32,
        block: &[u8],
        end_stream: bool,
        now: Instant,
    ) -> Result<(), ErrorCode> {
        let decoded = self
            .fields
            .decode(&mut self.decoder, block, MAX_HEADER_LIST as usize);
        if let Err(fields::FieldsError::Compression(_)) = decoded {
            return Err(ErrorCode::COMPRESSION_ERROR);
        }
        if stream.is_multiple_of(2) || stream <= self.last_stream {
            // Trailers of an open request, or a stream id going back: trailers are
            // forwarded, anything else is a protocol error.
            return self.trailers(stream, end_stream, now);
        }
        self.last_stream = stream;
        if decoded.is_err() {
            self.refuse(stream, ErrorCode::REFUSED_STREAM);
            return Ok(());
        }
        if self.fields.get(b":method").is_none() || self.fields.get(b":path").is_none() {
            self.refuse(stream, ErrorCode::PROTOCOL_ERROR);
            return Ok(());
        }
        if self.shared.lock().streams.len() >= MAX_CLIENT_STREAMS as usize {
            self.refuse(stream, ErrorCode::REFUSED_STREAM);
            return Ok(());
        }
        let Some((up, lease)) = self.pool.pick(now) else {
            // No endpoint: a trailers-only UNAVAILABLE.
            let mut state = self.shared.lock();
            let mut f = Fields::default();
            f.push(b":status", b"200");
            f.push(b"content-type", b"application/grpc");
            f.push(b"grpc-status", b"14");
            f.push(b"grpc-message", b"skewless: no endpoint is ready");
            let st = &mut *state;
            fields::put_headers(&mut st.out.buf, &mut st.encoder, stream, true, f.iter());
            return Ok(());
        };
        let forwarded = self
            .fields
            .iter()
            .filter(|(n, _)| !is_connection_specific(n));
        let opened = up
            .lock()
            .open(&self.shared, stream, lease, end_stream, forwarded);
        match opened {
            Ok(up_stream) => {
                let initial = self.shared.lock().limits.initial_window;
                self.shared.lock().streams.insert(
                    stream,
                    ClientStream {
                        up: up.clone(),
                        up_stream,
                        window: initial,
                        request_ended: end_stream,
                        unacked: 0,
                    },
                );
                self.touch(&up);
            }
            Err(lease) => {
                self.pool.finish(lease, Outcome::Cancelled, now);
                self.refuse(stream, ErrorCode::REFUSED_STREAM);
            }
        }
        Ok(())
    }

    /// Request trailers (a second header block on an open stream).
    fn trailers(&mut self, stream: u32, end_stream: bool, now: Instant) -> Result<(), ErrorCode> {
        if !end_stream {
            return Err(ErrorCode::PROTOCOL_ERROR);
        }
        let target = {
            let mut state = self.shared.lock();
            match state.streams.get_mut(&stream) {
                Some(s) if !s.request_ended => {
                    s.request_ended = true;
                    Some((s.up.clone(), s.up_stream))
                }
                _ => None,
            }
        };
        let Some((up, up_stream)) = target else {
            return Ok(());
        };
        {
            let mut u = up.lock();
            let u = &mut *u;
            u.put_trailers(up_stream, &self.fields);
        }
        self.touch(&up);
        let _ = now;
        Ok(())
    }

    fn data(&mut self, stream: u32, data: &[u8], flow_len: usize, end_stream: bool, now: Instant) {
        self.unacked += flow_len as u32;
        let target = {
            let mut state = self.shared.lock();
            if self.unacked >= CONNECTION_WINDOW / 2 {
                WindowUpdate {
                    stream_id: 0,
                    increment: std::mem::take(&mut self.unacked),
                }
                .encode(&mut state.out.buf);
            }
            let st = &mut *state;
            match st.streams.get_mut(&stream) {
                Some(s) if !s.request_ended => {
                    s.request_ended = end_stream;
                    s.unacked += flow_len as u32;
                    if !end_stream && s.unacked >= STREAM_WINDOW / 2 {
                        let increment = std::mem::take(&mut s.unacked);
                        WindowUpdate {
                            stream_id: stream,
                            increment,
                        }
                        .encode(&mut st.out.buf);
                    }
                    Some((s.up.clone(), s.up_stream))
                }
                _ => None,
            }
        };
        let Some((up, up_stream)) = target else {
            return;
        };
        let sent = up.lock().data(up_stream, data, end_stream);
        self.touch(&up);
        if !sent {
            tracing::debug!(stream, "request data does not fit the upstream's window");
            self.cancel(stream, now);
            self.refuse(stream, ErrorCode::INTERNAL_ERROR);
        }
    }

    /// The client reset `stream`, or it must go: reset the upstream stream.
    fn cancel(&mut self, stream: u32, now: Instant) {
        let Some(s) = self.shared.lock().streams.remove(&stream) else {
            return;
        };
        let lease = s.up.lock().cancel(s.up_stream, ErrorCode::CANCEL);
        self.touch(&s.up);
        if let Some(lease) = lease {
            self.pool.finish(lease, Outcome::Cancelled, now);
        }
    }

    fn refuse(&mut self, stream: u32, code: ErrorCode) {
        let mut state = self.shared.lock();
        state.streams.remove(&stream);
        RstStream {
            stream_id: stream,
            error_code: code,
        }
        .encode(&mut state.out.buf);
    }

    /// The connection is over: every stream still open is cancelled upstream.
    fn close(&mut self) {
        let streams: Vec<ClientStream> =
            self.shared.lock().streams.drain().map(|(_, s)| s).collect();
        let now = Instant::now();
        for s in streams {
            let lease = s.up.lock().cancel(s.up_stream, ErrorCode::CANCEL);
            s.up.flush();
            if let Some(lease) = lease {
                self.pool.finish(lease, Outcome::Cancelled, now);
            }
        }
        self.shared.close();
    }
}
