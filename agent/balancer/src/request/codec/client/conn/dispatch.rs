//! How a client connection's requests reach an endpoint: sent at once, parked until one is
//! ready, sent again elsewhere when refused; and the timers over its streams (deadlines,
//! stalled readers).

use super::*;

impl Conn {
    /// Ends the streams whose deadline has come: the client gets DEADLINE_EXCEEDED (trailers
    /// only, or trailers after the response so far), the upstream stream is cancelled.
    pub(super) fn expire(&mut self, now: Instant) {
        while let Some(&std::cmp::Reverse((at, stream))) = self.deadlines.peek() {
            if at > now {
                break;
            }
            self.deadlines.pop();
            let Some(gone) = self.shared.lock().deadline_exceeded(stream, now) else {
                continue;
            };
            tracing::debug!(stream, "deadline exceeded");
            self.pool.metrics.failed(FailureReason::Deadline);
            Counters::bump(&self.pool.counters.local_deadline_exceeded);
            self.forget(stream, gone, now);
        }
        for up in self.dirty.drain(..) {
            up.flush();
        }
        self.shared.flush();
    }

    /// Resets, both ways, the streams whose held response bytes have waited `timeout` or
    /// longer for a client that makes no room for them (as the h2 path does: a client that
    /// stopped reading frees what it held in bounded time).
    pub(super) fn reset_stalled(&mut self, now: Instant, timeout: std::time::Duration) {
        let stalled: Vec<(u32, ClientStream)> = {
            let mut state = self.shared.lock();
            let st = &mut *state;
            let due: Vec<u32> = st
                .waiting
                .iter()
                .copied()
                .filter(|id| {
                    st.streams.get(id).is_some_and(|s| {
                        s.held.is_waiting()
                            && s.stalled_since
                                .is_some_and(|t| now.saturating_duration_since(t) >= timeout)
                    })
                })
                .collect();
            due.into_iter()
                .filter_map(|id| {
                    let s = st.take(id, now)?;
                    RstStream {
                        stream_id: id,
                        error_code: ErrorCode::CANCEL,
                    }
                    .encode(&mut st.out.buf);
                    Some((id, s))
                })
                .collect()
        };
        for (stream, s) in stalled {
            tracing::debug!(stream, "client made no room for its response: reset");
            self.pool.metrics.failed(FailureReason::StalledReader);
            self.forget(stream, s, now);
        }
        for up in self.dirty.drain(..) {
            up.flush();
        }
        self.shared.flush();
    }

    /// The retries whose backoff is over at `now` are parked (to give up at the ready
    /// timeout) and try at once.
    pub(super) fn retry_due(&mut self, now: Instant) {
        let give_up = now + self.pool.ready_timeout();
        let parked = &mut self.parked;
        self.backoffs.retain(|&(at, stream)| {
            let due = at <= now;
            if due {
                parked.push_back((stream, give_up));
            }
            !due
        });
        self.dispatch_parked(now);
    }

    /// The parked streams try again: each one sent upstream if an endpoint is ready now, or
    /// answered UNAVAILABLE once its ready timeout is over.
    pub(super) fn dispatch_parked(&mut self, now: Instant) {
        for (stream, give_up) in std::mem::take(&mut self.parked) {
            let request = self
                .shared
                .lock()
                .streams
                .get_mut(&stream)
                .and_then(|s| s.parked.take());
            if let Some(request) = request {
                self.dispatch(stream, request, now, give_up);
            }
        }
        for up in self.dirty.drain(..) {
            up.flush();
        }
        self.shared.flush();
    }

    /// Sends `request` of `stream` to a ready endpoint it was not sent to before, and keeps it
    /// as the stream's copy; parks it when the endpoints are still connecting (until
    /// `give_up`, then UNAVAILABLE); with nowhere to send it, answers UNAVAILABLE (no
    /// endpoints) or fails as its last attempt did (every endpoint was tried: reset with that
    /// attempt's code, REFUSED_STREAM letting the client try again later, or UNAVAILABLE for
    /// a lost connection).
    pub(super) fn dispatch(
        &mut self,
        stream: u32,
        mut request: Box<Request>,
        now: Instant,
        give_up: Instant,
    ) {
        loop {
            let first = !std::mem::replace(&mut request.deposited, true);
            let (up, lease) = match self.pool.pick(now, &request.tried, first) {
                Ok(picked) => picked,
                Err(NoPick::NotReady) if now < give_up => {
                    if let Some(s) = self.shared.lock().streams.get_mut(&stream) {
                        s.parked = Some(request);
                        self.parked.push_back((stream, give_up));
                    }
                    return;
                }
                Err(no_pick) => {
                    let kept = request.body.len() - request.credited;
                    let counters = &self.pool.counters;
                    let (cell, reason) = match request.failed_with {
                        _ if request.attempts == 0 => {
                            (&counters.local_unavailable, FailureReason::Unavailable)
                        }
                        Some(code) => (&counters.upstream_failures, Failure::Reset(code).reason()),
                        None => (&counters.upstream_failures, Failure::Lost.reason()),
                    };
                    Counters::bump(cell);
                    self.pool.metrics.failed(reason);
                    if no_pick == NoPick::NotReady {
                        self.unavailable(stream, b"skewless: no endpoint became ready in time");
                    } else if request.tried.is_empty() {
                        self.unavailable(stream, b"skewless: the service has no endpoints");
                    } else if let Some(code) = request.failed_with {
                        self.refuse(stream, code);
                    } else {
                        self.unavailable(stream, b"skewless: the upstream connection was lost");
                    }
                    if kept > 0 {
                        self.shared.lock().released(stream, kept);
                    }
                    return;
                }
            };
            let endpoint = lease.id;
            request.update_timeout(now);
            let (data, end, trailers) = request.body.parts();
            let headers_end = end && data.is_empty() && trailers.is_none();
            let mut u = up.lock();
            let up_stream = match u.open(
                &self.shared,
                stream,
                lease,
                headers_end,
                request.fields.iter(),
            ) {
                Ok(up_stream) => up_stream,
                Err(lease) => {
                    // The connection takes no new stream (its server sent GOAWAY): another,
                    // which is no retry (nothing reached a server).
                    drop(u);
                    self.pool.finish(lease, Outcome::Cancelled, now);
                    request.tried.push(endpoint);
                    if request.attempts == 0 {
                        request.failed_with = Some(ErrorCode::REFUSED_STREAM);
                    }
                    continue;
                }
            };
            request.attempts += 1;
            let mut sent = 0;
            if !headers_end {
                if !data.is_empty() || trailers.is_none() {
                    sent = u
                        .data(up_stream, data, end && trailers.is_none())
                        .unwrap_or(0);
                }
                if let Some(trailers) = trailers {
                    u.put_trailers(up_stream, trailers);
                }
            }
            // The bytes that gave the window back before give nothing now: those sent, and
            // those the route holds (counted as they go).
            let credit = sent.saturating_sub(request.credited);
            u.skip_credits(up_stream, request.credited.saturating_sub(sent));
            drop(u);
            self.touch(&up);
            // From here on every byte of the copy gives the window back through this route.
            request.credited = request.body.len();
            let mut state = self.shared.lock();
            if let Some(s) = state.streams.get_mut(&stream) {
                s.up = Some((up, up_stream));
                if request.body.len() <= REPLAY_CAP {
                    s.replay = Some(request);
                }
            }
            if credit > 0 {
                state.released(stream, credit);
            }
            return;
        }
    }
}
