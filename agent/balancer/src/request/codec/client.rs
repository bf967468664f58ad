//! One client connection on the frame codec: the server side of its HTTP/2, every request
//! stream opened on an upstream connection as its HEADERS arrive, and the state upstream
//! readers write responses into ([`ClientState`]).

use std::sync::Arc;

use bytes::{Buf as _, BytesMut};
use skewless_frame::{
    ErrorCode, Frames, GoAway, Head, Kind, MAX_STREAM_ID, PREFACE, Ping, RstStream, Setting,
    SettingId, Settings, WindowUpdate, flags,
};
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::fields::{
    self, Fields, HpackDecoder, HpackEncoder, all_token, invalid_field, is_connection_specific,
};
use super::frames::{self, DEFAULT_WINDOW, HeaderBlocks, Held, RecvWindow, SendLimits};
use super::out::{HasOut, Out, Shared};
use super::upstream::{HEADER_TABLE_SIZE, MAX_FRAME, UpShared};
use super::{CodecPool, NoPick, StreamMap};
use crate::flood::{self, FloodLimits, FrameBudgets};
use crate::metrics::{ClientErrorReason, FailureReason, RotationReason};
use crate::request::config::Config;
use crate::request::picker::Outcome;
use crate::request::retry;
use crate::request::status::Counters;
use crate::server::Stop;
use crate::upstream::{CONNECTION_WINDOW, MAX_HEADER_LIST, STREAM_WINDOW};

mod conn;

pub(crate) use conn::serve;

pub(crate) type ClientShared = Shared<ClientState>;

/// Most streams one client connection may have open at once (as on the h2 path).
const MAX_CLIENT_STREAMS: u32 = 1024;
/// How long a new client connection may take to send its HTTP/2 preface and SETTINGS (as on
/// the h2 path).
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// The opaque data of the PING that follows the first GOAWAY of a wind-down: its ACK says the
/// client has seen that GOAWAY.
const WIND_DOWN_PING: [u8; 8] = *b"skewless";
/// The opaque data of the PING of the settling check before the final GOAWAY
/// ([`crate::settle`]).
const SETTLE_PING: [u8; 8] = *b"skwl\x00fin";
/// Largest request body kept to send a request again (as on the h2 path); a larger one is
/// not sent again.
const REPLAY_CAP: usize = 64 * 1024;
/// Copies of requests kept per client connection to be filled again (see
/// [`ClientState::spare`]).
const MAX_SPARE_COPIES: usize = 64;
/// While a connection winds down, how often it looks whether its last stream has ended
/// (streams end on upstream readers' tasks).
const WIND_DOWN_CHECK: std::time::Duration = std::time::Duration::from_millis(20);

/// What upstream readers write responses into.
pub(crate) struct ClientState {
    /// The Service's numbers: every call's duration is recorded as its stream ends.
    metrics: Arc<crate::metrics::ServiceMetrics>,
    out: Out,
    encoder: HpackEncoder,
    streams: StreamMap<ClientStream>,
    /// What may be sent to the client.
    limits: SendLimits,
    /// What the client may still send on the connection: given back as its bytes go
    /// upstream, so a client can make the balancer hold at most this much of its requests.
    recv: RecvWindow,
    /// Streams whose response bytes wait for the client's windows, in the order they began
    /// to wait (ids of streams gone since are skipped).
    waiting: Vec<u32>,
    /// Streams whose request is to be sent to another endpoint (see [`ClientState::retry`])
    /// by the client's reader, which [`ClientState::redispatch`] wakes, and when.
    retries: Vec<(u32, Instant)>,
    redispatch: Arc<tokio::sync::Notify>,
    /// Copies no longer needed (their response began), kept to be filled again: a request's
    /// copy then costs no allocation.
    #[allow(
        clippy::vec_box,
        reason = "the copies move between here and the streams as boxes, never allocated again"
    )]
    spare: Vec<Box<Request>>,
    /// Streams closed here while the client may still send on them (refused, or ended
    /// before their request did), newest last, at most [`MAX_CLOSED_EARLY`]: a header block
    /// on one is ignored, where one on any other stream that is not open is a protocol error.
    closed_early: std::collections::VecDeque<u32>,
}

/// Streams [`ClientState::closed_early`] remembers (h2 remembers the last 50 it reset, for a
/// second).
const MAX_CLOSED_EARLY: usize = 64;

impl HasOut for ClientState {
    fn out(&mut self) -> &mut Out {
        &mut self.out
    }
}

/// What became of response headers for a client stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Responded {
    /// Sent to the client (or held behind its body bytes).
    Sent,
    /// The client stream is gone.
    Gone,
    /// The stream's deadline had passed: the client got DEADLINE_EXCEEDED instead, and the
    /// stream is gone.
    PastDeadline,
}

/// The upstream connection and stream that carry a client stream.
type UpStream = (Arc<UpShared>, u32);

/// One open client stream.
struct ClientStream {
    /// The upstream connection and stream carrying it; none while it waits for a ready
    /// endpoint.
    up: Option<UpStream>,
    /// While it waits for a ready endpoint: its request, kept until it can be sent.
    parked: Option<Box<Request>>,
    /// Once sent, until its response begins: a copy, to send it to another endpoint if its
    /// endpoint refuses it (none once its body outgrows [`REPLAY_CAP`]).
    replay: Option<Box<Request>>,
    /// Send window of this stream (towards the client).
    window: i64,
    /// Response bytes (and the end) the client's windows have not taken yet.
    held: Held,
    /// The response's headers went to the client (a deadline then ends it with trailers).
    answered: bool,
    /// Since when its held response bytes wait for a client that makes no room for them
    /// (none while nothing is held; moved on whenever some go out).
    stalled_since: Option<Instant>,
    /// The client's side ended (END_STREAM seen).
    request_ended: bool,
    /// When its request's headers arrived (the call's start), and when its `grpc-timeout`
    /// runs out.
    arrived: Instant,
    deadline: Option<Instant>,
    /// What the client may still send on the stream: given back as its bytes go upstream.
    recv: RecvWindow,
}

impl frames::Sending for ClientStream {
    fn outgoing(&mut self) -> (&mut i64, &mut Held) {
        (&mut self.window, &mut self.held)
    }
}

/// A request as the balancer keeps it to send (again): its header list (as forwarded), and
/// its body bytes, end and trailers as they came (bounded by the stream's window, which they
/// keep until they go upstream, or by [`REPLAY_CAP`]).
#[derive(Default)]
struct Request {
    fields: Fields,
    body: Held,
    /// How many of its body bytes gave the client's windows back already (it was sent before).
    credited: usize,
    /// The endpoints it was sent to (or picked on a connection that took no new stream).
    tried: Vec<crate::endpoints::EndpointId>,
    /// Attempts that reached an upstream so far.
    attempts: u32,
    /// How its last attempt failed, for the client when it is not sent again: reset with
    /// this code, or (none) its connection was lost.
    failed_with: Option<ErrorCode>,
    /// Its first pick deposited its share of the retry budget.
    deposited: bool,
    /// When its headers arrived, and its deadline (`grpc-timeout`): sent later (after a wait
    /// or a refusal), it carries the budget that is left.
    arrived: Option<Instant>,
    deadline: Option<Instant>,
}

impl Request {
    /// Its `grpc-timeout` set to what is left of its budget at `now`, once time has passed
    /// since its arrival.
    fn update_timeout(&mut self, now: Instant) {
        let (Some(arrived), Some(deadline)) = (self.arrived, self.deadline) else {
            return;
        };
        if now <= arrived {
            return;
        }
        let left = crate::grpc::encode_timeout(deadline.saturating_duration_since(now));
        let mut fields = Fields::default();
        for (name, value) in self.fields.iter() {
            if name == b"grpc-timeout" {
                fields.push(name, left.as_bytes());
            } else {
                fields.push(name, value);
            }
        }
        self.fields = fields;
        self.arrived = Some(now);
    }
}

/// Response bytes that reached the client for an upstream stream, whose window they give
/// back: the upstream connection, its stream, how many bytes.
pub(crate) type UpCredit = (Arc<UpShared>, u32, usize);

impl ClientState {
    fn new(metrics: Arc<crate::metrics::ServiceMetrics>) -> Self {
        Self {
            metrics,
            out: Out::default(),
            encoder: HpackEncoder::new(),
            streams: StreamMap::default(),
            limits: SendLimits::new(),
            recv: RecvWindow::new(CONNECTION_WINDOW),
            waiting: Vec::new(),
            retries: Vec::new(),
            redispatch: Arc::new(tokio::sync::Notify::new()),
            spare: Vec::new(),
            closed_early: std::collections::VecDeque::new(),
        }
    }

    /// Sends response headers (or trailers) on `stream`; `false` when the stream is gone.
    pub(crate) fn respond_headers(
        &mut self,
        stream: u32,
        fields: &Fields,
        end_stream: bool,
        now: Instant,
    ) -> Responded {
        let Some(s) = self.streams.get_mut(&stream) else {
            return Responded::Gone;
        };
        if s.deadline.is_some_and(|deadline| now >= deadline) {
            // Its deadline came before the reader's timer did: the client gets the
            // balancer's DEADLINE_EXCEEDED, never the server's answer to its own timer.
            let gone = self.deadline_exceeded(stream, now);
            self.forget_copy(gone);
            return Responded::PastDeadline;
        }
        // Its response began: it is not sent anywhere else.
        if let Some(copy) = s.replay.take()
            && self.spare.len() < MAX_SPARE_COPIES
        {
            self.spare.push(copy);
        }
        let forwarded = fields.iter().filter(|(n, _)| !is_connection_specific(n));
        if s.held.is_waiting() {
            // Trailers behind body bytes that wait for window: they wait too.
            s.held.hold_trailers(forwarded);
            return Responded::Sent;
        }
        fields::put_headers(
            &mut self.out.buf,
            &mut self.encoder,
            stream,
            end_stream,
            forwarded,
        );
        if end_stream {
            self.take(stream, now);
        } else {
            s.answered = true;
        }
        Responded::Sent
    }

    /// Ends `stream` at its deadline: the client gets DEADLINE_EXCEEDED (trailers only, or
    /// trailers after the response so far). Returns the stream, forgotten here.
    fn deadline_exceeded(&mut self, stream: u32, now: Instant) -> Option<ClientStream> {
        let s = self.take(stream, now)?;
        let mut f = Fields::default();
        if !s.answered {
            f.push(b":status", b"200");
            f.push(b"content-type", b"application/grpc");
        }
        f.push(b"grpc-status", b"4");
        f.push(
            b"grpc-message",
            b"skewless: deadline exceeded in the balancer",
        );
        fields::put_headers(&mut self.out.buf, &mut self.encoder, stream, true, f.iter());
        Some(s)
    }

    /// Forgets `stream`, which ends at `now`: the call's duration, from the arrival of its
    /// request's headers, is recorded (as on the h2 path, however the call ended).
    fn take(&mut self, stream: u32, now: Instant) -> Option<ClientStream> {
        let s = self.streams.remove(&stream)?;
        if !s.request_ended {
            self.closed_early(stream);
        }
        self.metrics
            .latency
            .record(now.saturating_duration_since(s.arrived));
        Some(s)
    }

    /// Remembers that the client may still send on `stream`, closed here.
    fn closed_early(&mut self, stream: u32) {
        if self.closed_early.back() == Some(&stream) {
            // Taken, then refused: once is enough.
            return;
        }
        if self.closed_early.len() == MAX_CLOSED_EARLY {
            self.closed_early.pop_front();
        }
        self.closed_early.push_back(stream);
    }

    /// Whether a header block on `stream` (not idle) is trailers to take or ignore: the
    /// stream is open, or closed here before the client ended it.
    fn may_get_trailers(&self, stream: u32) -> bool {
        self.streams.contains_key(&stream) || self.closed_early.contains(&stream)
    }

    /// Forgets every stream (the connection is over at `now`).
    fn take_all(&mut self, now: Instant) -> Vec<ClientStream> {
        let streams: Vec<ClientStream> = self.streams.drain().map(|(_, s)| s).collect();
        for s in &streams {
            self.metrics
                .latency
                .record(now.saturating_duration_since(s.arrived));
        }
        streams
    }

    /// Keeps the request copy of a stream that ended, to be filled again.
    fn forget_copy(&mut self, stream: Option<ClientStream>) {
        if let Some(copy) = stream.and_then(|s| s.replay)
            && self.spare.len() < MAX_SPARE_COPIES
        {
            self.spare.push(copy);
        }
    }

    /// Sends response body bytes on `stream` as far as the client's windows take them, and
    /// holds the rest until they open. Returns the bytes sent now, whose window the upstream
    /// stream gets back; `None` when the stream is gone.
    pub(crate) fn respond_data(
        &mut self,
        stream: u32,
        data: &[u8],
        end_stream: bool,
        now: Instant,
    ) -> Option<usize> {
        let s = self.streams.get_mut(&stream)?;
        if s.stalled_since.is_none() {
            s.stalled_since = Some(now);
        }
        let (sent, waits) = frames::send_or_hold(
            &mut self.waiting,
            s,
            stream,
            &mut self.out.buf,
            &mut self.limits,
            data,
            end_stream,
        );
        if end_stream && !waits {
            self.take(stream, now);
        }
        Some(sent)
    }

    /// The client's windows opened: sends what they now take of the held response bytes,
    /// stream by stream in the order they began to wait. Returns the bytes sent per upstream
    /// stream, whose windows the caller gives back.
    fn resume(&mut self) -> Vec<UpCredit> {
        let mut credits = Vec::new();
        let metrics = &self.metrics;
        frames::resume_waiting(
            &mut self.waiting,
            &mut self.streams,
            &mut self.out.buf,
            &mut self.limits,
            &mut self.encoder,
            |_, s, sent, over| {
                let now = (sent > 0 || over).then(Instant::now);
                if sent > 0 {
                    // The client made room: its stall starts again from now.
                    s.stalled_since = now;
                }
                if over && let Some(now) = now {
                    metrics
                        .latency
                        .record(now.saturating_duration_since(s.arrived));
                }
                if sent > 0
                    && let Some((up, up_stream)) = &s.up
                {
                    credits.push((up.clone(), *up_stream, sent));
                }
                // Its response is over: the stream is done.
                over
            },
        );
        credits
    }

    /// `n` of the client's request bytes on `stream` went upstream (or were dropped): their
    /// window goes back to the client.
    pub(crate) fn released(&mut self, stream: u32, n: usize) {
        self.recv.release(n, 0, &mut self.out.buf);
        if let Some(s) = self.streams.get_mut(&stream)
            && !s.request_ended
        {
            s.recv.release(n, stream, &mut self.out.buf);
        }
    }

    /// `endpoint` failed the request of `stream` before its response began (`failure`),
    /// which held back `dropped` of its bytes. It is sent again, to another endpoint, when
    /// the h2 path would (`request::retry`): provably not processed, or its method listed as
    /// retryable; within `max_attempts` and the caller's deadline; with its copy whole (its
    /// body within [`REPLAY_CAP`]; what the client sends from now on joins it); and with a
    /// token of the retry budget. Then the copy is parked again for the client's reader to
    /// send at once, or after the backoff of a request the upstream was processing, and that
    /// reader's waker is returned. `None`: the caller fails the stream.
    pub(crate) fn retry(
        &mut self,
        stream: u32,
        endpoint: crate::endpoints::EndpointId,
        dropped: usize,
        failure: Failure,
        pool: &CodecPool,
        now: Instant,
    ) -> Option<Arc<tokio::sync::Notify>> {
        let s = self.streams.get_mut(&stream)?;
        let copy = s.replay.as_mut()?;
        copy.failed_with = failure.code();
        let config = pool.config();
        let failed = retry::Failed {
            attempts: copy.attempts,
            max_attempts: config.max_attempts.max(1),
            retryable_method: copy
                .fields
                .get(b":path")
                .and_then(|path| std::str::from_utf8(path).ok())
                .is_some_and(|path| retry::retryable_method(&config, path)),
            not_processed: failure.not_processed(),
            replayable: true,
        };
        let retry::Decision::Retry { pause } =
            retry::decide(&failed, &config, now, copy.deadline, || pool.random_unit())
        else {
            return None;
        };
        if !pool.withdraw_retry_token(now) {
            Counters::bump(&pool.counters.retries_refused_by_budget);
            return None;
        }
        Counters::bump(&pool.counters.retries);
        tracing::debug!(stream, ?failure, ?pause, "retrying on another endpoint");
        let mut request = s.replay.take()?;
        request.tried.push(endpoint);
        // What it sent gave the window back; what it held does now, below.
        request.credited = request.body.len();
        s.up = None;
        s.parked = Some(request);
        // Its held bytes did not go out; every byte of the copy has given its window back
        // once it is sent again.
        self.released(stream, dropped);
        self.retries.push((stream, pause.map_or(now, |p| now + p)));
        Some(self.redispatch.clone())
    }

    /// Answers `stream` with a trailers-only UNAVAILABLE saying `message` (no response has
    /// begun on it), and forgets it. `dropped` request bytes were held for an upstream and
    /// are dropped: the connection's window gets them back.
    pub(crate) fn unavailable(&mut self, stream: u32, message: &[u8], dropped: usize) {
        if dropped > 0 {
            self.recv.release(dropped, 0, &mut self.out.buf);
        }
        if self.take(stream, Instant::now()).is_none() {
            return;
        }
        let mut f = Fields::default();
        f.push(b":status", b"200");
        f.push(b"content-type", b"application/grpc");
        f.push(b"grpc-status", b"14");
        f.push(b"grpc-message", message);
        fields::put_headers(&mut self.out.buf, &mut self.encoder, stream, true, f.iter());
    }

    /// The upstream reset the stream (or failed): reset it for the client. `dropped` request
    /// bytes were held for the upstream and are dropped: the connection's window gets them
    /// back.
    pub(crate) fn reset(&mut self, stream: u32, code: ErrorCode, dropped: usize) {
        if dropped > 0 {
            self.recv.release(dropped, 0, &mut self.out.buf);
        }
        if self.take(stream, Instant::now()).is_some() {
            RstStream {
                stream_id: stream,
                error_code: code,
            }
            .encode(&mut self.out.buf);
        }
    }
}

/// How a request's attempt failed before its response began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The upstream reset its stream with this code (REFUSED_STREAM: it did not process it).
    Reset(ErrorCode),
    /// Above the last stream id of the upstream's GOAWAY, with the GOAWAY's code: not
    /// processed.
    GoneAway(ErrorCode),
    /// Its upstream connection was lost (closed, failed, or found dead).
    Lost,
}

impl Failure {
    /// The upstream provably did not process it.
    fn not_processed(self) -> bool {
        matches!(
            self,
            Self::Reset(ErrorCode::REFUSED_STREAM) | Self::GoneAway(_)
        )
    }

    /// What the client's stream is reset with if it is not sent again (none: answered
    /// UNAVAILABLE).
    pub(crate) fn code(self) -> Option<ErrorCode> {
        match self {
            Self::Reset(code) => Some(code),
            Self::GoneAway(_) => Some(ErrorCode::REFUSED_STREAM),
            Self::Lost => None,
        }
    }

    /// Why the call failed, for `skewless_requests_failed_total`, when it is not sent again.
    pub(crate) fn reason(self) -> FailureReason {
        match self {
            Self::Reset(ErrorCode::REFUSED_STREAM) | Self::GoneAway(_) => FailureReason::Refused,
            Self::Reset(_) => FailureReason::Reset,
            Self::Lost => FailureReason::Connect,
        }
    }

    /// What a retried attempt says about its endpoint (as on the h2 path): a graceful GOAWAY
    /// says nothing; anything else, a refusal included, is a failure (an endpoint that refuses
    /// every stream would otherwise look cheap and take every first attempt).
    pub(crate) fn retried_outcome(self) -> Outcome {
        if self == Self::GoneAway(ErrorCode::NO_ERROR) {
            Outcome::Cancelled
        } else {
            Outcome::Failure
        }
    }
}
