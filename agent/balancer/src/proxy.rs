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

use crate::error::ForwardError;
use crate::grpc::{self, Code};
use crate::picker::{Outcome, SlotId};
use crate::pool::{Lease, Pool};

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
        Err(error) => rescue(&error, is_grpc),
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
    let message = match error {
        ForwardError::Upstream(source) => format!("skewless: {error}: {source}"),
        _ => format!("skewless: {error}"),
    };
    let mut resp = grpc::status_response::<ProxyBody>(code, &message);
    if !is_grpc {
        *resp.status_mut() = http_status;
    }
    resp
}

async fn forward(
    pool: &Arc<Pool>,
    mut req: Request<Incoming>,
    deadline: Option<Instant>,
) -> Result<Response<ProxyBody>, ForwardError> {
    let max_attempts = pool.config().max_attempts.max(1);
    let mut tried: Vec<SlotId> = Vec::new();
    // Re-dispatching a request that never left the balancer is free (nothing reached a server),
    // but still bounded so a flapping set of connections cannot spin.
    let mut redispatches = 0u32;
    loop {
        let mut lease = pool.acquire(&tried).await?;
        if let Some(deadline) = deadline {
            let remaining = deadline.saturating_duration_since(Instant::now());
            req.headers_mut()
                .insert(grpc::GRPC_TIMEOUT, grpc::encode_timeout(remaining));
        }
        match lease.sender.try_send_request(req).await {
            Ok(resp) => {
                lease.headers_received();
                return Ok(wrap(resp, lease, deadline));
            }
            Err(mut error) => {
                let Some(unsent) = error.take_message() else {
                    // Sent (at least partly) and failed: the body is gone, so this cannot be
                    // retried safely without buffering it.
                    let error = error.into_error();
                    tracing::debug!(addr = %lease.addr, %error, "upstream failed the request");
                    lease.finish(Outcome::Failure);
                    return Err(ForwardError::Upstream(error));
                };
                // The connection stopped taking streams (upstream GOAWAY or close) before this
                // request was written: send it elsewhere.
                tracing::debug!(addr = %lease.addr, "connection closed before dispatch, re-dispatching");
                pool.connection_closed(lease.id, lease.generation());
                tried.push(lease.id);
                lease.finish(Outcome::Cancelled);
                req = unsent;
                redispatches += 1;
                if redispatches >= max_attempts * 4 {
                    return Err(ForwardError::NoReadyEndpoint);
                }
                // The same endpoint may be the only one: let it be tried again once it has
                // reconnected.
                if tried.len() >= 8 {
                    tried.clear();
                }
            }
        }
    }
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
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return h2.reason() == Some(h2::Reason::CANCEL);
        }
        source = e.source();
    }
    false
}
