//! The relay's view of one connection: which streams are open, where the rotation stands, and
//! the frames the relay itself sends. Pure state, no I/O: `Pipe` feeds it frame headers (and
//! the payloads of the control frames it needs) and writes what it queues.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use skewless_frame::{
    DEFAULT_MAX_FRAME_SIZE, ErrorCode, FrameError, GoAway, Head, Kind, MAX_STREAM_ID, Ping,
    RstStream, SettingId, Settings, WindowUpdate,
};

use tokio::time::Instant;

use super::{RotationReason, Shared};
use crate::flood::{self, Flood, FloodLimits, FrameBudgets};
use crate::metrics::{ClientErrorReason, FailureReason};

/// Our PING's opaque data: no gRPC server uses it (grpc-go sends 0x0106010800030309, Java a
/// counter), so its ACK is recognised and swallowed, every other ACK is forwarded.
pub(super) const OUR_PING: [u8; 8] = *b"skwl\x00rot";

/// The opaque data of the PING that starts a quiesce (see [`Phase::Quiescing`]).
pub(super) const OUR_QUIESCE_PING: [u8; 8] = *b"skwl\x00qui";

/// The opaque data of our last PING before the final GOAWAY, the one that shows the client
/// has written everything it had queued (see [`Conn::settle_step`]).
pub(super) const OUR_QUIET_PING: [u8; 8] = *b"skwl\x00fin";

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
            Self::Flood(Flood::Ping) => ClientErrorReason::PingFlood,
            Self::Flood(Flood::Settings) => ClientErrorReason::SettingsFlood,
            Self::Flood(Flood::RstStream) => ClientErrorReason::RstStreamFlood,
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

    fn go_away(&mut self, last_stream_id: u32) {
        GoAway {
            last_stream_id,
            error_code: ErrorCode::NO_ERROR,
            debug_data: b"",
        }
        .encode(&mut self.buf);
    }
}

/// Where a rotation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Open,
    /// A client that writes its requests lazily is being rotated: our quiesce PING is sent and
    /// no frame of the backend's goes to the client until its ACK (or the quiesce timeout).
    ///
    /// nghttp2 (Node's http2, under grpc-js) gives a request its stream id and writes its
    /// HEADERS only when it next sends, and once any GOAWAY has been received it refuses every
    /// request not written yet, GOAWAY(2^31-1) included; grpc-js retries such a call only
    /// while it fits its retry buffer, so a large one fails. Node answers a PING in its next
    /// send, and one send writes everything nghttp2 has queued (the ACK first, then the
    /// HEADERS of new requests). Holding the backend's frames from our PING until its ACK means
    /// that when the ACK comes, every request the client made in reaction to a frame it read
    /// is written; GOAWAY(2^31-1) then goes out before any later frame that could make it
    /// start another. A request started from a timer (not in reaction to a frame) can still
    /// meet the GOAWAY unwritten.
    Quiescing,
    /// GOAWAY(2^31-1) and our PING sent; waiting for its ACK or the timeout.
    Announced,
    /// The ACK came: the client has read GOAWAY(2^31-1) and opens no new stream, but streams
    /// it had already created may still be on their way (a client may write the ACK ahead
    /// of them). Every stream is still relayed; the final GOAWAY waits until the client is
    /// quiet (see [`Conn::settle_step`]).
    Settling,
    /// The final GOAWAY sent: streams above its last-stream-id are refused.
    Final,
}

/// Settling: the check that the client has no stream it created and has not written yet (see
/// [`Conn::settle_step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    /// Nothing of ours in flight: the check starts when the client is quiet.
    Idle,
    /// Our empty SETTINGS is out; `highest` and `acks` (the client's PING ACKs so far) as
    /// when it was sent.
    Settings { highest: u32, acks: u32 },
    /// Its ACK came in a write with no PING ACK; our quiet PING is out, sent at `highest`.
    Ping { highest: u32 },
}

/// Per open stream: which sides have ended it.
const CLIENT_ENDED: u8 = 1;
const BACKEND_ENDED: u8 = 2;

pub(super) struct Conn {
    shared: std::sync::Arc<Shared>,
    max_streams: usize,
    /// The client's frame budgets: the relay forwards each PING, SETTINGS and RST_STREAM to
    /// the backend, so a client that floods them is cut off as request mode cuts it off.
    budgets: FrameBudgets,
    /// Per open stream: which sides ended it, and when the client opened it.
    streams: HashMap<u32, (u8, Instant)>,
    /// Open streams the client has not ended yet (it may still send on them).
    client_open: usize,
    highest_client: u32,
    /// Lowest last-stream-id any GOAWAY to the client carried (ours or the backend's).
    go_last: Option<u32>,
    /// Our final GOAWAY's last-stream-id: client streams above it are refused.
    refuse_above: Option<u32>,
    pub(super) phase: Phase,
    pub(super) reason: Option<RotationReason>,
    /// Our PING's ACK arrived (taken by the run loop).
    pub(super) ping_acked: bool,
    /// Our quiesce PING's ACK arrived (taken by the run loop).
    pub(super) quiesce_acked: bool,
    /// Settling: where the check for unwritten streams stands.
    check: Check,
    /// The quiet PING's ACK arrived (taken by [`Conn::settle_step`]).
    quiet_acked: bool,
    /// Our SETTINGS' ACK arrived (taken by [`Conn::settle_step`]).
    settings_acked: bool,
    /// The backend's SETTINGS frames the client has not acknowledged yet (it acknowledges in
    /// the order it received them).
    backend_settings: u32,
    /// Our SETTINGS is out, behind this many of the backend's: the client ACK that is ours.
    ours_behind: Option<u32>,
    /// PING ACKs the client sent (wrapping): a write that carries one carries no stream.
    client_ping_acks: u32,
    /// PINGs (not ACKs) the client sent (wrapping): keepalives, for the idle check.
    pub(super) client_pings: u32,
    /// When the final GOAWAY went out (for the refusal's trace line).
    final_at: Option<Instant>,
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
            max_streams,
            budgets: FrameBudgets::new(FloodLimits::default(), Instant::now()),
            streams: HashMap::new(),
            client_open: 0,
            highest_client: 0,
            go_last: None,
            refuse_above: None,
            phase: Phase::Open,
            reason: None,
            ping_acked: false,
            quiesce_acked: false,
            check: Check::Idle,
            quiet_acked: false,
            settings_acked: false,
            backend_settings: 0,
            ours_behind: None,
            client_ping_acks: 0,
            client_pings: 0,
            final_at: None,
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

    fn refused(&self, stream_id: u32) -> bool {
        stream_id % 2 == 1 && self.refuse_above.is_some_and(|last| stream_id > last)
    }

    fn end(&mut self, stream_id: u32, side: u8) {
        if let Some((flags, opened)) = self.streams.get_mut(&stream_id) {
            if side == CLIENT_ENDED && *flags & CLIENT_ENDED == 0 {
                self.client_open -= 1;
            }
            *flags |= side;
            if *flags == CLIENT_ENDED | BACKEND_ENDED {
                let opened = *opened;
                self.streams.remove(&stream_id);
                self.set_open();
                self.record(opened, None);
            }
        }
    }

    /// A stream was reset: by the client (a cancellation), by the backend (`failure`: what
    /// the call failed of), or by us.
    fn reset(&mut self, stream_id: u32, failure: Option<FailureReason>) {
        if let Some((flags, opened)) = self.streams.remove(&stream_id) {
            if flags & CLIENT_ENDED == 0 {
                self.client_open -= 1;
            }
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
            Kind::Data if self.refused(id) => {
                self.to_client.owe(head.len);
                Action::Drop
            }
            Kind::Data => {
                if head.is_end_stream() {
                    self.end(id, CLIENT_ENDED);
                }
                Action::Pass
            }
            Kind::Headers => {
                if id == 0 {
                    return Err(ProtocolError::HeadersOnStreamZero);
                }
                if id % 2 == 1 && id > self.highest_client {
                    self.open(id, head.is_end_stream())?;
                } else if head.is_end_stream() {
                    self.end(id, CLIENT_ENDED);
                }
                Action::Pass
            }
            Kind::RstStream => {
                let rst = RstStream::decode(head, payload)?;
                if self.refused(rst.stream_id) {
                    if rst.stream_id > self.highest_client {
                        // A stream the client had created but not yet sent when the final
                        // GOAWAY came: the call failed or was retried client-side.
                        tracing::debug!(
                            stream_id = rst.stream_id,
                            last = self.refuse_above,
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
                    // The client acknowledges SETTINGS in the order it read them.
                    match self.ours_behind {
                        Some(0) => {
                            self.ours_behind = None;
                            self.settings_acked = true;
                            return Ok(Action::Drop);
                        }
                        Some(n) => self.ours_behind = Some(n - 1),
                        None => {}
                    }
                    self.backend_settings = self.backend_settings.saturating_sub(1);
                } else if let Some(max) = s.get(SettingId::MAX_FRAME_SIZE) {
                    self.backend_max_frame = self.backend_max_frame.max(max);
                }
                Action::Forward
            }
            Kind::Ping => {
                let ping = Ping::decode(head, payload)?;
                if ping.ack {
                    self.client_ping_acks = self.client_ping_acks.wrapping_add(1);
                } else {
                    self.client_pings = self.client_pings.wrapping_add(1);
                }
                if ping.ack && ping.opaque == OUR_PING {
                    self.ping_acked = true;
                    Action::Drop
                } else if ping.ack && ping.opaque == OUR_QUIESCE_PING {
                    self.quiesce_acked = true;
                    Action::Drop
                } else if ping.ack && ping.opaque == OUR_QUIET_PING {
                    self.quiet_acked = true;
                    Action::Drop
                } else {
                    Action::Forward
                }
            }
            Kind::GoAway => {
                let g = go_away_prefix(head, payload)?;
                if self.phase != Phase::Open && g.error_code == ErrorCode::NO_ERROR {
                    // The client's graceful close in answer to ours (Node's http2 closes its
                    // session on a NO_ERROR GOAWAY, and close() sends one): the relay ends
                    // the backend's side itself, with FIN once every stream is done and what
                    // the backend sent is delivered. Forwarded, it made an h2 backend close
                    // as soon as its last stream was written, with the end of that response
                    // still on its way to a slow client and the client's WINDOW_UPDATEs for
                    // it then meeting a closed socket (RST). No GOAWAY reaches the backend
                    // while its streams are open (issue 13).
                    tracing::debug!(
                        last = g.last_stream_id,
                        phase = ?self.phase,
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
        self.highest_client = id;
        if self.refused(id) {
            // The backend's HPACK decoder still gets the HEADERS (forwarded), then a cancel;
            // the client learns it was not processed and may retry it elsewhere.
            self.to_backend.rst(id, ErrorCode::CANCEL);
            self.to_client.rst(id, ErrorCode::REFUSED_STREAM);
            self.shared.stats.refused.fetch_add(1, Ordering::Relaxed);
            let since_final_ms = self.final_at.map_or(0, |t| {
                u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)
            });
            tracing::debug!(
                stream_id = id,
                last = self.refuse_above,
                since_final_ms,
                "stream above the final GOAWAY refused"
            );
            return Ok(());
        }
        if self.go_last.is_some_and(|last| id > last) {
            // Above a GOAWAY the backend sent: the backend ignores or refuses it itself.
            return Ok(());
        }
        if self.streams.len() >= self.max_streams {
            return Err(ProtocolError::TooManyStreams {
                max: self.max_streams,
            });
        }
        self.streams.insert(
            id,
            (if end_stream { CLIENT_ENDED } else { 0 }, Instant::now()),
        );
        if !end_stream {
            self.client_open += 1;
        }
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
            Kind::Data if self.refused(id) => {
                self.to_backend.owe(head.len);
                Action::Drop
            }
            Kind::Data | Kind::Headers => {
                if head.is_end_stream() {
                    self.end(id, BACKEND_ENDED);
                }
                Action::Pass
            }
            Kind::RstStream => {
                let rst = RstStream::decode(head, payload)?;
                if self.refused(rst.stream_id) {
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
                    self.backend_settings = self.backend_settings.saturating_add(1);
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
                let last = match self.go_last {
                    // Never let the client see a last-stream-id rise.
                    Some(sent) if sent < g.last_stream_id => {
                        payload[..4].copy_from_slice(&sent.to_be_bytes());
                        sent
                    }
                    _ => g.last_stream_id,
                };
                self.go_last = Some(last);
                // Streams above it will not be processed by the backend, and the client
                // knows (it retries them): they are no longer ours to wait for, and neither
                // timed nor failed calls.
                let before = self.streams.len();
                self.streams.retain(|&s, _| s <= last);
                if self.streams.len() != before {
                    self.client_open = self
                        .streams
                        .values()
                        .filter(|(flags, _)| flags & CLIENT_ENDED == 0)
                        .count();
                    self.set_open();
                }
                Action::Forward
            }
            _ => Action::Pass,
        })
    }

    /// A rotation starts: with the quiesce (see [`Phase::Quiescing`]) for a client that writes
    /// its requests lazily, or may (its user-agent is not known), and has had no GOAWAY yet;
    /// else at once with step 1
    /// ([`Conn::announce`]). Returns whether step 1 went out.
    pub(super) fn rotate(&mut self, reason: RotationReason) -> bool {
        if self.phase != Phase::Open {
            return false;
        }
        self.reason = Some(reason);
        self.shared
            .stats
            .rotating
            .store(super::reason_code(reason), Ordering::Relaxed);
        // Also while the verdict is unknown (not decoded yet, or the decoding timed out): a
        // quiesce costs a client that writes eagerly one PING round trip, a lazy one none.
        let stats = &self.shared.stats;
        if (stats.lazy_requests() || !stats.user_agent_known()) && self.go_last.is_none() {
            self.phase = Phase::Quiescing;
            Ping {
                ack: false,
                opaque: OUR_QUIESCE_PING,
            }
            .encode(&mut self.to_client.buf);
            return false;
        }
        self.announce();
        true
    }

    /// Whether frames from `side` are held now (see [`Phase::Quiescing`]).
    pub(super) fn withholds(&self, side: Side) -> bool {
        side == Side::Backend && self.phase == Phase::Quiescing
    }

    /// Step 1 of a rotation: GOAWAY(2^31-1) (unless a GOAWAY already went to the client) and
    /// our PING; after the quiesce, ahead of the frames it held.
    pub(super) fn announce(&mut self) {
        if !matches!(self.phase, Phase::Open | Phase::Quiescing) {
            return;
        }
        self.phase = Phase::Announced;
        if self.go_last.is_none() {
            self.to_client.go_away(MAX_STREAM_ID);
            self.go_last = Some(MAX_STREAM_ID);
        }
        Ping {
            ack: false,
            opaque: OUR_PING,
        }
        .encode(&mut self.to_client.buf);
    }

    /// Our PING's ACK came: the client has read GOAWAY(2^31-1). Settle until it is quiet
    /// (see [`Conn::settle_step`]).
    pub(super) fn settle(&mut self) {
        if self.phase == Phase::Announced {
            self.phase = Phase::Settling;
        }
    }

    /// Settling, called after every round of I/O: sends the final GOAWAY once the client has
    /// shown it has no stream left to write, else the next frame of that check. Returns
    /// whether a frame was queued.
    ///
    /// The PING's ACK proves the client read GOAWAY(2^31-1), so it creates no stream any
    /// more, but not that every stream it created before has reached us. grpc-core (its
    /// `writing.cc`) writes the streams' frames only in a write that carries no PING ACK: a
    /// write with an ACK is cut to the ACK and the connection's control frames. A stream it
    /// created just before it read the GOAWAY may so come one or several writes after the
    /// ACK, and after any number of further ACKs if PINGs keep coming (two quiet PINGs, the
    /// previous rule, relied on the client starting its next write before it read the
    /// second one). A final GOAWAY below such a stream makes the client fail or retry a call
    /// it had sent (grpc-core cannot retry one larger than its retry buffer, 256 KiB).
    ///
    /// So once the client is quiet (it has ended every open stream: nothing of its own is
    /// left to write ahead of a new stream's HEADERS), the relay sends an empty SETTINGS.
    /// The client's ACK of it goes in a write that also writes every stream it has queued;
    /// if no PING ACK came between our SETTINGS and its ACK, that write was not cut. Then our
    /// quiet PING: its ACK comes in a later write, so once it is here that whole write is
    /// too. The client quiet throughout with no new stream: the final GOAWAY names the
    /// highest stream it opened. Otherwise the check starts over when it is quiet again; a
    /// client that never goes quiet meets the settle deadline instead (the run loop's, half
    /// the drain grace).
    pub(super) fn settle_step(&mut self) -> bool {
        if self.phase != Phase::Settling {
            return false;
        }
        if self.go_last.is_some_and(|sent| sent <= self.highest_client) {
            // A GOAWAY of the backend's already said as much as ours would: nothing to wait for.
            self.finalize();
            return !self.to_client.is_empty();
        }
        let quiet = self.client_open == 0 && self.client_block.is_none();
        match self.check {
            Check::Settings { highest, acks } if std::mem::take(&mut self.settings_acked) => {
                if quiet && highest == self.highest_client && acks == self.client_ping_acks {
                    self.check = Check::Ping { highest };
                    self.quiet_acked = false;
                    Ping {
                        ack: false,
                        opaque: OUR_QUIET_PING,
                    }
                    .encode(&mut self.to_client.buf);
                    return true;
                }
                self.check = Check::Idle;
            }
            Check::Ping { highest } if std::mem::take(&mut self.quiet_acked) => {
                if quiet && highest == self.highest_client {
                    tracing::debug!(last = highest, "client quiet, final GOAWAY");
                    self.finalize();
                    return !self.to_client.is_empty();
                }
                self.check = Check::Idle;
            }
            _ => {}
        }
        if quiet && self.check == Check::Idle {
            self.check = Check::Settings {
                highest: self.highest_client,
                acks: self.client_ping_acks,
            };
            self.settings_acked = false;
            self.ours_behind = Some(self.backend_settings);
            Settings::encode(false, &[], &mut self.to_client.buf);
            return true;
        }
        false
    }

    /// Step 2: the final GOAWAY with the highest stream id the client opened (never above one
    /// already sent); later client streams are refused.
    pub(super) fn finalize(&mut self) {
        if self.phase == Phase::Final {
            return;
        }
        self.phase = Phase::Final;
        self.final_at = Some(Instant::now());
        let last = self
            .go_last
            .map_or(self.highest_client, |sent| sent.min(self.highest_client));
        if self.go_last != Some(last) {
            self.to_client.go_away(last);
            self.go_last = Some(last);
        }
        self.refuse_above = Some(last);
    }

    /// The drain grace is over: every stream still open is reset both ways.
    pub(super) fn reset_all(&mut self) -> u32 {
        self.finalize();
        let mut ids: Vec<u32> = self.streams.keys().copied().collect();
        ids.sort_unstable();
        for &id in &ids {
            self.to_client.rst(id, ErrorCode::CANCEL);
            self.to_backend.rst(id, ErrorCode::CANCEL);
        }
        // Cut by the drain: each was a call that failed.
        for (_, (_, opened)) in std::mem::take(&mut self.streams) {
            self.record(opened, Some(FailureReason::Reset));
        }
        self.client_open = 0;
        self.set_open();
        u32::try_from(ids.len()).unwrap_or(u32::MAX)
    }

    /// The relay ended with streams still open: each is over now. One lost with the backend
    /// (an error on the backend's side, or the backend closed first) is a failed call,
    /// `Connect` as in request mode (the upstream connection failed under it); one the client
    /// walked away from is not.
    pub(super) fn abandon(&mut self, backend_lost: bool) {
        let failure = backend_lost.then_some(FailureReason::Connect);
        for (_, (_, opened)) in std::mem::take(&mut self.streams) {
            self.record(opened, failure);
        }
        self.client_open = 0;
        self.set_open();
    }

    /// A GOAWAY with `code` for a client that broke the protocol: its last-stream-id is the
    /// highest stream the client opened (never above one already sent).
    pub(super) fn error_go_away(&self, code: ErrorCode) -> Vec<u8> {
        let last = self
            .go_last
            .map_or(self.highest_client, |sent| sent.min(self.highest_client));
        let mut buf = Vec::with_capacity(skewless_frame::HEADER_LEN + 8);
        GoAway {
            last_stream_id: last,
            error_code: code,
            debug_data: b"",
        }
        .encode(&mut buf);
        buf
    }

    /// Client bytes to keep for the user-agent check: the first header block.
    pub(super) fn first_block_done(&self) -> bool {
        self.highest_client > 0 && self.client_block.is_none()
    }
}
