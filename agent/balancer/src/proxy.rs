//! Forwards one request: applies the caller's deadline, picks an endpoint, re-dispatches
//! requests that never reached an upstream, and streams the response back while tracking when
//! the endpoint's load completes. The one "rescue" that maps failures to gRPC statuses is
//! [`rescue`].

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use crate::body::UpstreamBody;
use crate::error::ForwardError;
use crate::grpc::{self, Code};
use crate::picker::{Outcome, SlotId};
use crate::pool::{Lease, Pool};
use crate::stats::Counters;

/// Handles one client request; never fails at the HTTP level (failures become gRPC statuses).
pub(crate) async fn handle(
    pool: Arc<Pool>,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, Infallible> {
    let arrived = Instant::now();
    let deadline = req
        .headers()
        .get(grpc::GRPC_TIMEOUT)
        .and_then(grpc::parse_timeout)
        .and_then(|t| arrived.checked_add(t));
    let is_grpc = grpc::is_grpc(req.headers());
    let forwarded = match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, forward(&pool, req, Some(deadline)))
            .await
            .unwrap_or(Err(ForwardError::DeadlineExceeded)),
        None => forward(&pool, req, None).await,
    };
    Ok(match forwarded {
        Ok(resp) => resp,
        Err(error) => {
            let cell = match error {
                ForwardError::DeadlineExceeded => &pool.counters.local_deadline_exceeded,
                ForwardError::Upstream(_) => &pool.counters.upstream_failures,
                ForwardError::NoEndpoints | ForwardError::NoReadyEndpoint => {
                    &pool.counters.local_unavailable
                }
            };
            Counters::bump(cell);
            rescue(&error, is_grpc)
        }
    })
}

/// Maps a forwarding failure to the response the client gets.
fn rescue(error: &ForwardError, is_grpc: bool) -> Response<ProxyBody> {
    let (code, http_status) = match error {
        ForwardError::NoEndpoints | ForwardError::NoReadyEndpoint | ForwardError::Upstream(_) => {
            (Code::Unavailable, http::StatusCode::SERVICE_UNAVAILABLE)
        }
        ForwardError::DeadlineExceeded => {
            (Code::DeadlineExceeded, http::StatusCode::GATEWAY_TIMEOUT)
        }
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
    let mut resp = grpc::status_response::<ProxyBody>(code, &message);
    if !is_grpc {
        *resp.status_mut() = http_status;
    }
    resp
}

async fn forward(
    pool: &Arc<Pool>,
    req: Request<Incoming>,
    deadline: Option<Instant>,
) -> Result<Response<ProxyBody>, ForwardError> {
    pool.deposit_retry_token();
    let (max_attempts, retryable_method) = {
        // One look at the live config per request (it may be swapped by `reconfigure`).
        let config = pool.config();
        let path = req.uri().path();
        (
            config.max_attempts.max(1),
            config
                .retryable_methods
                .iter()
                .any(|m| path == m.as_str() || (m.ends_with('/') && path.starts_with(m.as_str()))),
        )
    };
    let (parts, body) = req.into_parts();
    let (body, replay) = UpstreamBody::client(body);
    // What a retry needs to rebuild the request (extensions are not forwarded anyway).
    let template = (
        parts.method.clone(),
        parts.uri.clone(),
        parts.version,
        parts.headers.clone(),
    );
    let mut req = Request::from_parts(parts, body);
    let mut tried: Vec<SlotId> = Vec::new();
    let mut attempts = 1u32;
    // Re-dispatching a request that never left the balancer is free (nothing reached a server),
    // but still bounded so a flapping set of connections cannot spin.
    let mut redispatches = 0u32;
    let mut refused_by: Option<hyper::Error> = None;
    loop {
        let mut lease = match pool.acquire(&tried).await {
            Ok(lease) => lease,
            // A retry with nowhere else to go fails with what the upstream said.
            Err(error) => return Err(refused_by.map_or(error, ForwardError::Upstream)),
        };
        if let Some(deadline) = deadline {
            let remaining = deadline.saturating_duration_since(Instant::now());
            req.headers_mut()
                .insert(grpc::GRPC_TIMEOUT, grpc::encode_timeout(remaining));
        }
        match lease.sender.try_send_request(req).await {
            Ok(resp) => {
                replay.disable();
                lease.headers_received();
                return Ok(wrap(resp, lease, deadline));
            }
            Err(mut error) => {
                if let Some(unsent) = error.take_message() {
                    // The connection stopped taking streams (upstream GOAWAY or close) before
                    // this request was written: send it on another connection.
                    tracing::debug!(addr = %lease.addr, "connection closed before dispatch, re-dispatching");
                    pool.connection_closed(lease.id, lease.generation());
                    lease.finish(Outcome::Cancelled);
                    req = unsent;
                    redispatches += 1;
                    Counters::bump(&pool.counters.redispatches);
                    if redispatches >= max_attempts * 4 {
                        return Err(ForwardError::NoReadyEndpoint);
                    }
                    continue;
                }
                let error = error.into_error();
                // Configured-retryable (idempotent) methods are retried after any transport
                // failure, others only when the upstream provably did not process them.
                let retryable =
                    attempts < max_attempts && (retryable_method || not_processed(&error));
                let body = if retryable {
                    let body = replay.replay(REPLAY_WAIT).await;
                    if body.is_none() {
                        tracing::debug!("request body cannot be replayed, not retrying");
                    }
                    body
                } else {
                    None
                };
                let allowed = body.is_some() && pool.withdraw_retry_token();
                if body.is_some() && !allowed {
                    Counters::bump(&pool.counters.retries_refused_by_budget);
                }
                if let Some(body) = body
                    && allowed
                {
                    Counters::bump(&pool.counters.retries);
                    tracing::debug!(addr = %lease.addr, %error, "retrying on another endpoint");
                    tried.push(lease.id);
                    lease.finish(retried_outcome(&error));
                    attempts += 1;
                    let (method, uri, version, headers) = &template;
                    let mut retry = Request::new(body);
                    *retry.method_mut() = method.clone();
                    *retry.uri_mut() = uri.clone();
                    *retry.version_mut() = *version;
                    *retry.headers_mut() = headers.clone();
                    req = retry;
                    refused_by = Some(error);
                    continue;
                }
                tracing::debug!(addr = %lease.addr, ?error, "upstream failed the request");
                lease.finish(Outcome::Failure);
                return Err(ForwardError::Upstream(error));
            }
        }
    }
}

/// How long a retry waits for hyper to hand the client's body back from the failed attempt
/// (it drops it on its own task, normally at once; 100 ms was too short on a busy node). The
/// caller's deadline still bounds the whole call.
const REPLAY_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// What a retried attempt says about its endpoint. A graceful GOAWAY (the server rotating or
/// shutting down its connection) says nothing: the endpoint stays as it was. Anything else, a
/// REFUSED_STREAM included, is a failure of the endpoint: otherwise an endpoint that refuses
/// every stream would look cheap (it answers at once and holds nothing in flight), attract
/// every first attempt and drain the retry budget, until calls fail; counted as failures, it
/// is ejected after `failure_threshold` of them like any failing endpoint.
fn retried_outcome(error: &hyper::Error) -> Outcome {
    if h2_error(error).is_some_and(graceful_go_away) {
        Outcome::Cancelled
    } else {
        Outcome::Failure
    }
}

/// The HTTP/2 error under a hyper error, if there is one.
fn h2_error(error: &hyper::Error) -> Option<&h2::Error> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return Some(h2);
        }
        source = e.source();
    }
    None
}

/// The stream was cut by the upstream's graceful GOAWAY (NO_ERROR).
fn graceful_go_away(h2: &h2::Error) -> bool {
    h2.is_go_away() && h2.is_remote() && h2.reason() == Some(h2::Reason::NO_ERROR)
}

/// Whether the upstream provably did not process the request: it refused the stream
/// (REFUSED_STREAM), or the stream was cut by a graceful GOAWAY (NO_ERROR). h2 fails a stream
/// with a remote NO_ERROR GOAWAY when its id is above the GOAWAY's last-stream-id; a graceful
/// server finishes every stream at or below it before closing.
fn not_processed(error: &hyper::Error) -> bool {
    h2_error(error)
        .is_some_and(|h2| h2.reason() == Some(h2::Reason::REFUSED_STREAM) || graceful_go_away(h2))
}

fn wrap(resp: Response<Incoming>, lease: Lease, deadline: Option<Instant>) -> Response<ProxyBody> {
    let (parts, body) = resp.into_parts();
    let grpc = grpc::is_grpc(&parts.headers);
    // A trailers-only reply carries its status in the headers.
    let outcome_now = if body.is_end_stream() {
        Some(outcome_of(parts.status, Some(&parts.headers)))
    } else {
        None
    };
    let kind = match outcome_now {
        Some(outcome) => {
            lease.finish(outcome);
            Kind::Done
        }
        None => Kind::Upstream {
            body,
            lease: Some(lease),
            deadline: deadline.map(|d| Box::pin(tokio::time::sleep_until(d))),
            grpc,
            status: parts.status,
        },
    };
    Response::from_parts(parts, ProxyBody { kind })
}

fn outcome_of(status: http::StatusCode, trailers: Option<&HeaderMap>) -> Outcome {
    if status.is_server_error() {
        return Outcome::Failure;
    }
    match trailers.and_then(grpc::status_of) {
        Some(s) if s == Code::Unavailable as u32 => Outcome::Failure,
        _ => Outcome::Success,
    }
}

/// The response body the client gets: the upstream's body streamed through frame by frame
/// (never buffered: hyper polls it only when the client's stream has window), or nothing for
/// a locally generated trailers-only response.
#[derive(Default)]
pub struct ProxyBody {
    kind: Kind,
}

#[derive(Default)]
enum Kind {
    Upstream {
        body: Incoming,
        lease: Option<Lease>,
        deadline: Option<Pin<Box<Sleep>>>,
        grpc: bool,
        status: http::StatusCode,
    },
    /// Trailers already sent or nothing to send.
    #[default]
    Done,
}

impl std::fmt::Debug for ProxyBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyBody").finish_non_exhaustive()
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        match &mut this.kind {
            Kind::Done => Poll::Ready(None),
            Kind::Upstream {
                body,
                lease,
                deadline,
                grpc,
                status,
            } => {
                if let Some(sleep) = deadline
                    && sleep.as_mut().poll(cx).is_ready()
                {
                    // The budget ran out mid-stream: end it with DEADLINE_EXCEEDED; dropping the
                    // upstream body resets the upstream stream (cancellation goes upstream).
                    if let Some(lease) = lease.take() {
                        lease.finish(Outcome::Cancelled);
                    }
                    let grpc = *grpc;
                    this.kind = Kind::Done;
                    return if grpc {
                        Poll::Ready(Some(Ok(Frame::trailers(grpc::status_headers(
                            Code::DeadlineExceeded,
                            "skewless: deadline exceeded in the balancer",
                        )))))
                    } else {
                        Poll::Ready(None)
                    };
                }
                match ready!(Pin::new(body).poll_frame(cx)) {
                    Some(Ok(frame)) => {
                        if let Some(trailers) = frame.trailers_ref()
                            && let Some(lease) = lease.take()
                        {
                            lease.finish(outcome_of(*status, Some(trailers)));
                        }
                        Poll::Ready(Some(Ok(frame)))
                    }
                    None => {
                        if let Some(lease) = lease.take() {
                            lease.finish(outcome_of(*status, None));
                        }
                        this.kind = Kind::Done;
                        Poll::Ready(None)
                    }
                    Some(Err(error)) => {
                        let cancelled = upstream_cancelled(&error);
                        if let Some(lease) = lease.take() {
                            lease.finish(if cancelled {
                                Outcome::Cancelled
                            } else {
                                Outcome::Failure
                            });
                        }
                        tracing::debug!(%error, "upstream response stream failed");
                        if *grpc {
                            // Headers went out already: end the call with a status in trailers
                            // rather than a bare reset, so the client sees why.
                            let code = if cancelled {
                                Code::Cancelled
                            } else {
                                Code::Unavailable
                            };
                            this.kind = Kind::Done;
                            Poll::Ready(Some(Ok(Frame::trailers(grpc::status_headers(
                                code,
                                "skewless: upstream stream ended abnormally",
                            )))))
                        } else {
                            this.kind = Kind::Done;
                            Poll::Ready(Some(Err(error)))
                        }
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Done => true,
            Kind::Upstream { body, .. } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Upstream { body, .. } => body.size_hint(),
            Kind::Done => SizeHint::with_exact(0),
        }
    }
}

/// Whether the upstream reset the stream with CANCEL (the server gave up on the call), which
/// says nothing about the endpoint's health.
fn upstream_cancelled(error: &hyper::Error) -> bool {
    h2_error(error).is_some_and(|h2| h2.reason() == Some(h2::Reason::CANCEL))
}
