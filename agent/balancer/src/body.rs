//! The request body sent upstream: the client's body streamed through, with a bounded tap that
//! keeps a copy of what was sent so a request the upstream provably did not process
//! (REFUSED_STREAM, or above a GOAWAY's last stream id) can be replayed on another endpoint.
//!
//! When hyper drops a failed attempt's body, the client's unread remainder is handed back
//! through the tap, so the replay sends the kept prefix and then goes on streaming the rest.
//! Only the first [`REPLAY_CAP`] bytes are kept: a larger body turns the tap off (no buffering
//! of whole messages) and cannot be replayed. A response arriving also turns it off.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::sync::Notify;

/// Largest request body prefix kept for a replay.
pub(crate) const REPLAY_CAP: usize = 64 * 1024;

#[derive(Debug, Default)]
struct Tap {
    data: Vec<Bytes>,
    trailers: Option<HeaderMap>,
    size: usize,
    /// Too large, or a response arrived: nothing kept any more.
    off: bool,
    /// The client's body ended (all of it is in `data`/`trailers`).
    complete: bool,
    /// The unread remainder of the client's body, handed back when an attempt's body drops.
    rest: Option<Incoming>,
    returned: bool,
}

#[derive(Debug, Default)]
struct Shared {
    tap: Mutex<Tap>,
    returned: Notify,
}

/// Shared view of a request body's tap.
#[derive(Debug, Clone, Default)]
pub(crate) struct Replay(Arc<Shared>);

impl Replay {
    fn lock(&self) -> std::sync::MutexGuard<'_, Tap> {
        self.0.tap.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops keeping copies: the request can no longer be replayed (a response arrived).
    pub(crate) fn disable(&self) {
        let mut tap = self.lock();
        tap.off = true;
        tap.data = Vec::new();
        tap.trailers = None;
    }

    /// A body that replays what was sent and then streams the rest, once the failed attempt
    /// has handed the client's body back (waiting at most `wait`). `None` when the body cannot
    /// be replayed.
    pub(crate) async fn replay(&self, wait: Duration) -> Option<UpstreamBody> {
        let returned = self.0.returned.notified();
        tokio::pin!(returned);
        returned.as_mut().enable();
        if !self.lock().returned {
            // hyper drops the failed attempt's body on its own task, soon after the error.
            let _ = tokio::time::timeout(wait, returned).await;
        }
        let mut tap = self.lock();
        if tap.off || !(tap.returned || tap.complete) {
            return None;
        }
        tap.returned = false;
        let mut prefix: VecDeque<Frame<Bytes>> =
            tap.data.iter().cloned().map(Frame::data).collect();
        if let Some(t) = &tap.trailers {
            prefix.push_back(Frame::trailers(t.clone()));
        }
        let rest = tap.rest.take();
        Some(UpstreamBody {
            prefix,
            inner: rest,
            tap: self.clone(),
        })
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct UpstreamBody {
    /// Frames already read from the client in an earlier attempt.
    prefix: VecDeque<Frame<Bytes>>,
    /// The client's body (what has not been read yet).
    inner: Option<Incoming>,
    tap: Replay,
}

impl UpstreamBody {
    /// Streams `body` upstream, keeping a replayable copy while it is small.
    pub(crate) fn client(body: Incoming) -> (Self, Replay) {
        let tap = Replay::default();
        tap.lock().complete = body.is_end_stream();
        (
            Self {
                prefix: VecDeque::new(),
                inner: Some(body),
                tap: tap.clone(),
            },
            tap,
        )
    }
}

impl UpstreamBody {
    /// A body of fixed bytes made by the balancer itself (never replayed).
    pub(crate) fn fixed(bytes: Bytes) -> Self {
        let tap = Replay::default();
        tap.disable();
        let mut prefix = VecDeque::new();
        prefix.push_back(Frame::data(bytes));
        Self {
            prefix,
            inner: None,
            tap,
        }
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        let mut tap = self.tap.lock();
        if !tap.off {
            tap.rest = self.inner.take();
            tap.returned = true;
            drop(tap);
            self.tap.0.returned.notify_waiters();
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(frame) = this.prefix.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        let Some(body) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(body).poll_frame(cx);
        if let Poll::Ready(r) = &polled {
            let mut tap = this.tap.lock();
            match r {
                None => tap.complete = true,
                Some(Ok(frame)) if !tap.off => {
                    if let Some(data) = frame.data_ref() {
                        tap.size += data.len();
                        if tap.size > REPLAY_CAP {
                            tap.off = true;
                            tap.data = Vec::new();
                        } else {
                            tap.data.push(data.clone());
                        }
                    } else if let Some(t) = frame.trailers_ref() {
                        tap.trailers = Some(t.clone());
                        // Trailers end the body.
                        tap.complete = true;
                    }
                }
                Some(_) => {}
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_empty() && self.inner.as_ref().is_none_or(Incoming::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let kept: u64 = self
            .prefix
            .iter()
            .filter_map(Frame::data_ref)
            .map(|d| d.len() as u64)
            .sum();
        match &self.inner {
            Some(b) => {
                let h = b.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(kept + h.lower());
                if let Some(u) = h.upper() {
                    hint.set_upper(kept + u);
                }
                hint
            }
            None => SizeHint::with_exact(kept),
        }
    }
}
