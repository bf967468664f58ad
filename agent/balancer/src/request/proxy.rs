//! Forwards one client stream: applies the caller's deadline, picks an endpoint, re-dispatches
//! requests that never reached an upstream, retries the ones an upstream provably did not
//! process, and streams both bodies through while tracking when the endpoint's load completes.
//! The one "rescue" that maps failures to gRPC statuses is [`rescue`].
//!
//! Everything of one call runs in one future on the client connection's worker, on h2's
//! streams directly: the request body is pumped upstream and the response body back in the
//! same poll, with HTTP/2 flow control end to end (a chunk is only handed on when the other
//! side has window for it, but for a request attempt's first, and its window is released once
//! it is handed on), so a slow reader stalls its writer instead of filling the balancer's
//! memory; a reader that makes no room at all for `Config::stalled_reader_timeout` while the
//! balancer holds its response data has its stream reset.

use std::future::{Future as _, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use h2::server::SendResponse;
use h2::{Reason, RecvStream, SendStream};
use http::{HeaderMap, Request, Response, StatusCode, Uri};
use tokio::time::{Instant, Sleep};

use crate::endpoints::EndpointId;
use crate::grpc::{self, Code};
use crate::metrics::{FailureReason, ServiceMetrics};
use crate::request::picker::Outcome;
use crate::request::pool::{Lease, Pool};
use crate::request::retry::{self, Decision, Failed, NoRetry, not_processed, retried_outcome};
use crate::request::status::Counters;

/// Why a request could not be forwarded; becomes a gRPC status for the client.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ForwardError {
    /// The Service has no endpoints at all.
    #[error("no endpoints")]
    NoEndpoints,
    /// There are endpoints but none became ready in time.
    #[error("no endpoint is ready")]
    NoReadyEndpoint,
    /// The caller's budget ran out before the upstream answered.
    #[error("deadline exceeded in the balancer")]
    DeadlineExceeded,
    /// The upstream failed the request after it was sent.
    #[error("upstream request failed")]
    Upstream(#[source] h2::Error),
    /// The client reset its stream (or its connection broke) before the reply: nobody to
    /// answer.
    #[error("client went away")]
    ClientGone,
}

/// Largest request body prefix kept for a replay: a larger body turns the copy off (no
/// buffering of whole messages) and cannot be retried. A response arriving also turns it off.
const REPLAY_CAP: usize = 64 * 1024;

/// Handles one client stream until the call is over. Failures become gRPC statuses (or, for
/// other HTTP/2 traffic, 5xx responses and stream resets).
pub(crate) async fn handle(
    pool: Arc<Pool>,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    // One clock reading for the call's arrival: its start, its deadline and its first pick.
    let arrived = Instant::now();
    // Records the call's duration when the call is over, however it ends: the end of the
    // response, where the request's load on its endpoint completes too (`Lease::finish`,
    // whose reading it reuses).
    let mut call = pool.metrics.call_started(arrived);
    let deadline = req
        .headers()
        .get(grpc::GRPC_TIMEOUT)
        .and_then(grpc::parse_timeout)
        .and_then(|t| arrived.checked_add(t));
    let is_grpc = grpc::is_grpc(req.headers());
    let (head, body) = req.into_parts();
    let mut request = RequestPump::new(body);
    let mut expired = std::pin::pin!(expiry(deadline));
    let forwarded = tokio::select! {
        forwarded = forward(&pool, head, &mut request, deadline, arrived) => forwarded,
        () = expired.as_mut() => Err(ForwardError::DeadlineExceeded),
        _ = poll_fn(|cx| respond.poll_reset(cx)) => Err(ForwardError::ClientGone),
    };
    let Forwarded {
        resp,
        lease,
        stalled_after,
    } = match forwarded {
        Ok(forwarded) => forwarded,
        Err(ForwardError::ClientGone) => {
            // Dropping the upstream stream resets it: the cancellation goes upstream.
            tracing::debug!("client cancelled the call before the reply");
            return;
        }
        Err(error) => {
            let cell = match error {
                ForwardError::DeadlineExceeded => &pool.counters.local_deadline_exceeded,
                ForwardError::Upstream(_) => &pool.counters.upstream_failures,
                ForwardError::NoEndpoints
                | ForwardError::NoReadyEndpoint
                | ForwardError::ClientGone => &pool.counters.local_unavailable,
            };
            Counters::bump(cell);
            pool.metrics.failed(failure_reason(&error));
            if let Err(error) = respond.send_response(rescue(&error, is_grpc), true) {
                tracing::debug!(%error, "client went away before the local reply");
            }
            return;
        }
    };
    let (parts, upstream) = resp.into_parts();
    let grpc = grpc::is_grpc(&parts.headers);
    let status = parts.status;
    // A trailers-only reply carries its status in the headers and ends here.
    let end = upstream.is_end_stream();
    let outcome = end.then(|| outcome_of(status, Some(&parts.headers)));
    let client = match respond.send_response(Response::from_parts(parts, ()), end) {
        Ok(client) => client,
        Err(error) => {
            tracing::debug!(%error, "client went away before the reply");
            return;
        }
    };
    if let Some(outcome) = outcome {
        if outcome == Outcome::Failure {
            pool.metrics.failed(FailureReason::Unavailable);
        }
        call.ended(lease.finish(outcome));
        return;
    }
    let mut response = ResponsePump {
        upstream,
        client,
        lease: Some(lease),
        ended: None,
        grpc,
        status,
        metrics: &pool.metrics,
        stalled_after,
        stall: None,
    };
    poll_fn(|cx| {
        if expired.as_mut().poll(cx).is_ready() {
            response.deadline_exceeded();
            return Poll::Ready(());
        }
        // The request body keeps streaming while the response does (client streaming, bidi).
        if let Poll::Ready(Err(PumpError::Client)) = request.poll_pump(cx) {
            response.client_gone();
            return Poll::Ready(());
        }
        response.poll_pump(cx)
    })
    .await;
    if let Some(at) = response.ended {
        call.ended(at);
    }
}

/// Resolves when the caller's budget runs out; never without one.
async fn expiry(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Why a call that was not forwarded failed (a bounded metric label).
fn failure_reason(error: &ForwardError) -> FailureReason {
    match error {
        ForwardError::DeadlineExceeded => FailureReason::Deadline,
        ForwardError::Upstream(h2) => transport_failure(h2),
        ForwardError::NoEndpoints | ForwardError::NoReadyEndpoint | ForwardError::ClientGone => {
            FailureReason::Unavailable
        }
    }
}

/// Why an upstream stream failed: refused (provably not processed), the connection (I/O or a
/// connection-level error), or the stream itself (reset).
fn transport_failure(error: &h2::Error) -> FailureReason {
    if not_processed(error) {
        FailureReason::Refused
    } else if error.is_io() || error.is_go_away() {
        FailureReason::Connect
    } else {
        FailureReason::Reset
    }
}

/// Maps a forwarding failure to the response the client gets: trailers-only with a gRPC
/// status for gRPC, and the matching HTTP status for anything else.
fn rescue(error: &ForwardError, is_grpc: bool) -> Response<()> {
    let (code, http_status) = match error {
        ForwardError::NoEndpoints
        | ForwardError::NoReadyEndpoint
        | ForwardError::Upstream(_)
        | ForwardError::ClientGone => (Code::Unavailable, StatusCode::SERVICE_UNAVAILABLE),
        ForwardError::DeadlineExceeded => (Code::DeadlineExceeded, StatusCode::GATEWAY_TIMEOUT),
    };
    tracing::debug!(%error, ?code, "request failed locally");
    // The whole cause chain: the client's only clue to what happened upstream.
    let mut message = format!("skewless: {error}");
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    let mut resp = grpc::status_response::<()>(code, &message);
    if !is_grpc {
        *resp.status_mut() = http_status;
    }
    resp
}

/// An upstream's response head, and the lease it holds on its endpoint.
struct Forwarded {
    resp: Response<RecvStream>,
    lease: Lease,
    /// The live config's `stalled_reader_timeout` (read with the rest of it, once per call).
    stalled_after: Option<Duration>,
}

async fn forward(
    pool: &Arc<Pool>,
    head: http::request::Parts,
    request: &mut RequestPump,
    deadline: Option<Instant>,
    arrived: Instant,
) -> Result<Forwarded, ForwardError> {
    // One look at the live config per request (`reconfigure` may swap it meanwhile).
    let config = pool.config();
    let max_attempts = config.max_attempts.max(1);
    let retryable_method = retry::retryable_method(&config, head.uri.path());
    // What every attempt sends (extensions are not forwarded).
    let mut template = Request::from_parts(head, ());
    template.extensions_mut().clear();
    let mut tried: Vec<EndpointId> = Vec::new();
    let mut attempts = 1u32;
    // Re-dispatching a request that never left the balancer is free (nothing reached a server),
    // but still bounded so a flapping set of connections cannot spin.
    let mut redispatches = 0u32;
    let mut refused_by: Option<h2::Error> = None;
    loop {
        // The request's first pick happens at its arrival reading and also deposits its
        // share of the retry budget.
        let first = (attempts == 1 && redispatches == 0).then_some(arrived);
        let mut lease = match pool.acquire(&config, &tried, first).await {
            Ok(lease) => lease,
            // A retry with nowhere else to go fails with what the upstream said.
            Err(error) => return Err(refused_by.map_or(error, ForwardError::Upstream)),
        };
        // A fresh handle is ready at once unless its connection stopped taking streams
        // (upstream GOAWAY, or it failed): then nothing was sent, send it on another one.
        if let Err(error) = poll_fn(|cx| lease.sender.poll_ready(cx)).await {
            tracing::debug!(addr = %lease.addr, %error, "connection closed before dispatch, re-dispatching");
            pool.connection_closed(lease.id, lease.generation());
            lease.finish(Outcome::Cancelled);
            redispatches += 1;
            Counters::bump(&pool.counters.redispatches);
            if redispatches >= max_attempts * 4 {
                return Err(ForwardError::NoReadyEndpoint);
            }
            continue;
        }
        let mut req = upstream_request(&template, lease.addr);
        if let Some(deadline) = deadline {
            let remaining = deadline.saturating_duration_since(Instant::now());
            req.headers_mut()
                .insert(grpc::GRPC_TIMEOUT, grpc::encode_timeout(remaining));
        }
        let attempt = match lease.sender.send_request(req, request.nothing_to_send()) {
            Ok((mut response, send)) => {
                request.attach(send);
                poll_fn(|cx| {
                    if let Poll::Ready(r) = Pin::new(&mut response).poll(cx) {
                        return Poll::Ready(r.map_err(Some));
                    }
                    // Stream the request body while the reply is awaited; an upstream failure
                    // also fails `response`, which tells what happened.
                    if let Poll::Ready(Err(PumpError::Client)) = request.poll_pump(cx) {
                        return Poll::Ready(Err(None));
                    }
                    Poll::Pending
                })
                .await
            }
            Err(error) => Err(Some(error)),
        };
        let error = match attempt {
            Ok(resp) => {
                request.keep_no_copy();
                lease.headers_received();
                return Ok(Forwarded {
                    resp,
                    lease,
                    stalled_after: config.stalled_reader_timeout,
                });
            }
            Err(None) => return Err(ForwardError::ClientGone),
            Err(Some(error)) => error,
        };
        request.detach();
        let failed = Failed {
            attempts,
            max_attempts,
            retryable_method,
            not_processed: not_processed(&error),
            replayable: request.replayable(),
        };
        match retry::decide(&failed, &config, Instant::now(), deadline, || {
            pool.random_unit()
        }) {
            Decision::Retry { pause } if pool.withdraw_retry_token() => {
                Counters::bump(&pool.counters.retries);
                tracing::debug!(addr = %lease.addr, %error, ?pause, "retrying on another endpoint");
                tried.push(lease.id);
                lease.finish(retried_outcome(&error));
                attempts += 1;
                refused_by = Some(error);
                if let Some(pause) = pause {
                    tokio::time::sleep(pause).await;
                }
                continue;
            }
            Decision::Retry { .. } => Counters::bump(&pool.counters.retries_refused_by_budget),
            Decision::Fail(NoRetry::NotReplayable) => {
                tracing::debug!("request body cannot be replayed, not retrying");
            }
            Decision::Fail(_) => {}
        }
        tracing::debug!(addr = %lease.addr, ?error, "upstream failed the request");
        lease.finish(Outcome::Failure);
        return Err(ForwardError::Upstream(error));
    }
}

/// The request one attempt sends: the client's, with an absolute URI as h2 requires (a client
/// that sent no `:authority` gets the endpoint's address).
fn upstream_request(template: &Request<()>, endpoint: std::net::SocketAddr) -> Request<()> {
    let mut req = Request::new(());
    *req.method_mut() = template.method().clone();
    *req.version_mut() = template.version();
    *req.headers_mut() = template.headers().clone();
    let uri = template.uri();
    *req.uri_mut() = if uri.scheme().is_some() && uri.authority().is_some() {
        uri.clone()
    } else {
        let mut parts = uri.clone().into_parts();
        parts.scheme.get_or_insert(http::uri::Scheme::HTTP);
        if parts.authority.is_none() {
            parts.authority = endpoint.to_string().parse().ok();
        }
        if parts.path_and_query.is_none() {
            parts.path_and_query = Some(http::uri::PathAndQuery::from_static("/"));
        }
        Uri::from_parts(parts).unwrap_or_else(|_| uri.clone())
    };
    req
}

fn outcome_of(status: StatusCode, trailers: Option<&HeaderMap>) -> Outcome {
    if status.is_server_error() {
        return Outcome::Failure;
    }
    match trailers.and_then(grpc::status_of) {
        Some(s) if s == Code::Unavailable as u32 => Outcome::Failure,
        _ => Outcome::Success,
    }
}

/// Why a pump stopped.
#[derive(Debug)]
enum PumpError {
    /// The client's side failed (it reset the stream or the connection broke).
    Client,
    /// The upstream's side failed; the attempt's response reports how.
    Upstream,
}

/// Waits until `send` has window for at least one more byte beyond what it has buffered, so
/// at most one chunk per stream waits in the balancer whatever the reader's pace. `Err` when
/// the stream is gone (reset, connection closed).
fn poll_window(send: &mut SendStream<Bytes>, cx: &mut Context<'_>) -> Poll<Result<(), ()>> {
    send.reserve_capacity(1);
    while send.capacity() == 0 {
        match ready!(send.poll_capacity(cx)) {
            Some(Ok(_)) => {}
            Some(Err(_)) | None => return Poll::Ready(Err(())),
        }
    }
    Poll::Ready(Ok(()))
}

/// The client's request body on its way upstream, with a bounded copy of what was sent for a
/// replay on another endpoint.
struct RequestPump {
    client: RecvStream,
    /// The current attempt's stream; `None` between attempts.
    upstream: Option<SendStream<Bytes>>,
    /// What was read from the client so far, while it is small and no reply arrived; `None`
    /// once the copy is off.
    copy: Option<Replay>,
    copied: usize,
    /// The client's trailers, if it sent any (kept for a replay too).
    trailers: Option<HeaderMap>,
    /// The client's body has been read to its end.
    read_all: bool,
    /// The end of the body went to the current attempt's stream.
    done: bool,
    /// Something went to the current attempt's stream. Until then a chunk read from the client
    /// goes to it without waiting for window: h2 gives a stream window only once its
    /// connection has sent the HEADERS, so waiting made the request's first DATA a write (and
    /// a wake-up of the call) of its own. That one chunk is all it may hold beyond the window.
    sent: bool,
    /// A chunk read from the client that waits for window on the current attempt's stream,
    /// and whether it ends the body. Its client window is released once it is handed on, so
    /// holding it here costs the client what h2's receive buffer did.
    pending: Option<(Bytes, bool)>,
}

impl RequestPump {
    fn new(client: RecvStream) -> Self {
        let read_all = client.is_end_stream();
        Self {
            client,
            upstream: None,
            copy: Some(Replay::default()),
            copied: 0,
            trailers: None,
            read_all,
            done: false,
            sent: false,
            pending: None,
        }
    }

    /// The request ends with its headers: an attempt sends them with END_STREAM.
    fn nothing_to_send(&self) -> bool {
        self.read_all && self.copied == 0 && self.trailers.is_none()
    }

    /// Starts an attempt on `send`: replays what earlier attempts sent, then goes on with the
    /// rest of the client's body.
    fn attach(&mut self, mut send: SendStream<Bytes>) {
        self.done = self.nothing_to_send();
        self.sent = false;
        if self.copy.is_some()
            && let Some((chunk, _)) = self.pending.take()
        {
            // The copy holds it: it goes out with the replay.
            let _ = self.client.flow_control().release_capacity(chunk.len());
        }
        if let Some(copy) = &self.copy {
            let last = copy.len().saturating_sub(1);
            for (i, chunk) in copy.iter().enumerate() {
                let end = i == last && self.read_all && self.trailers.is_none();
                self.sent = true;
                if send.send_data(chunk.clone(), end).is_err() {
                    break;
                }
                self.done |= end;
            }
        }
        if self.read_all
            && !self.done
            && let Some(trailers) = &self.trailers
        {
            let _ = send.send_trailers(trailers.clone());
            self.sent = true;
            self.done = true;
        }
        self.upstream = Some(send);
    }

    /// The attempt failed: stop sending to its stream.
    fn detach(&mut self) {
        self.upstream = None;
    }

    /// Whether a new attempt can send the whole body again.
    fn replayable(&self) -> bool {
        self.copy.is_some()
    }

    /// A reply arrived: the body will not be sent again, stop copying it.
    fn keep_no_copy(&mut self) {
        self.copy = None;
    }

    /// Forwards the client's body to the current attempt: `Ready(Ok)` once it is all sent,
    /// `Pending` while there is more to come or no attempt to send it to.
    fn poll_pump(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), PumpError>> {
        loop {
            if self.done {
                return Poll::Ready(Ok(()));
            }
            let Some(upstream) = self.upstream.as_mut() else {
                return Poll::Pending;
            };
            let (data, end) = match self.pending.take() {
                // A chunk read earlier goes on once its stream has window for it.
                Some((data, end)) => match poll_window(upstream, cx) {
                    Poll::Pending => {
                        self.pending = Some((data, end));
                        return Poll::Pending;
                    }
                    Poll::Ready(Err(())) => {
                        self.pending = Some((data, end));
                        self.upstream = None;
                        return Poll::Ready(Err(PumpError::Upstream));
                    }
                    Poll::Ready(Ok(())) => (data, end),
                },
                None => match ready!(self.client.poll_data(cx)) {
                    Some(Ok(data)) => {
                        let end = self.client.is_end_stream();
                        self.read_all = end;
                        if let Some(copy) = &mut self.copy {
                            self.copied += data.len();
                            if self.copied > REPLAY_CAP {
                                self.copy = None;
                            } else {
                                copy.push(data.clone());
                            }
                        }
                        // The first chunk of an attempt, and an empty one (an END_STREAM),
                        // need no window; any other waits for it.
                        if self.sent && !data.is_empty() {
                            self.pending = Some((data, end));
                            continue;
                        }
                        (data, end)
                    }
                    Some(Err(error)) => {
                        tracing::debug!(%error, "client request stream failed");
                        return Poll::Ready(Err(PumpError::Client));
                    }
                    None => {
                        let trailers = match ready!(self.client.poll_trailers(cx)) {
                            Ok(trailers) => trailers,
                            Err(error) => {
                                tracing::debug!(%error, "client request trailers failed");
                                return Poll::Ready(Err(PumpError::Client));
                            }
                        };
                        self.read_all = true;
                        let sent = match &trailers {
                            Some(t) => upstream.send_trailers(t.clone()),
                            None => upstream.send_data(Bytes::new(), true),
                        };
                        self.trailers = trailers;
                        self.sent = true;
                        if sent.is_err() {
                            self.upstream = None;
                            return Poll::Ready(Err(PumpError::Upstream));
                        }
                        self.done = true;
                        continue;
                    }
                },
            };
            let len = data.len();
            let sent = upstream.send_data(data, end);
            self.sent = true;
            let _ = self.client.flow_control().release_capacity(len);
            if sent.is_err() {
                self.upstream = None;
                return Poll::Ready(Err(PumpError::Upstream));
            }
            self.done = end;
        }
    }
}

/// The chunks of a request body kept for a replay, in order. The first two are held in place:
/// a unary gRPC request is one DATA frame with the message, and often an empty one with
/// END_STREAM after it (hyper's clients send that), so most calls allocate nothing for their
/// copy (a `Vec` of them was one malloc, and one free, per call).
#[derive(Default)]
struct Replay {
    head: [Option<Bytes>; 2],
    rest: Vec<Bytes>,
}

impl Replay {
    fn push(&mut self, chunk: Bytes) {
        match self.head.iter_mut().find(|c| c.is_none()) {
            Some(free) => *free = Some(chunk),
            None => self.rest.push(chunk),
        }
    }

    fn len(&self) -> usize {
        self.head.iter().flatten().count() + self.rest.len()
    }

    fn iter(&self) -> impl Iterator<Item = &Bytes> {
        self.head.iter().flatten().chain(&self.rest)
    }
}

/// The upstream's response body on its way to the client; holds the endpoint's lease until
/// the response ends.
struct ResponsePump<'a> {
    upstream: RecvStream,
    client: SendStream<Bytes>,
    lease: Option<Lease>,
    /// The clock reading the lease ended at: the call's end too.
    ended: Option<Instant>,
    grpc: bool,
    status: StatusCode,
    metrics: &'a ServiceMetrics,
    /// `Config::stalled_reader_timeout`.
    stalled_after: Option<Duration>,
    /// Armed while the client has no window for the response: when it fires with response
    /// data held for the client, the stream is reset. No timer otherwise.
    stall: Option<Pin<Box<Sleep>>>,
}

impl ResponsePump<'_> {
    /// The client has made no room for the response for `stalled_after` while the balancer
    /// holds response data for it: reset the stream both ways (RST_STREAM(CANCEL) to the
    /// client; dropping the upstream stream resets it and frees what it held).
    fn stalled_reader(&mut self) {
        tracing::debug!("client read nothing of the response for the stalled-reader timeout");
        self.finish(Outcome::Cancelled);
        self.metrics.failed(FailureReason::StalledReader);
        self.client.send_reset(Reason::CANCEL);
    }

    /// Waiting for the client's window: `Ready` once the stall timer says the stream must be
    /// reset, re-armed while nothing is held for the client.
    fn poll_stall(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(after) = self.stalled_after else {
            return Poll::Pending;
        };
        loop {
            let stall = self
                .stall
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(after)));
            ready!(stall.as_mut().poll(cx));
            if self.upstream.flow_control().used_capacity() > 0 {
                return Poll::Ready(());
            }
            // Nothing held for the client yet (a stream waiting on its server): wait again.
            stall.as_mut().reset(Instant::now() + after);
        }
    }

    /// The response is over: the lease ends with `outcome` (the endpoint's load completes)
    /// and a failure by the endpoint counts as the call's.
    fn finish(&mut self, outcome: Outcome) {
        if let Some(lease) = self.lease.take() {
            if outcome == Outcome::Failure {
                self.metrics.failed(FailureReason::Unavailable);
            }
            self.ended = Some(lease.finish(outcome));
        }
    }

    /// The client reset its stream: the caller drops the upstream stream, which resets it.
    fn client_gone(&mut self) {
        tracing::debug!("client cancelled the call");
        self.finish(Outcome::Cancelled);
    }

    /// The budget ran out mid-stream: end the call with DEADLINE_EXCEEDED; the caller drops the
    /// upstream stream, which resets it (the cancellation goes upstream).
    fn deadline_exceeded(&mut self) {
        self.finish(Outcome::Cancelled);
        self.metrics.failed(FailureReason::Deadline);
        if self.grpc {
            let _ = self.client.send_trailers(grpc::status_headers(
                Code::DeadlineExceeded,
                "skewless: deadline exceeded in the balancer",
            ));
        } else {
            self.client.send_reset(Reason::CANCEL);
        }
    }

    /// Forwards the upstream's body and trailers; `Ready` once the response is over.
    fn poll_pump(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            // A reset by the client also ends the wait for window.
            match poll_window(&mut self.client, cx) {
                Poll::Ready(Ok(())) => self.stall = None,
                Poll::Ready(Err(())) => {
                    self.client_gone();
                    return Poll::Ready(());
                }
                Poll::Pending => {
                    if self.poll_stall(cx).is_ready() {
                        self.stalled_reader();
                        return Poll::Ready(());
                    }
                    return Poll::Pending;
                }
            }
            let data = self.upstream.poll_data(cx);
            if data.is_pending() {
                return self.pending_unless_client_gone(cx);
            }
            match ready!(data) {
                Some(Ok(data)) => {
                    let len = data.len();
                    let end = self.upstream.is_end_stream();
                    let sent = self.client.send_data(data, end);
                    let _ = self.upstream.flow_control().release_capacity(len);
                    if sent.is_err() {
                        self.client_gone();
                        return Poll::Ready(());
                    }
                    if end {
                        self.finish(outcome_of(self.status, None));
                        return Poll::Ready(());
                    }
                }
                Some(Err(error)) => {
                    self.upstream_failed(&error);
                    return Poll::Ready(());
                }
                None => {
                    let trailers = self.upstream.poll_trailers(cx);
                    if trailers.is_pending() {
                        return self.pending_unless_client_gone(cx);
                    }
                    match ready!(trailers) {
                        Ok(Some(trailers)) => {
                            self.finish(outcome_of(self.status, Some(&trailers)));
                            let _ = self.client.send_trailers(trailers);
                        }
                        Ok(None) => {
                            self.finish(outcome_of(self.status, None));
                            let _ = self.client.send_data(Bytes::new(), true);
                        }
                        Err(error) => self.upstream_failed(&error),
                    }
                    return Poll::Ready(());
                }
            }
        }
    }

    /// Waiting for the upstream: watch for the client resetting its stream meanwhile.
    fn pending_unless_client_gone(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.client.poll_reset(cx).is_ready() {
            self.client_gone();
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// The upstream's stream broke after the headers went out. A gRPC call ends with a status
    /// in trailers rather than a bare reset, so the client sees why; other traffic is reset.
    fn upstream_failed(&mut self, error: &h2::Error) {
        // The server gave up on the call (CANCEL): says nothing about the endpoint's health.
        let cancelled = error.reason() == Some(Reason::CANCEL);
        // The endpoint's outcome, and the call's failure reason (counted here, not as the
        // Failure outcome's "unavailable").
        let outcome = if cancelled {
            Outcome::Cancelled
        } else {
            Outcome::Failure
        };
        if let Some(lease) = self.lease.take() {
            self.ended = Some(lease.finish(outcome));
            self.metrics.failed(if cancelled {
                FailureReason::Reset
            } else {
                transport_failure(error)
            });
        }
        tracing::debug!(%error, "upstream response stream failed");
        if self.grpc {
            let code = if cancelled {
                Code::Cancelled
            } else {
                Code::Unavailable
            };
            let _ = self.client.send_trailers(grpc::status_headers(
                code,
                "skewless: upstream stream ended abnormally",
            ));
        } else {
            self.client
                .send_reset(error.reason().unwrap_or(Reason::INTERNAL_ERROR));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::{Future as _, poll_fn};
    use std::pin::Pin;
    use std::task::Poll;

    use bytes::Bytes;
    use tokio::io::AsyncReadExt as _;

    use super::{Replay, RequestPump};

    /// Frame types and flags of what `bytes` (a client's byte stream after its preface) holds.
    fn frames(bytes: &[u8]) -> Vec<(u8, u8, usize)> {
        let mut out = Vec::new();
        let mut rest = bytes;
        while rest.len() >= 9 {
            let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            out.push((rest[3], rest[4], len));
            rest = &rest[(9 + len).min(rest.len())..];
        }
        out
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_unary_request_goes_upstream_in_the_write_of_its_headers() {
        const DATA: u8 = 0x0;
        const HEADERS: u8 = 0x1;
        const END_STREAM: u8 = 0x1;
        // A client connection: an h2 client sends a request with a body to an h2 server, the
        // balancer's side of it.
        let (client_io, server_io) = tokio::io::duplex(1 << 16);
        let client = tokio::spawn(async move {
            let (mut tx, conn) = h2::client::handshake(client_io).await.unwrap();
            tokio::spawn(conn);
            let req = http::Request::post("http://pod/echo.Echo/Echo")
                .body(())
                .unwrap();
            let (resp, mut body) = tx.send_request(req, false).unwrap();
            body.send_data(Bytes::from_static(b"a message"), true)
                .unwrap();
            (tx, resp, body)
        });
        let mut server = h2::server::handshake(server_io).await.unwrap();
        let (req, _respond) = server.accept().await.unwrap().unwrap();
        let _client = client.await.unwrap();
        tokio::spawn(async move { while server.accept().await.is_some() {} });
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        // The upstream connection, driven by hand; what it writes is read from `peer`.
        let (up_io, mut peer) = tokio::io::duplex(1 << 16);
        let (mut up, mut up_conn) = h2::client::handshake(up_io).await.unwrap();
        let (head, body) = req.into_parts();
        let (_response, send) = up
            .send_request(http::Request::from_parts(head, ()), false)
            .unwrap();
        let mut pump = RequestPump::new(body);
        pump.attach(send);
        // The call's poll, then the connection's first.
        poll_fn(|cx| {
            let _ = pump.poll_pump(cx);
            Poll::Ready(())
        })
        .await;
        poll_fn(|cx| {
            let _ = Pin::new(&mut up_conn).poll(cx);
            Poll::Ready(())
        })
        .await;
        let mut written = vec![0; 1 << 16];
        let n = peer.read(&mut written).await.unwrap();
        let written = &written[..n];
        assert!(written.starts_with(h2_magic()), "the client preface first");
        let kinds = frames(&written[h2_magic().len()..]);
        assert!(
            kinds.iter().any(|(t, _, _)| *t == HEADERS),
            "the request's HEADERS: {kinds:?}"
        );
        assert!(
            kinds
                .iter()
                .any(|(t, f, len)| *t == DATA && f & END_STREAM != 0 && *len == 9),
            "its DATA with END_STREAM in the same write, not in one of its own: {kinds:?}"
        );
    }

    fn h2_magic() -> &'static [u8] {
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    }

    #[test]
    fn a_replay_keeps_every_chunk_in_order() {
        let mut replay = Replay::default();
        assert_eq!(replay.len(), 0);
        assert_eq!(replay.iter().count(), 0, "nothing kept yet");
        let chunks = [&b"one"[..], b"", b"three", b"four"];
        for (i, chunk) in chunks.iter().enumerate() {
            replay.push(Bytes::from_static(chunk));
            assert_eq!(replay.len(), i + 1);
            let kept: Vec<&[u8]> = replay.iter().map(|b| &b[..]).collect();
            assert_eq!(kept, chunks[..=i], "every chunk so far, in the order read");
        }
    }
}
