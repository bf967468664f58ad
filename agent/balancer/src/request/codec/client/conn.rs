//! The reader of one client connection (`Conn`): the connection's life from its preface to
//! its close (handshake, drain, max age, idle, the two-phase GOAWAY), and every frame the
//! client sends. Sending requests upstream, waiting for an endpoint, deadlines and stalled
//! readers are in `dispatch`.

use super::*;

mod dispatch;

/// Serves one client connection until it closes.
pub(crate) async fn serve(pool: Arc<CodecPool>, stream: TcpStream, mut stop: Stop<Config>) {
    // The reader reads through `AsyncRead`, which takes a short read as "drained" (no read
    // that would find nothing); writers share the write half.
    let (mut read, write) = stream.into_split();
    let shared = Shared::new(write, ClientState::new(pool.metrics.clone()));
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
        pool: pool.clone(),
        shared: shared.clone(),
        decoder: HpackDecoder::new(HEADER_TABLE_SIZE as u32),
        fields: Fields::default(),
        dirty: Vec::new(),
        blocks: HeaderBlocks::default(),
        last_stream: 0,
        budgets: FrameBudgets::new(FloodLimits::default(), Instant::now()),
        settings_seen: false,
        settings_unacked: 1,
        magic: 0,
        winding: Winding::No,
        check: crate::settle::Check::new(),
        settle_by: None,
        client_ping_acks: 0,
        pinged: false,
        parked: std::collections::VecDeque::new(),
        backoffs: Vec::new(),
        ready: pool.readiness(),
        redispatch: shared.lock().redispatch.clone(),
        deadlines: std::collections::BinaryHeap::new(),
    };
    let mut rbuf = BytesMut::with_capacity(64 * 1024);
    // Until its preface (the magic, then its SETTINGS) is in, the connection has no stream to
    // finish: a drain or the handshake deadline closes it at once.
    let preface_deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let mut open = true;
    while open && !conn.settings_seen {
        tokio::select! {
            biased;
            _ = stop.drained() => {
                tracing::debug!("client wound down before its preface, closing");
                open = false;
            }
            () = tokio::time::sleep_until(preface_deadline) => {
                conn.pool.metrics.client_error(ClientErrorReason::NoPreface);
                tracing::debug!("client sent no HTTP/2 preface in time");
                open = false;
            }
            more = read_more(&mut read, &mut rbuf) => open = more && conn.input(&mut rbuf),
        }
    }
    if open {
        // From the preface on, its max age counts too, and its idleness: no stream and no PING
        // from one check to the next, every eighth of the idle timeout, for the whole timeout
        // (as on the h2 path). Told to wind down, or idle, it gets the two-phase GOAWAY of the
        // h2 path and its streams the drain grace to finish.
        let stopped = stop.stopped();
        tokio::pin!(stopped);
        let mut grace_end = None;
        let mut idle_since = Instant::now();
        let mut next_check = conn.pool.idle_check_after(idle_since);
        let idle_timer = tokio::time::sleep_until(next_check.unwrap_or(idle_since));
        tokio::pin!(idle_timer);
        // The stalled-reader check, every quarter of its timeout.
        let stall_every = conn.pool.stalled_reader_timeout().map(|t| t / 4);
        let stall_timer = tokio::time::sleep(stall_every.unwrap_or(HANDSHAKE_TIMEOUT));
        tokio::pin!(stall_timer);
        loop {
            tokio::select! {
                biased;
                _ = &mut stopped, if grace_end.is_none() => {
                    conn.wind_down();
                    grace_end = Some(Instant::now() + conn.pool.drain_grace());
                }
                () = &mut stall_timer, if stall_every.is_some() => {
                    let now = Instant::now();
                    if let Some(timeout) = conn.pool.stalled_reader_timeout() {
                        conn.reset_stalled(now, timeout);
                    }
                    if let Some(every) = stall_every {
                        stall_timer.as_mut().reset(now + every);
                    }
                }
                () = &mut idle_timer, if grace_end.is_none() && next_check.is_some() => {
                    let now = Instant::now();
                    let busy = !conn.shared.lock().streams.is_empty();
                    if busy || std::mem::take(&mut conn.pinged) {
                        idle_since = now;
                    } else if conn
                        .pool
                        .idle_timeout()
                        .is_some_and(|t| now.saturating_duration_since(idle_since) >= t)
                    {
                        tracing::debug!("client connection idle, winding it down");
                        conn.pool.metrics.rotated(RotationReason::Idle);
                        conn.wind_down();
                        grace_end = Some(now + conn.pool.drain_grace());
                    }
                    next_check = conn.pool.idle_check_after(now);
                    if let Some(at) = next_check {
                        idle_timer.as_mut().reset(at);
                    }
                }
                // Timers in `async` blocks: a disabled branch's expression is still evaluated,
                // and a timer made on every read would cost every call.
                () = async { tokio::time::sleep_until(grace_end.unwrap_or(preface_deadline)).await },
                    if grace_end.is_some() =>
                {
                    tracing::debug!("grace period over, closing client connection");
                    conn.final_go_away();
                    break;
                }
                () = async { tokio::time::sleep(WIND_DOWN_CHECK).await }, if grace_end.is_some() => {}
                _ = conn.ready.changed(), if !conn.parked.is_empty() => {
                    conn.dispatch_parked(Instant::now());
                }
                () = conn.redispatch.notified() => {
                    let retries = std::mem::take(&mut conn.shared.lock().retries);
                    conn.backoffs.extend(retries.into_iter().map(|(stream, at)| (at, stream)));
                    conn.retry_due(Instant::now());
                }
                () = async {
                    let first = conn.backoffs.iter().map(|&(at, _)| at).min();
                    tokio::time::sleep_until(first.unwrap_or(preface_deadline)).await;
                }, if !conn.backoffs.is_empty() => conn.retry_due(Instant::now()),
                () = async {
                    let first = conn.parked.front().map_or(preface_deadline, |&(_, at)| at);
                    tokio::time::sleep_until(first).await;
                }, if !conn.parked.is_empty() => conn.dispatch_parked(Instant::now()),
                () = async {
                    let first = conn
                        .deadlines
                        .peek()
                        .map_or(preface_deadline, |std::cmp::Reverse((at, _))| *at);
                    tokio::time::sleep_until(first).await;
                }, if !conn.deadlines.is_empty() => conn.expire(Instant::now()),
                more = read_more(&mut read, &mut rbuf) => {
                    if !(more && conn.input(&mut rbuf)) {
                        break;
                    }
                }
            }
            conn.settle(Instant::now());
            if conn.wound_down() {
                tracing::debug!("client connection wound down");
                break;
            }
        }
    }
    conn.close();
    // The write half sends its FIN once the writer task and the streams have let it go; what
    // the client still sends meanwhile is read and dropped, never answered with a reset.
    drop((conn, shared));
    tokio::spawn(crate::linger::discard(read));
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
    /// What its PINGs, SETTINGS and RST_STREAMs may spend (see [`crate::flood`]).
    budgets: FrameBudgets,
    /// Its first frame after the magic came, a SETTINGS without ACK as it must be.
    settings_seen: bool,
    /// Our SETTINGS frames the client has not acknowledged yet (the one sent at the start).
    settings_unacked: u32,
    /// How much of the magic (the preface's first 24 bytes) has come.
    magic: usize,
    winding: Winding,
    /// Settling: the check that the client has written every stream it created.
    check: crate::settle::Check,
    /// When the final GOAWAY goes even if the client has not settled.
    settle_by: Option<Instant>,
    /// PING ACKs the client sent (wrapping).
    client_ping_acks: u32,
    /// A PING (not an ACK) came since the last idle check: the client keeps the connection.
    pinged: bool,
    /// Streams waiting for a ready endpoint, with when each gives up, in arrival order.
    parked: std::collections::VecDeque<(u32, Instant)>,
    /// Moves when an upstream connection comes up: parked streams try again.
    ready: tokio::sync::watch::Receiver<u64>,
    /// Retries waiting out their backoff: when each goes, and its stream.
    backoffs: Vec<(Instant, u32)>,
    /// Woken when requests of this connection are to be sent again (see
    /// [`ClientState::retry`]).
    redispatch: Arc<tokio::sync::Notify>,
    /// The deadlines of streams whose request carried `grpc-timeout`, earliest first.
    deadlines: std::collections::BinaryHeap<std::cmp::Reverse<(Instant, u32)>>,
}

/// Where a connection is in its wind-down (the two-phase GOAWAY of RFC 9113 section 6.8, as
/// h2 sends it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Winding {
    No,
    /// GOAWAY with the highest stream id and a PING sent: streams the client opens before it
    /// sees them are still served.
    Pinged,
    /// The PING came back: the client opens no new stream, but streams it created before may
    /// still be on their way; the final GOAWAY waits until it has written them
    /// ([`crate::settle`]), or half the drain grace.
    Settling,
    /// The client has settled (or the time ran out): GOAWAY with the last stream id taken
    /// sent; streams above it are refused.
    Final {
        last: u32,
    },
}

/// Reads what the client sent into `rbuf`; `false` when the connection is over (EOF or an
/// error).
async fn read_more(read: &mut tokio::net::tcp::OwnedReadHalf, rbuf: &mut BytesMut) -> bool {
    if rbuf.capacity() - rbuf.len() < 16 * 1024 {
        rbuf.reserve(64 * 1024);
    }
    match read.read_buf(rbuf).await {
        Ok(0) => false,
        Ok(_) => true,
        Err(error) => {
            tracing::debug!(%error, "client read failed");
            false
        }
    }
}

impl Conn {
    /// Handles what the client sent: the magic, then every whole frame, flushing what they
    /// produced. `false` when the connection is over (a connection error, with its GOAWAY
    /// written).
    fn input(&mut self, rbuf: &mut BytesMut) -> bool {
        if self.magic < PREFACE.len() {
            let n = (PREFACE.len() - self.magic).min(rbuf.len());
            if rbuf[..n] != PREFACE[self.magic..self.magic + n] {
                tracing::debug!("client sent no HTTP/2 preface");
                self.pool.metrics.client_error(ClientErrorReason::Malformed);
                return false;
            }
            self.magic += n;
            rbuf.advance(n);
            if self.magic < PREFACE.len() {
                return true;
            }
        }
        let now = Instant::now();
        let mut frames = Frames::new(rbuf, MAX_FRAME);
        let mut failed = None;
        for frame in &mut frames {
            let result = match frame {
                Ok((head, payload)) => self
                    .guard(&head, now)
                    .and_then(|()| self.frame(head, payload, now)),
                Err(_) => Err(ErrorCode::FRAME_SIZE_ERROR),
            };
            if let Err(code) = result {
                failed = Some(code);
                break;
            }
        }
        let used = rbuf.len() - frames.rest().len();
        rbuf.advance(used);
        for up in self.dirty.drain(..) {
            up.flush();
        }
        if let Some(code) = failed {
            let mut state = self.shared.lock();
            GoAway {
                last_stream_id: self.last_stream,
                error_code: code,
                debug_data: b"",
            }
            .encode(&mut state.out.buf);
            self.shared.flush_locked(&mut state);
            return false;
        }
        self.shared.flush();
        true
    }

    /// Starts the wind-down: GOAWAY with the highest stream id, then a PING whose ACK says the
    /// client saw it.
    fn wind_down(&mut self) {
        if self.winding != Winding::No {
            return;
        }
        let mut state = self.shared.lock();
        GoAway {
            last_stream_id: MAX_STREAM_ID,
            error_code: ErrorCode::NO_ERROR,
            debug_data: b"",
        }
        .encode(&mut state.out.buf);
        Ping {
            ack: false,
            opaque: WIND_DOWN_PING,
        }
        .encode(&mut state.out.buf);
        drop(state);
        self.shared.flush();
        self.winding = Winding::Pinged;
        self.settle_by = Some(Instant::now() + self.pool.drain_grace() / 2);
    }

    /// Settling, after every turn of the connection: the next frame of the check, or the
    /// final GOAWAY once the client has written every stream it created or `settle_by` has
    /// passed (as on the h2 path, `request::wind_down`).
    fn settle(&mut self, now: Instant) {
        if self.winding != Winding::Settling {
            return;
        }
        if self.settle_by.is_some_and(|by| now >= by) {
            tracing::debug!("client not quiet within half the grace, final GOAWAY");
            self.final_go_away();
            return;
        }
        let quiet =
            !self.blocks.open() && self.shared.lock().streams.values().all(|s| s.request_ended);
        let next = self
            .check
            .step(self.last_stream, quiet, self.client_ping_acks);
        match next {
            crate::settle::Next::Wait => {}
            crate::settle::Next::Settings => {
                let mut state = self.shared.lock();
                self.check.settings_sent(self.settings_unacked);
                self.settings_unacked += 1;
                Settings::encode(false, &[], &mut state.out.buf);
                self.shared.flush_locked(&mut state);
            }
            crate::settle::Next::Ping => {
                let mut state = self.shared.lock();
                Ping {
                    ack: false,
                    opaque: SETTLE_PING,
                }
                .encode(&mut state.out.buf);
                self.shared.flush_locked(&mut state);
            }
            crate::settle::Next::Final => {
                tracing::debug!(last = self.last_stream, "client quiet, final GOAWAY");
                self.final_go_away();
            }
        }
    }

    /// The second GOAWAY, with the last stream id taken: nothing above it is served.
    fn final_go_away(&mut self) {
        if matches!(self.winding, Winding::Final { .. }) {
            return;
        }
        let last = self.last_stream;
        let mut state = self.shared.lock();
        GoAway {
            last_stream_id: last,
            error_code: ErrorCode::NO_ERROR,
            debug_data: b"",
        }
        .encode(&mut state.out.buf);
        // Written now: a connection whose grace is over closes right after.
        self.shared.flush_locked(&mut state);
        drop(state);
        self.winding = Winding::Final { last };
    }

    /// The wind-down is over: the final GOAWAY is out and no stream is left.
    fn wound_down(&self) -> bool {
        matches!(self.winding, Winding::Final { .. }) && self.shared.lock().streams.is_empty()
    }

    fn touch(&mut self, up: &Arc<UpShared>) {
        if !self.dirty.iter().any(|u| Arc::ptr_eq(u, up)) {
            self.dirty.push(up.clone());
        }
    }

    /// What every frame of the client's is checked for before it is handled: the first one
    /// must be a SETTINGS that is not an ACK (RFC 9113 section 3.4), and PINGs, SETTINGS and
    /// RST_STREAMs spend from their budgets, as on the h2 path (`request::flood_guard`). A
    /// client that breaks either is counted and cut off: `Err` with its GOAWAY's code.
    fn guard(&mut self, head: &Head, now: Instant) -> Result<(), ErrorCode> {
        if !std::mem::replace(&mut self.settings_seen, true)
            && (head.kind != Kind::Settings || head.is_ack())
        {
            tracing::debug!(kind = ?head.kind, "client's first frame is not its SETTINGS");
            self.pool.metrics.client_error(ClientErrorReason::Malformed);
            return Err(ErrorCode::PROTOCOL_ERROR);
        }
        if flood::budgeted(head) {
            self.spend(head, now)?;
        }
        Ok(())
    }

    /// Spends from the client's budget for a frame like `head`; a client that empties one
    /// is counted and cut off (`Err` with its GOAWAY's code).
    fn spend(&mut self, head: &Head, now: Instant) -> Result<(), ErrorCode> {
        if let Some(flood) = self.budgets.spend(head, now) {
            tracing::debug!(%flood, "client cut off");
            self.pool.metrics.client_error(flood.client_error_reason());
            return Err(ErrorCode::ENHANCE_YOUR_CALM);
        }
        Ok(())
    }

    /// A frame other than HEADERS or PRIORITY on a stream the client never opened is a
    /// connection error (RFC 9113 section 5.1, "idle").
    fn not_idle(&self, stream: u32) -> Result<(), ErrorCode> {
        if stream.is_multiple_of(2) || stream > self.last_stream {
            return Err(ErrorCode::PROTOCOL_ERROR);
        }
        Ok(())
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
                self.not_idle(head.stream_id)?;
                self.data(
                    head.stream_id,
                    data,
                    payload.len(),
                    head.has(flags::END_STREAM),
                    now,
                )
            }
            Kind::RstStream => {
                let rst =
                    RstStream::decode(&head, payload).map_err(|_| ErrorCode::PROTOCOL_ERROR)?;
                self.not_idle(rst.stream_id)?;
                self.cancel(rst.stream_id, now);
                Ok(())
            }
            Kind::Settings => {
                let settings =
                    Settings::decode(&head, payload).map_err(|_| ErrorCode::PROTOCOL_ERROR)?;
                if settings.ack {
                    // An acknowledgement of SETTINGS never sent: the client is broken (h2
                    // refuses it the same way).
                    self.settings_unacked = self
                        .settings_unacked
                        .checked_sub(1)
                        .ok_or(ErrorCode::PROTOCOL_ERROR)?;
                    self.check.client_settings_ack();
                    return Ok(());
                }
                let credits = {
                    let mut state = self.shared.lock();
                    let st = &mut *state;
                    for s in settings.iter() {
                        frames::apply_setting(s, &mut st.limits, &mut st.streams)?;
                        if s.id == SettingId::HEADER_TABLE_SIZE {
                            st.encoder.peer_table_size(s.value);
                        }
                    }
                    Settings::encode(true, &[], &mut st.out.buf);
                    st.resume()
                };
                self.give_back(credits);
                Ok(())
            }
            Kind::Ping if head.is_ack() => {
                let ping = Ping::decode(&head, payload).map_err(|_| ErrorCode::PROTOCOL_ERROR)?;
                self.client_ping_acks = self.client_ping_acks.wrapping_add(1);
                if ping.opaque == WIND_DOWN_PING && self.winding == Winding::Pinged {
                    self.winding = Winding::Settling;
                } else if ping.opaque == SETTLE_PING {
                    self.check.ping_acked();
                }
                Ok(())
            }
            Kind::Ping => {
                self.pinged = true;
                frames::answer_ping(&head, payload, &mut self.shared.lock().out.buf)
            }
            Kind::WindowUpdate => {
                let (stream, inc) = frames::window_update(&head, payload)?;
                if stream != 0 {
                    self.not_idle(stream)?;
                }
                let (credits, overflow) = {
                    let mut state = self.shared.lock();
                    let st = &mut *state;
                    let overflow =
                        frames::open_window(stream, inc, &mut st.limits, &mut st.streams);
                    (st.resume(), overflow)
                };
                self.give_back(credits);
                match overflow {
                    Ok(()) => Ok(()),
                    Err(frames::Overflow::Connection) => Err(ErrorCode::FLOW_CONTROL_ERROR),
                    Err(frames::Overflow::Stream) => {
                        self.stream_error(stream, ErrorCode::FLOW_CONTROL_ERROR, now);
                        Ok(())
                    }
                }
            }
            Kind::GoAway => {
                // The client's GOAWAY changes nothing here (it opens no stream after it), but
                // it is checked like any frame.
                GoAway::decode(&head, payload).map_err(|_| ErrorCode::PROTOCOL_ERROR)?;
                Ok(())
            }
            Kind::PushPromise => Err(ErrorCode::PROTOCOL_ERROR),
            Kind::Priority => {
                // Priority signals are ignored (RFC 9113 section 5.3.2), but the frame is
                // still checked (section 6.3).
                let stream = head.stream_id;
                if stream == 0 {
                    return Err(ErrorCode::PROTOCOL_ERROR);
                }
                let code = if payload.len() != 5 {
                    ErrorCode::FRAME_SIZE_ERROR
                } else if u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]])
                    & MAX_STREAM_ID
                    == stream
                {
                    // A stream cannot depend on itself.
                    ErrorCode::PROTOCOL_ERROR
                } else {
                    return Ok(());
                };
                self.stream_error(stream, code, now);
                Ok(())
            }
            Kind::Headers | Kind::Continuation | Kind::Unknown(_) => Ok(()),
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
        if stream.is_multiple_of(2) {
            // Clients open odd streams only (RFC 9113 section 5.1.1).
            return Err(ErrorCode::PROTOCOL_ERROR);
        }
        if stream <= self.last_stream {
            // Trailers of an open request are forwarded, those of a stream closed here first
            // ignored; on any other stream the id went back (RFC 9113 section 5.1.1).
            if !self.shared.lock().may_get_trailers(stream) {
                return Err(ErrorCode::PROTOCOL_ERROR);
            }
            return self.trailers(stream, end_stream, now);
        }
        // Opened, even if refused below: what the client still sends on it is not on an idle
        // stream.
        self.last_stream = stream;
        if let Winding::Final { last } = self.winding
            && stream > last
        {
            // Opened after the final GOAWAY: never served, so the client may retry it.
            self.refuse(stream, ErrorCode::REFUSED_STREAM);
            return Ok(());
        }
        if decoded.is_err() {
            self.refuse(stream, ErrorCode::REFUSED_STREAM);
            return Ok(());
        }
        if let Some(why) = malformed_request(&self.fields) {
            // A malformed request is a stream error (RFC 9113 section 8.1.1), as on the h2
            // path.
            tracing::debug!(stream, why, "malformed request");
            self.refuse(stream, ErrorCode::PROTOCOL_ERROR);
            return Ok(());
        }
        if self.shared.lock().streams.len() >= MAX_CLIENT_STREAMS as usize {
            self.refuse(stream, ErrorCode::REFUSED_STREAM);
            return Ok(());
        }
        let deadline = self
            .fields
            .get(b"grpc-timeout")
            .and_then(crate::grpc::parse_timeout_bytes)
            .and_then(|timeout| now.checked_add(timeout));
        if let Some(deadline) = deadline {
            // Forgotten when it is due if the stream is gone by then; the deadlines of streams
            // already over are swept out once they outnumber the most streams a connection
            // has, so they stay bounded however long the timeouts are.
            self.deadlines.push(std::cmp::Reverse((deadline, stream)));
            if self.deadlines.len() > 2 * MAX_CLIENT_STREAMS as usize {
                let state = self.shared.lock();
                self.deadlines
                    .retain(|std::cmp::Reverse((_, id))| state.streams.contains_key(id));
            }
        }
        // The copy that is sent (and kept), in a spare one's buffers.
        let mut request = self.shared.lock().spare.pop().unwrap_or_default();
        request.body.clear();
        request.credited = 0;
        request.tried.clear();
        request.attempts = 0;
        request.failed_with = None;
        request.deposited = false;
        request.arrived = Some(now);
        request.deadline = deadline;
        request.fields.copy_from(&self.fields);
        request.body.push(&[], end_stream);
        self.insert_stream(stream, end_stream, now, deadline);
        let give_up = now + self.pool.ready_timeout();
        self.dispatch(stream, request, now, give_up);
        Ok(())
    }

    fn insert_stream(
        &mut self,
        stream: u32,
        request_ended: bool,
        arrived: Instant,
        deadline: Option<Instant>,
    ) {
        let mut state = self.shared.lock();
        let window = state.limits.initial_window;
        state.streams.insert(
            stream,
            ClientStream {
                up: None,
                parked: None,
                replay: None,
                window,
                held: Held::default(),
                answered: false,
                stalled_since: None,
                request_ended,
                arrived,
                deadline,
                recv: RecvWindow::new(STREAM_WINDOW),
            },
        );
    }

    /// Answers `stream` with a trailers-only UNAVAILABLE saying `message`, and forgets it.
    fn unavailable(&mut self, stream: u32, message: &[u8]) {
        self.shared.lock().unavailable(stream, message, 0);
    }

    /// Request trailers (a second header block on an open stream).
    fn trailers(&mut self, stream: u32, end_stream: bool, now: Instant) -> Result<(), ErrorCode> {
        if !end_stream
            || self.fields.iter().any(|(name, value)| {
                name.first() == Some(&b':') || invalid_field(name, value).is_some()
            })
        {
            // Trailers that do not end the stream, or with pseudo-headers or invalid fields: a
            // malformed request (RFC 9113 section 8.1), reset both ways.
            tracing::debug!(stream, "malformed request trailers");
            let gone = self.shared.lock().take(stream, now);
            if let Some(s) = gone {
                self.forget(stream, s, now);
                self.refuse(stream, ErrorCode::PROTOCOL_ERROR);
            }
            return Ok(());
        }
        let target = {
            let mut state = self.shared.lock();
            match state.streams.get_mut(&stream) {
                Some(s) if !s.request_ended => {
                    s.request_ended = true;
                    for request in [&mut s.parked, &mut s.replay].into_iter().flatten() {
                        request.body.hold_trailers(self.fields.iter());
                    }
                    Ok(s.up.clone())
                }
                // Trailers after the client ended the stream (half-closed): a stream error
                // (RFC 9113 section 5.1).
                Some(_) => Err(ErrorCode::STREAM_CLOSED),
                None => Ok(None),
            }
        };
        let target = match target {
            Ok(target) => target,
            Err(code) => {
                self.stream_error(stream, code, now);
                return Ok(());
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
        Ok(())
    }

    /// A DATA frame of the client's: counted against its windows (`Err`: a connection
    /// error), sent upstream as far as the upstream's windows take it, the rest held there.
    /// The client's windows get back what went upstream now (and the padding); what is held
    /// comes back as the upstream's reader sends it.
    fn data(
        &mut self,
        stream: u32,
        data: &[u8],
        flow_len: usize,
        end_stream: bool,
        now: Instant,
    ) -> Result<(), ErrorCode> {
        let target = {
            let mut state = self.shared.lock();
            let st = &mut *state;
            st.recv.receive(flow_len)?;
            match st.streams.get_mut(&stream) {
                Some(s) if !s.request_ended => match s.recv.receive(flow_len) {
                    Ok(()) => {
                        s.request_ended = end_stream;
                        if let Some(replay) = &mut s.replay {
                            if replay.body.len() + data.len() > REPLAY_CAP {
                                s.replay = None;
                            } else {
                                replay.body.push(data, end_stream);
                            }
                        }
                        match (&mut s.parked, &s.up) {
                            (Some(parked), _) => {
                                // Kept until the request goes upstream, its window with it.
                                parked.body.push(data, end_stream);
                                let padding = flow_len - data.len();
                                if padding > 0 {
                                    st.released(stream, padding);
                                }
                                return Ok(());
                            }
                            (None, Some((up, up_stream))) => Ok((up.clone(), *up_stream)),
                            (None, None) => {
                                st.recv.release(flow_len, 0, &mut st.out.buf);
                                return Ok(());
                            }
                        }
                    }
                    Err(code) => Err(code),
                },
                // DATA after the client ended the stream (half-closed): a stream error (RFC
                // 9113 section 5.1).
                Some(_) => Err(ErrorCode::STREAM_CLOSED),
                None => {
                    // No stream to pass it on to: its window goes back at once. On a stream
                    // closed here first the client may not know yet (ignored); on any other
                    // closed one it breaks the protocol: a stream error (RFC 9113 section 5.1).
                    st.recv.release(flow_len, 0, &mut st.out.buf);
                    if st.closed_early.contains(&stream) {
                        return Ok(());
                    }
                    RstStream {
                        stream_id: stream,
                        error_code: ErrorCode::STREAM_CLOSED,
                    }
                    .encode(&mut st.out.buf);
                    drop(state);
                    // Every such reset spends from the client's RST_STREAM budget: a client
                    // cannot make the balancer write resets without end.
                    return self.spend(&Head::new(Kind::RstStream, 0, stream, 4), now);
                }
            }
        };
        let (up, up_stream) = match target {
            Ok(target) => target,
            Err(code) => {
                tracing::debug!(stream, ?code, "stream error on a client's DATA");
                self.stream_error(stream, code, now);
                self.shared.lock().released(stream, flow_len);
                return Ok(());
            }
        };
        let sent = up.lock().data(up_stream, data, end_stream);
        self.touch(&up);
        let passed = match sent {
            Some(n) => n + (flow_len - data.len()),
            // The upstream stream is over (its response ended first): dropped.
            None => flow_len,
        };
        if passed > 0 {
            self.shared.lock().released(stream, passed);
        }
        Ok(())
    }

    /// Response bytes that reached the client give their upstream streams' windows back.
    fn give_back(&mut self, credits: Vec<UpCredit>) {
        for (up, up_stream, n) in credits {
            up.lock().released(up_stream, n);
            self.touch(&up);
        }
    }

    /// The client reset `stream`, or it must go: reset the upstream stream.
    fn cancel(&mut self, stream: u32, now: Instant) {
        let Some(s) = self.shared.lock().take(stream, now) else {
            return;
        };
        self.forget(stream, s, now);
    }

    /// A stream taken out of the client's state ends upstream too: its upstream stream is
    /// reset with CANCEL and its lease finished; the request bytes it kept (held for the
    /// upstream, or parked) give the connection's window back.
    fn forget(&mut self, stream: u32, s: ClientStream, now: Instant) {
        let dropped = match (s.up, s.parked) {
            (Some((up, up_stream)), _) => {
                let (lease, dropped) = up.lock().cancel(up_stream, ErrorCode::CANCEL);
                self.touch(&up);
                if let Some(lease) = lease {
                    self.pool.finish(lease, Outcome::Cancelled, now);
                }
                dropped
            }
            // Parked: nothing went upstream.
            (None, Some(parked)) => parked.body.len() - parked.credited,
            (None, None) => 0,
        };
        if dropped > 0 {
            self.shared.lock().released(stream, dropped);
        }
    }

    /// A stream error (RFC 9113 section 5.4.2): `stream` is reset with `code` both ways.
    fn stream_error(&mut self, stream: u32, code: ErrorCode, now: Instant) {
        self.cancel(stream, now);
        self.refuse(stream, code);
    }

    fn refuse(&mut self, stream: u32, code: ErrorCode) {
        let mut state = self.shared.lock();
        if state.take(stream, Instant::now()).is_none() {
            // Refused as it opened: the client may still send its body and trailers.
            state.closed_early(stream);
        }
        RstStream {
            stream_id: stream,
            error_code: code,
        }
        .encode(&mut state.out.buf);
    }

    /// The connection is over: every stream still open is cancelled upstream.
    fn close(&mut self) {
        let now = Instant::now();
        let streams = self.shared.lock().take_all(now);
        for s in streams {
            let Some((up, up_stream)) = s.up else {
                continue;
            };
            let (lease, _) = up.lock().cancel(up_stream, ErrorCode::CANCEL);
            up.flush();
            if let Some(lease) = lease {
                self.pool.finish(lease, Outcome::Cancelled, now);
            }
        }
        self.shared.close();
    }
}

/// Why a pseudo-header's value makes a request malformed, if it does: a `:method` that is not
/// a token, a `:scheme`, `:authority` or `:path` with a byte outside visible ASCII (URI
/// syntax, RFC 3986; an h2-based server refuses a value that is not UTF-8 with its whole
/// connection).
#[expect(
    clippy::needless_bitwise_bool,
    reason = "every byte is looked at anyway: no branch per byte"
)]
fn invalid_pseudo_value(index: usize, value: &[u8]) -> Option<&'static str> {
    let valid = if index == 0 {
        !value.is_empty() && all_token(value)
    } else {
        value
            .iter()
            .fold(true, |ok, &b| ok & (b > 0x20) & (b < 0x7f))
    };
    (!valid).then_some("a pseudo-header value that is not valid")
}

/// Why a request's header list is malformed (RFC 9113 sections 8.2 and 8.3), if it is: a
/// pseudo-header that is unknown, repeated or after a regular field; no `:method` or no
/// `:scheme` or no `:path` (or an empty one); an invalid pseudo-header value
/// ([`invalid_pseudo_value`]) or field ([`invalid_field`]); a connection-specific
/// field, or a `te` other than `trailers`.
fn malformed_request(fields: &Fields) -> Option<&'static str> {
    let mut regular = false;
    // :method, :scheme, :authority, :path
    let mut seen = [false; 4];
    for (name, value) in fields.iter() {
        if let Some(pseudo) = name.strip_prefix(b":") {
            if regular {
                return Some("pseudo-header after a regular field");
            }
            let i = match pseudo {
                b"method" => 0,
                b"scheme" => 1,
                b"authority" => 2,
                b"path" => 3,
                _ => return Some("unknown pseudo-header"),
            };
            if std::mem::replace(&mut seen[i], true) {
                return Some("repeated pseudo-header");
            }
            if let Some(why) = invalid_pseudo_value(i, value) {
                return Some(why);
            }
            if i == 3 && value.is_empty() {
                return Some("empty :path");
            }
            continue;
        }
        regular = true;
        if let Some(why) = invalid_field(name, value) {
            return Some(why);
        }
        if is_connection_specific(name) {
            return Some("connection-specific field");
        }
        if name == b"te" && value != b"trailers" {
            return Some("te other than trailers");
        }
    }
    if !(seen[0] && seen[1] && seen[3]) {
        return Some("no :method, :scheme or :path");
    }
    None
}
