//! The relay's view of one connection: every frame header (and the payload of the control
//! frames it needs) goes by [`Conn::on_frame`], which checks the header-block framing and the
//! client's frame budgets, keeps the stream table ([`Streams`]) and the rotation
//! ([`Rotation`]) up to date, and says whether the frame is forwarded, streamed through or
//! dropped. The frames the relay sends itself wait in one [`Out`] per peer. Pure state, no
//! I/O: `Pipe` feeds it and writes what it queues.

use std::sync::atomic::Ordering;

use skewless_frame::{
    DEFAULT_MAX_FRAME_SIZE, ErrorCode, FrameError, GoAway, Head, Kind, MAX_STREAM_ID, Ping,
    RstStream, SettingId, Settings, WindowUpdate,
};

use tokio::time::Instant;

use super::rotation::{Ack, Phase, Rotation};
use super::streams::Streams;
use super::{RotationReason, Shared};
use crate::flood::{self, Flood, FloodLimits, FrameBudgets};
use crate::metrics::{ClientErrorReason, FailureReason};

/// Decodes the fixed part of a GOAWAY from the first `min(len, 8)` payload bytes (its debug
/// data streams through unread).
fn go_away_prefix<'a>(head: &Head, payload: &'a [u8]) -> Result<GoAway<'a>, FrameError> {
    match payload.get(..8) {
        Some(fixed) => GoAway::decode(&Head { len: 8, ..*head }, fixed),
        // Shorter than 8 bytes: the decoder's length error.
        None => GoAway::decode(head, payload),
    }
}

/// Which peer a frame came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Client,
    Backend,
}

/// What to do with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    /// Forward the whole frame (its payload is in the buffer and may have been rewritten).
    Forward,
    /// Forward the header and stream the payload through as it arrives.
    Pass,
    /// Remove the frame from the stream.
    Drop,
}

/// A protocol violation by one peer; it ends that connection (both sides of it).
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("malformed frame")]
    Frame(#[source] FrameError),
    #[error("a {kind:?} frame inside the header block of stream {stream_id}")]
    InsideHeaderBlock { kind: Kind, stream_id: u32 },
    #[error("a CONTINUATION frame outside a header block")]
    StrayContinuation,
    #[error("a frame of {len} bytes the relay must read whole, above its buffer")]
    ControlFrameTooLarge { len: u32 },
    #[error("more than {max} open streams")]
    TooManyStreams { max: usize },
    #[error("HEADERS on stream 0")]
    HeadersOnStreamZero,
    /// The client emptied a frame budget (see `budget`): more PINGs, SETTINGS or
    /// RST_STREAMs than the relay carries.
    #[error("the client flooded the connection")]
    Flood(#[source] Flood),
    /// The client sent no connection preface and SETTINGS within the handshake timeout.
    #[error("no HTTP/2 preface within {0:?}")]
    NoPreface(std::time::Duration),
}

impl ProtocolError {
    /// What the client did, as the `client_protocol_errors` label.
    #[must_use]
    pub fn client_error_reason(&self) -> ClientErrorReason {
        match self {
            Self::NoPreface(_) => ClientErrorReason::NoPreface,
            Self::Flood(flood) => flood.client_error_reason(),
            Self::TooManyStreams { .. } => ClientErrorReason::TooManyStreams,
            Self::Frame(_)
            | Self::InsideHeaderBlock { .. }
            | Self::StrayContinuation
            | Self::ControlFrameTooLarge { .. }
            | Self::HeadersOnStreamZero => ClientErrorReason::Malformed,
        }
    }

    /// The error code of the GOAWAY the relay sends a client that spoke HTTP/2 before it broke
    /// it: ENHANCE_YOUR_CALM for abuse, PROTOCOL_ERROR otherwise (RFC 9113 section 5.4.1).
    pub(super) fn go_away_code(&self) -> ErrorCode {
        match self {
            Self::Flood(_) | Self::TooManyStreams { .. } => ErrorCode::ENHANCE_YOUR_CALM,
            Self::Frame(FrameError::TooLarge { .. }) => ErrorCode::FRAME_SIZE_ERROR,
            _ => ErrorCode::PROTOCOL_ERROR,
        }
    }
}

impl From<FrameError> for ProtocolError {
    fn from(e: FrameError) -> Self {
        Self::Frame(e)
    }
}

/// Frames the relay sends to one peer, written at the next point where that is allowed.
#[derive(Debug, Default)]
pub(super) struct Out {
    pub(super) buf: Vec<u8>,
    /// Connection-level flow-control credit owed for DATA the relay dropped, sent as one
    /// WINDOW_UPDATE (so a flood of dropped frames queues nothing).
    owed_window: u32,
}

impl Out {
    pub(super) fn is_empty(&self) -> bool {
        self.buf.is_empty() && self.owed_window == 0
    }

    /// Moves the owed window credit into the buffer, ready to write.
    pub(super) fn settle(&mut self) {
        if self.owed_window > 0 {
            WindowUpdate {
                stream_id: 0,
                increment: self.owed_window,
            }
            .encode(&mut self.buf);
            self.owed_window = 0;
        }
    }

    fn owe(&mut self, len: u32) {
        self.owed_window = self.owed_window.saturating_add(len).min(MAX_STREAM_ID);
    }

    fn rst(&mut self, stream_id: u32, error_code: ErrorCode) {
        RstStream {
            stream_id,
            error_code,
        }
        .encode(&mut self.buf);
    }

    pub(super) fn go_away(&mut self, last_stream_id: u32, error_code: ErrorCode) {
        GoAway {
            last_stream_id,
            error_code,
            debug_data: b"",
        }
        .encode(&mut self.buf);
    }

    pub(super) fn ping(&mut self, opaque: [u8; 8]) {
        Ping { ack: false, opaque }.encode(&mut self.buf);
    }
}

pub(super) struct Conn {
    shared: std::sync::Arc<Shared>,
    /// The client's frame budgets: the relay forwards each PING, SETTINGS and RST_STREAM to
    /// the backend, so a client that floods them is cut off as request mode cuts it off.
    budgets: FrameBudgets,
    pub(super) streams: Streams,
    pub(super) rotation: Rotation,
    /// PINGs (not ACKs) the client sent (wrapping): keepalives, for the idle check.
    pub(super) client_pings: u32,
    /// Header block open in each direction (stream id).
    pub(super) client_block: Option<u32>,
    pub(super) backend_block: Option<u32>,
    /// Largest frame each side may send: the other side's advertised SETTINGS_MAX_FRAME_SIZE
    /// (the largest it ever advertised, as frames sent before a lowering may still come).
    pub(super) client_max_frame: u32,
    pub(super) backend_max_frame: u32,
    /// Frames for each peer.
    pub(super) to_client: Out,
    pub(super) to_backend: Out,
    /// The backend's first frame reached the client: frames of ours may follow it.
    pub(super) backend_started: bool,
}

impl Conn {
    pub(super) fn new(shared: std::sync::Arc<Shared>, max_streams: usize) -> Self {
        Self {
            shared,
            budgets: FrameBudgets::new(FloodLimits::default(), Instant::now()),
            streams: Streams::new(max_streams),
            rotation: Rotation::new(),
            client_pings: 0,
            client_block: None,
            backend_block: None,
            client_max_frame: DEFAULT_MAX_FRAME_SIZE,
            backend_max_frame: DEFAULT_MAX_FRAME_SIZE,
            to_client: Out::default(),
            to_backend: Out::default(),
            backend_started: false,
        }
    }

    pub(super) fn open_streams(&self) -> usize {
        self.streams.len()
    }

    fn set_open(&self) {
        let n = u32::try_from(self.streams.len()).unwrap_or(u32::MAX);
        self.shared.stats.open_streams.store(n, Ordering::Relaxed);
    }

    /// Payload bytes that must be in the buffer before [`Conn::on_frame`] can decide.
    pub(super) fn needs(head: &Head) -> usize {
        match head.kind {
            Kind::Settings | Kind::Ping | Kind::RstStream => head.len as usize,
            Kind::GoAway => (head.len as usize).min(8),
            _ => 0,
        }
    }

    /// `side` ended stream `id`: recorded once both sides did.
    fn end(&mut self, id: u32, side: Side) {
        if let Some(opened) = self.streams.end(id, side) {
            self.set_open();
            self.record(opened, None);
        }
    }

    /// A stream was reset: by the client (a cancellation), by the backend (`failure`: what
    /// the call failed of), or by us.
    fn reset(&mut self, id: u32, failure: Option<FailureReason>) {
        if let Some(opened) = self.streams.reset(id) {
            self.set_open();
            self.record(opened, failure);
        }
    }

    /// A stream is over: its duration into the Service's histogram, where its load on the
    /// backend completes (as in request mode), and its failure if it failed. The relay sees
    /// frames, not gRPC statuses (they are HPACK-encoded): a stream that ended with
    /// END_STREAM both ways is not a failure here whatever its grpc-status said.
    fn record(&self, opened: Instant, failure: Option<FailureReason>) {
        if let Some(m) = &self.shared.metrics {
            m.latency.record(opened.elapsed());
            if let Some(reason) = failure {
                m.failed(reason);
            }
        }
    }

    /// Checks header-block framing: inside a block only its CONTINUATION may come.
    fn block(block: &mut Option<u32>, head: &Head) -> Result<(), ProtocolError> {
        match (*block, head.kind) {
            (Some(id), Kind::Continuation) if id == head.stream_id => {
                if head.is_end_headers() {
                    *block = None;
                }
                Ok(())
            }
            (Some(stream_id), kind) => Err(ProtocolError::InsideHeaderBlock { kind, stream_id }),
            (None, Kind::Continuation) => Err(ProtocolError::StrayContinuation),
            (None, Kind::Headers | Kind::PushPromise) => {
                if !head.is_end_headers() {
                    *block = Some(head.stream_id);
                }
                Ok(())
            }
            (None, _) => Ok(()),
        }
    }

    /// Decides what to do with a frame from `side` whose header is `head`; `payload` holds at
    /// least [`Conn::needs`] bytes of its payload (rewritable in place).
    pub(super) fn on_frame(
        &mut self,
        side: Side,
        head: &Head,
        payload: &mut [u8],
    ) -> Result<Action, ProtocolError> {
        match side {
            Side::Client => {
                Self::block(&mut self.client_block, head)?;
                if flood::budgeted(head)
                    && let Some(flood) = self.budgets.spend(head, Instant::now())
                {
                    return Err(ProtocolError::Flood(flood));
                }
                self.on_client_frame(head, payload)
            }
            Side::Backend => {
                Self::block(&mut self.backend_block, head)?;
                self.on_backend_frame(head, payload)
            }
        }
    }

    fn on_client_frame(
        &mut self,
        head: &Head,
        payload: &mut [u8],
    ) -> Result<Action, ProtocolError> {
        let id = head.stream_id;
        Ok(match head.kind {
            Kind::Data if self.rotation.refused(id) => {
                self.to_client.owe(head.len);
                Action::Drop
            }
            Kind::Data => {
                if head.is_end_stream() {
                    self.end(id, Side::Client);
                }
                Action::Pass
            }
            Kind::Headers => {
                if id == 0 {
                    return Err(ProtocolError::HeadersOnStreamZero);
                }
                if self.streams.is_new_client_stream(id) {
                    self.open(id, head.is_end_stream())?;
                } else if head.is_end_stream() {
                    self.end(id, Side::Client);
                }
                Action::Pass
            }
            Kind::RstStream => {
                let rst = RstStream::decode(head, payload)?;
                if self.rotation.refused(rst.stream_id) {
                    if rst.stream_id > self.streams.highest_client() {
                        // A stream the client had created but not yet sent when the final
                        // GOAWAY came: the call failed or was retried client-side.
                        tracing::debug!(
                            stream_id = rst.stream_id,
                            last = self.rotation.refuse_above(),
                            "client reset an unsent stream above the final GOAWAY"
                        );
                    }
                    Action::Drop
                } else {
                    // The client cancelled: not a failure.
                    self.reset(rst.stream_id, None);
                    Action::Forward
                }
            }
            Kind::Settings => {
                let s = Settings::decode(head, payload)?;
                if s.ack {
                    if self.rotation.client_settings_ack() == Ack::Ours {
                        return Ok(Action::Drop);
                    }
                } else if let Some(max) = s.get(SettingId::MAX_FRAME_SIZE) {
                    self.backend_max_frame = self.backend_max_frame.max(max);
                }
                Action::Forward
            }
            Kind::Ping => {
                let ping = Ping::decode(head, payload)?;
                if !ping.ack {
                    self.client_pings = self.client_pings.wrapping_add(1);
                }
                if ping.ack && self.rotation.client_ping_ack(ping.opaque) == Ack::Ours {
                    Action::Drop
                } else {
                    Action::Forward
                }
            }
            Kind::GoAway => {
                let g = go_away_prefix(head, payload)?;
                if self.rotation.swallows_client_go_away(g.error_code) {
                    // The client's graceful close in answer to ours (Node's http2 closes its
                    // session on a NO_ERROR GOAWAY, and close() sends one): the relay ends
                    // the backend's side itself, with FIN once every stream is done and what
                    // the backend sent is delivered. Forwarded, it made an h2 backend close
                    // as soon as its last stream was written, with the end of that response
                    // still on its way to a slow client and the client's WINDOW_UPDATEs for
                    // it then meeting a closed socket (RST). No GOAWAY reaches the backend
                    // while its streams are open.
                    tracing::debug!(
                        last = g.last_stream_id,
                        phase = ?self.rotation.phase,
                        open = self.streams.len(),
                        "client GOAWAY during a rotation, not forwarded"
                    );
                    Action::Drop
                } else {
                    Action::Forward
                }
            }
            _ => Action::Pass,
        })
    }

    /// A client stream `id` opens with its HEADERS.
    fn open(&mut self, id: u32, end_stream: bool) -> Result<(), ProtocolError> {
        if self.rotation.refused(id) {
            self.streams.skip(id);
            // The backend's HPACK decoder still gets the HEADERS (forwarded), then a cancel;
            // the client learns it was not processed and may retry it elsewhere.
            self.to_backend.rst(id, ErrorCode::CANCEL);
            self.to_client.rst(id, ErrorCode::REFUSED_STREAM);
            self.shared.stats.refused.fetch_add(1, Ordering::Relaxed);
            let since_final_ms =
                u64::try_from(self.rotation.since_final().as_millis()).unwrap_or(u64::MAX);
            tracing::debug!(
                stream_id = id,
                last = self.rotation.refuse_above(),
                since_final_ms,
                "stream above the final GOAWAY refused"
            );
            return Ok(());
        }
        if self.rotation.above_go_away(id) {
            // Above a GOAWAY the backend sent: the backend ignores or refuses it itself.
            self.streams.skip(id);
            return Ok(());
        }
        self.streams
            .open(id, end_stream, Instant::now())
            .map_err(|_| ProtocolError::TooManyStreams {
                max: self.streams.max(),
            })?;
        self.shared.stats.requests.fetch_add(1, Ordering::Relaxed);
        self.set_open();
        Ok(())
    }

    fn on_backend_frame(
        &mut self,
        head: &Head,
        payload: &mut [u8],
    ) -> Result<Action, ProtocolError> {
        let id = head.stream_id;
        Ok(match head.kind {
            Kind::Data if self.rotation.refused(id) => {
                self.to_backend.owe(head.len);
                Action::Drop
            }
            Kind::Data | Kind::Headers => {
                if head.is_end_stream() {
                    self.end(id, Side::Backend);
                }
                Action::Pass
            }
            Kind::RstStream => {
                let rst = RstStream::decode(head, payload)?;
                if self.rotation.refused(rst.stream_id) {
                    Action::Drop
                } else {
                    let failure = match rst.error_code {
                        ErrorCode::NO_ERROR => None,
                        ErrorCode::REFUSED_STREAM => Some(FailureReason::Refused),
                        _ => Some(FailureReason::Reset),
                    };
                    self.reset(rst.stream_id, failure);
                    Action::Forward
                }
            }
            Kind::Settings => {
                let s = Settings::decode(head, payload)?;
                if !s.ack {
                    self.rotation.backend_settings();
                }
                if let Some(max) = s.get(SettingId::MAX_FRAME_SIZE) {
                    self.client_max_frame = self.client_max_frame.max(max);
                }
                Action::Forward
            }
            Kind::Ping => {
                Ping::decode(head, payload)?;
                Action::Forward
            }
            Kind::GoAway => {
                let g = go_away_prefix(head, payload)?;
                self.shared
                    .stats
                    .backend_go_away
                    .store(true, Ordering::Relaxed);
                let last = self.rotation.backend_go_away(g.last_stream_id);
                if last != g.last_stream_id {
                    // Never let the client see a last-stream-id rise.
                    payload[..4].copy_from_slice(&last.to_be_bytes());
                }
                if self.streams.forget_above(last) {
                    self.set_open();
                }
                Action::Forward
            }
            _ => Action::Pass,
        })
    }

    /// A rotation starts (see [`Rotation::rotate`]): with the quiesce for a client that writes
    /// its requests lazily, or may (its user-agent is not known). Returns whether step 1 went
    /// out.
    pub(super) fn rotate(&mut self, reason: RotationReason) -> bool {
        if self.rotation.phase != Phase::Open {
            return false;
        }
        self.shared
            .stats
            .rotating
            .store(super::reason_code(reason), Ordering::Relaxed);
        // Also while the verdict is unknown (not decoded yet, or the decoding timed out): a
        // quiesce costs a client that writes eagerly one PING round trip, a lazy one none.
        let stats = &self.shared.stats;
        let quiesce = stats.lazy_requests() || !stats.user_agent_known();
        self.rotation.rotate(reason, quiesce, &mut self.to_client)
    }

    /// Whether frames from `side` are held now (see [`Phase::Quiescing`]).
    pub(super) fn withholds(&self, side: Side) -> bool {
        self.rotation.withholds(side)
    }

    /// Step 1 of a rotation (see [`Rotation::announce`]).
    pub(super) fn announce(&mut self) {
        self.rotation.announce(&mut self.to_client);
    }

    /// Settling, after every round of I/O (see [`Rotation::settle_step`]): whether there is
    /// something to write to the client now.
    pub(super) fn settle_step(&mut self) -> bool {
        let settling = self.rotation.phase == Phase::Settling;
        let quiet = self.streams.client_open() == 0 && self.client_block.is_none();
        let queued =
            self.rotation
                .settle_step(self.streams.highest_client(), quiet, &mut self.to_client);
        if settling && self.rotation.phase == Phase::Final {
            // Final: whatever waits for the client goes out now, ours or not.
            return !self.to_client.is_empty();
        }
        queued
    }

    /// Step 2: the final GOAWAY (see [`Rotation::finalize`]).
    pub(super) fn finalize(&mut self) {
        self.rotation
            .finalize(self.streams.highest_client(), &mut self.to_client);
    }

    /// The drain grace is over: every stream still open is reset both ways.
    pub(super) fn reset_all(&mut self) -> u32 {
        self.finalize();
        let open = self.streams.take_all();
        for &(id, _) in &open {
            self.to_client.rst(id, ErrorCode::CANCEL);
            self.to_backend.rst(id, ErrorCode::CANCEL);
        }
        // Cut by the drain: each was a call that failed.
        for &(_, opened) in &open {
            self.record(opened, Some(FailureReason::Reset));
        }
        self.set_open();
        u32::try_from(open.len()).unwrap_or(u32::MAX)
    }

    /// The relay ended with streams still open: each is over now. One lost with the backend
    /// (an error on the backend's side, or the backend closed first) is a failed call,
    /// `Connect` as in request mode (the upstream connection failed under it); one the client
    /// walked away from is not.
    pub(super) fn abandon(&mut self, backend_lost: bool) {
        let failure = backend_lost.then_some(FailureReason::Connect);
        for (_, opened) in self.streams.take_all() {
            self.record(opened, failure);
        }
        self.set_open();
    }

    /// A GOAWAY with `code` for a client that broke the protocol: its last-stream-id is the
    /// highest stream the client opened (never above one already sent).
    pub(super) fn error_go_away(&self, code: ErrorCode) -> Vec<u8> {
        let mut out = Out {
            buf: Vec::with_capacity(skewless_frame::HEADER_LEN + 8),
            owed_window: 0,
        };
        out.go_away(
            self.rotation.last_stream_id(self.streams.highest_client()),
            code,
        );
        out.buf
    }

    /// Client bytes to keep for the user-agent check: the first header block.
    pub(super) fn first_block_done(&self) -> bool {
        self.streams.highest_client() > 0 && self.client_block.is_none()
    }
}
