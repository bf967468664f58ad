//! One HTTP/2 connection to an endpoint on the frame codec: the connect and handshake, the
//! state client readers write requests into ([`UpState`]), and the reader that routes every
//! response frame to the client stream it answers.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf as _, BytesMut};
use skewless_frame::{
    ErrorCode, Frames, GoAway, HEADER_LEN, Head, Kind, PREFACE, Ping, RstStream, Setting,
    SettingId, Settings, WindowUpdate, flags,
};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use super::client::{ClientShared, Failure, Responded};
use super::fields::{self, Fields, HpackDecoder, HpackEncoder};
use super::frames::{self, DEFAULT_WINDOW, HeaderBlocks, Held, RecvWindow, SendLimits};
use super::out::{HasOut, Out, Shared};
use super::{CodecPool, ConnectSettings, Lease, StreamMap};
use crate::endpoints::EndpointId;
use crate::metrics::FailureReason;
use crate::request::picker::Outcome;
use crate::request::status::Counters;
use crate::upstream::liveness::{self, Closed, LivenessConfig, Pings, Signals, Verdict};
use crate::upstream::{MAX_HEADER_LIST, STREAM_WINDOW, UPSTREAM_CONNECTION_WINDOW};

pub(crate) type UpShared = Shared<UpState>;

/// The HPACK table size both sides start with (RFC 7541 section 4.2 and RFC 9113 6.5.2), and
/// the largest this side's decoders accept (it never advertises another).
pub(crate) const HEADER_TABLE_SIZE: usize = 4096;
/// Largest frame this side accepts (it advertises no other SETTINGS_MAX_FRAME_SIZE).
pub(crate) const MAX_FRAME: u32 = skewless_frame::DEFAULT_MAX_FRAME_SIZE;

/// One upstream connection as the pool picks among an endpoint's: its shared state, and what
/// tells whether it takes another request without taking its lock.
pub(crate) struct UpConn {
    pub(crate) shared: Arc<UpShared>,
    /// Its requests outstanding (and its liveness monitor's view of it).
    signals: Arc<Signals>,
    /// The most requests it carries: the lower of the balancer's `max_streams_per_connection`
    /// and the server's SETTINGS_MAX_CONCURRENT_STREAMS.
    limit: Arc<AtomicU32>,
    /// Its PING is overdue: it takes no new request until the answer comes.
    pub(crate) suspect: bool,
}

impl UpConn {
    /// Requests outstanding on it.
    pub(crate) fn streams(&self) -> u32 {
        self.signals.streams()
    }

    /// The most requests it carries.
    pub(crate) fn limit(&self) -> u32 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Whether it takes another request now.
    pub(crate) fn takes_one(&self) -> bool {
        !self.suspect && self.signals.streams() < self.limit.load(Ordering::Relaxed)
    }
}

/// What client readers write into and the upstream reader routes by.
pub(crate) struct UpState {
    out: Out,
    encoder: HpackEncoder,
    next_stream_id: u32,
    routes: StreamMap<Route>,
    /// What may be sent to the server.
    limits: SendLimits,
    /// The balancer's `max_streams_per_connection`, and the most streams open at once (the
    /// lower of that and the server's SETTINGS_MAX_CONCURRENT_STREAMS), which the pool reads.
    max_streams: u32,
    limit: Arc<AtomicU32>,
    /// Told when a request ends on a connection that was full.
    pool: Weak<CodecPool>,
    /// No new streams: the server sent GOAWAY, or the connection ended.
    closed: bool,
    /// Told when the server sends GOAWAY: the connection is replaced at once.
    went_away: Arc<tokio::sync::Notify>,
    /// What the server may still send on the connection. Given back as soon as it arrives:
    /// only the streams' windows bound what a server can make the balancer hold, so one
    /// client that reads slowly holds up its own streams, not the connection others share.
    recv: RecvWindow,
    /// Streams whose request bytes wait for the server's windows, in the order they began to
    /// wait (ids of streams gone since are skipped).
    waiting: Vec<u32>,
    /// What the liveness monitor reads: requests outstanding (the routes), and whether the
    /// server spoke (the reader's).
    signals: Arc<Signals>,
    /// The liveness monitor's PING in flight.
    ping: PingInFlight,
}

/// The payload of the liveness monitor's PINGs: an ACK carrying it answers the one in flight.
const PING_PAYLOAD: [u8; 8] = *b"skewless";

/// The liveness monitor's PING (one at a time): whether it was answered, and who waits.
#[derive(Default)]
struct PingInFlight {
    answered: bool,
    waker: Option<Waker>,
}

impl HasOut for UpState {
    fn out(&mut self) -> &mut Out {
        &mut self.out
    }
}

/// Request bytes that reached the upstream for a client stream, whose window they give back:
/// the client connection, its stream, how many bytes.
pub(crate) type ClientCredit = (Arc<ClientShared>, u32, usize);

/// One request stream on this connection and the client stream it answers.
pub(crate) struct Route {
    client: Arc<ClientShared>,
    client_stream: u32,
    lease: Option<Lease>,
    /// Send window of this stream.
    window: i64,
    /// Request bytes (and the end) the server's windows have not taken yet.
    held: Held,
    /// What the server may still send on the stream: given back as its bytes reach the
    /// client.
    recv: RecvWindow,
    /// The response's headers arrived.
    answered: bool,
    /// The response's `:status` is a server error.
    failed_status: bool,
    /// How many of its request bytes, as they go, give the client's windows nothing back: a
    /// request sent again after a refusal starts with bytes that gave them back before.
    skip: usize,
}

impl UpState {
    fn new(signals: Arc<Signals>, max_streams: u32, pool: Weak<CodecPool>) -> Self {
        Self {
            signals,
            max_streams,
            limit: Arc::new(AtomicU32::new(max_streams)),
            pool,
            went_away: Arc::new(tokio::sync::Notify::new()),
            ping: PingInFlight::default(),
            out: Out::default(),
            encoder: HpackEncoder::new(),
            next_stream_id: 1,
            routes: StreamMap::default(),
            limits: SendLimits::new(),
            closed: false,
            recv: RecvWindow::new(UPSTREAM_CONNECTION_WINDOW),
            waiting: Vec::new(),
        }
    }

    /// Opens a stream for a request of `client`'s stream `client_stream`: writes its HEADERS
    /// (`fields`, encoded with this connection's encoder). `None` (the lease back) when the
    /// connection takes no new stream.
    pub(crate) fn open<'f>(
        &mut self,
        client: &Arc<ClientShared>,
        client_stream: u32,
        lease: Lease,
        end_stream: bool,
        fields: impl IntoIterator<Item = (&'f [u8], &'f [u8])>,
    ) -> Result<u32, Lease> {
        if self.closed
            || self.out.broken
            || self.next_stream_id > skewless_frame::MAX_STREAM_ID
            || self.routes.len() >= self.limit.load(Ordering::Relaxed) as usize
        {
            return Err(lease);
        }
        let id = self.next_stream_id;
        self.next_stream_id += 2;
        self.signals.stream_opened();
        fields::put_headers(&mut self.out.buf, &mut self.encoder, id, end_stream, fields);
        self.routes.insert(
            id,
            Route {
                client: client.clone(),
                client_stream,
                lease: Some(lease),
                window: self.limits.initial_window,
                held: Held::default(),
                recv: RecvWindow::new(STREAM_WINDOW),
                answered: false,
                failed_status: false,
                skip: 0,
            },
        );
        Ok(id)
    }

    /// Sends request body bytes on `stream` as far as the server's windows take them, and
    /// holds the rest until they open. Returns the bytes sent now, whose window the client
    /// stream gets back; `None` when the stream is gone.
    pub(crate) fn data(&mut self, stream: u32, payload: &[u8], end_stream: bool) -> Option<usize> {
        let route = self.routes.get_mut(&stream)?;
        let (sent, _) = frames::send_or_hold(
            &mut self.waiting,
            route,
            stream,
            &mut self.out.buf,
            &mut self.limits,
            payload,
            end_stream,
        );
        Some(sent)
    }

    /// The server's windows opened: sends what they now take of the held request bytes,
    /// stream by stream in the order they began to wait. Returns the bytes sent per client
    /// stream, whose windows the caller gives back.
    fn resume(&mut self) -> Vec<ClientCredit> {
        let mut credits = Vec::new();
        frames::resume_waiting(
            &mut self.waiting,
            &mut self.routes,
            &mut self.out.buf,
            &mut self.limits,
            &mut self.encoder,
            |_, route, sent, _| {
                let give = sent.saturating_sub(route.skip);
                route.skip = route.skip.saturating_sub(sent);
                if give > 0 {
                    credits.push((route.client.clone(), route.client_stream, give));
                }
                // The route stays until its response ends.
                false
            },
        );
        credits
    }

    /// Forgets the route of `stream`: its request is no longer outstanding here.
    fn remove(&mut self, stream: u32) -> Option<Route> {
        let full = self.routes.len() >= self.limit.load(Ordering::Relaxed) as usize;
        let route = self.routes.remove(&stream)?;
        self.signals.stream_closed();
        if full && let Some(pool) = self.pool.upgrade() {
            pool.room_freed();
        }
        Some(route)
    }

    /// The next `n` request bytes of `stream` that go out (after those sent already) give no
    /// window back: they gave it back before (a request sent again).
    pub(crate) fn skip_credits(&mut self, stream: u32, n: usize) {
        if let Some(route) = self.routes.get_mut(&stream) {
            route.skip = n;
        }
    }

    /// `n` of the server's response bytes on `stream` reached the client: their window goes
    /// back to the server.
    pub(crate) fn released(&mut self, stream: u32, n: usize) {
        if let Some(route) = self.routes.get_mut(&stream) {
            route.recv.release(n, stream, &mut self.out.buf);
        }
    }

    /// The client is gone from `stream` (reset, or its connection closed): reset it here too.
    /// Returns the lease, which the caller finishes, and the request bytes that were held for
    /// the server and are dropped.
    pub(crate) fn cancel(&mut self, stream: u32, code: ErrorCode) -> (Option<Lease>, usize) {
        let Some(mut route) = self.remove(stream) else {
            return (None, 0);
        };
        RstStream {
            stream_id: stream,
            error_code: code,
        }
        .encode(&mut self.out.buf);
        (route.lease.take(), route.held_uncredited())
    }
}

/// What an endpoint's connection task is asked by the pool.
pub(crate) struct Asks {
    /// A PING that proves the endpoint alive (its ejection is over).
    pub(crate) probe: Arc<tokio::sync::Notify>,
    /// More connections: every one is full.
    pub(crate) grow: Arc<tokio::sync::Notify>,
    /// Closed when the endpoint leaves the Service.
    pub(crate) unlisted: watch::Receiver<()>,
}

/// Whether the endpoint has left the Service.
fn unlisted(rx: &watch::Receiver<()>) -> bool {
    rx.has_changed().is_err()
}

/// Connects to the endpoint and keeps a connection up: publishes it to the pool once the
/// server's SETTINGS are in, watches it with the liveness monitor, and replaces it when it
/// ends or is found dead; opens more connections when asked (they live until they end and
/// are not replaced). Once the endpoint leaves the Service, every connection takes no new
/// request, finishes what it carries and closes, and the task ends.
pub(crate) async fn connection_task(
    pool: Weak<CodecPool>,
    id: EndpointId,
    addr: SocketAddr,
    asks: Asks,
) {
    let Asks {
        probe,
        grow,
        unlisted: mut gone,
    } = asks;
    let mut extras = tokio::task::JoinSet::new();
    let mut backoff = Duration::from_millis(50);
    while !unlisted(&gone) {
        // Backs off only when connects fail or connections die young.
        // As of this connect: a reconfiguration applies from the next one.
        let Some(settings) = pool.upgrade().map(|p| p.connect_settings()) else {
            return;
        };
        let connecting = tokio::time::timeout(settings.timeout, connect(addr, &settings.liveness));
        let connected = tokio::select! {
            connected = connecting => connected,
            _ = gone.changed() => break,
        };
        match connected {
            Ok(Ok((stream, rbuf))) => {
                let more = || {
                    while extras.try_join_next().is_some() {}
                    let wanted = pool.upgrade().map_or(0, |p| {
                        p.connections_wanted(id, settings.max_streams, settings.max_connections)
                    });
                    while extras.len() + 1 < wanted {
                        tracing::debug!(
                            connections = extras.len() + 2,
                            "opening another connection"
                        );
                        extras.spawn(tracing::Instrument::in_current_span(extra_connection(
                            pool.clone(),
                            id,
                            addr,
                            gone.clone(),
                        )));
                    }
                };
                let primary = Some((&*probe, &*grow, more));
                let started = Instant::now();
                serve(&pool, id, stream, rbuf, &settings, primary, gone.clone()).await;
                // Replaced at once, unless connections keep dying young (as on the h2 path).
                if started.elapsed() >= Duration::from_millis(100) {
                    backoff = Duration::from_millis(50);
                    continue;
                }
            }
            Ok(Err(error)) => tracing::debug!(%error, "connect failed"),
            Err(_) => tracing::debug!("connect timed out"),
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = gone.changed() => break,
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
    // Unlisted: the extra connections finish their calls too.
    while extras.join_next().await.is_some() {}
}

/// One more connection to the endpoint, used until it ends.
async fn extra_connection(
    pool: Weak<CodecPool>,
    id: EndpointId,
    addr: SocketAddr,
    gone: watch::Receiver<()>,
) {
    let Some(settings) = pool.upgrade().map(|p| p.connect_settings()) else {
        return;
    };
    match tokio::time::timeout(settings.timeout, connect(addr, &settings.liveness)).await {
        Ok(Ok((stream, rbuf))) if !unlisted(&gone) => {
            serve::<fn()>(&pool, id, stream, rbuf, &settings, None, gone).await;
        }
        Ok(Ok(_)) => {}
        Ok(Err(error)) => tracing::debug!(%error, "connect failed"),
        Err(_) => tracing::debug!("connect timed out"),
    }
}

/// Serves one connection to endpoint `id` until it ends, or until it carries nothing once
/// the endpoint is unlisted (`gone`): publishes it to the pool, reads the server's frames, and
/// watches it with the liveness monitor; then fails what it still carries. The endpoint's
/// own connection (`primary`) also answers the asks for a proving PING and for more
/// connections (`more`).
async fn serve<F: FnMut()>(
    pool: &Weak<CodecPool>,
    id: EndpointId,
    stream: TcpStream,
    rbuf: BytesMut,
    settings: &ConnectSettings,
    primary: Option<(&tokio::sync::Notify, &tokio::sync::Notify, F)>,
    mut gone: watch::Receiver<()>,
) {
    let (read, write) = stream.into_split();
    let signals = Arc::new(Signals::default());
    let state = UpState::new(signals.clone(), settings.max_streams, pool.clone());
    let limit = state.limit.clone();
    let went_away = state.went_away.clone();
    let shared = Shared::new(write, state);
    let Some(p) = pool.upgrade() else {
        shared.close();
        return;
    };
    p.add_upstream(
        id,
        UpConn {
            shared: shared.clone(),
            signals: signals.clone(),
            limit,
            suspect: false,
        },
    );
    drop(p);
    tracing::debug!("connected");
    let report = |report| {
        if let Some(p) = pool.upgrade() {
            p.liveness_report(id, &shared, report);
        }
    };
    let (probe, grow, mut more) = match primary {
        Some((probe, grow, more)) => (Some(probe), Some(grow), Some(more)),
        None => (None, None, None),
    };
    // The connect's PING counts against the allowance (no HEADERS or DATA since).
    let alive = liveness::monitor(
        UpPings(shared.clone()),
        &signals,
        &settings.liveness,
        1,
        probe,
        report,
    );
    tokio::pin!(alive);
    // Boxed: after a GOAWAY it goes on on a task of its own.
    let mut reading = Box::pin(run(
        pool.clone(),
        shared.clone(),
        signals.clone(),
        read,
        rbuf,
    ));
    loop {
        tokio::select! {
            () = &mut reading => break,
            verdict = &mut alive => {
                match verdict {
                    Verdict::Dead => {
                        // Its calls fail now, not at their deadlines.
                        if let Some(p) = pool.upgrade() {
                            p.connection_dead(id);
                        }
                    }
                    Verdict::ProbeNeedsNewConnection => {
                        tracing::debug!("probing with a new connection once this one is idle");
                        retire(pool, id, &shared, &signals, reading.as_mut()).await;
                    }
                    Verdict::Closed => {}
                }
                break;
            }
            () = async {
                match grow {
                    Some(grow) => grow.notified().await,
                    None => std::future::pending().await,
                }
            } => {
                if let Some(more) = &mut more {
                    more();
                }
            }
            _ = gone.changed() => {
                tracing::debug!("endpoint unlisted, closing its connection once idle");
                retire(pool, id, &shared, &signals, reading.as_mut()).await;
                break;
            }
            () = went_away.notified() => {
                // As the h2 path does: a new connection takes its place now (the caller's
                // loop), while this one finishes the calls at or below the GOAWAY's last
                // stream id on a task of its own.
                tracing::debug!("upstream sent GOAWAY, replacing the connection");
                let (pool, shared, signals) = (pool.clone(), shared.clone(), signals.clone());
                tokio::spawn(tracing::Instrument::in_current_span(async move {
                    retire(&pool, id, &shared, &signals, reading.as_mut()).await;
                    fail_all(&pool, &shared);
                    shared.close();
                }));
                return;
            }
        }
    }
    if let Some(p) = pool.upgrade() {
        p.remove_upstream(id, &shared);
    }
    fail_all(pool, &shared);
    shared.close();
}

/// Takes no new call on the connection and lets the calls it carries run to their end
/// (reading on), looking every 100 ms whether they are over.
async fn retire(
    pool: &Weak<CodecPool>,
    id: EndpointId,
    shared: &Arc<UpShared>,
    signals: &Signals,
    mut reading: std::pin::Pin<&mut impl Future<Output = ()>>,
) {
    if let Some(p) = pool.upgrade() {
        p.remove_upstream(id, shared);
    }
    shared.lock().closed = true;
    while signals.streams() > 0 {
        tokio::select! {
            () = &mut reading => return,
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}

/// The liveness monitor's PINGs on a connection: written into its buffer, answered through
/// its reader.
struct UpPings(Arc<UpShared>);

impl Pings for UpPings {
    fn send_ping(&mut self) -> Result<(), Closed> {
        let mut state = self.0.lock();
        if state.out.broken {
            return Err(Closed);
        }
        state.ping.answered = false;
        Ping {
            ack: false,
            opaque: PING_PAYLOAD,
        }
        .encode(&mut state.out.buf);
        drop(state);
        self.0.flush();
        Ok(())
    }

    fn poll_pong(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Closed>> {
        let mut state = self.0.lock();
        if std::mem::take(&mut state.ping.answered) {
            return Poll::Ready(Ok(()));
        }
        if state.out.broken {
            return Poll::Ready(Err(Closed));
        }
        state.ping.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// The payload of the PING a connect ends with (the reader ignores its ACK).
const CONNECT_PING: [u8; 8] = *b"connect!";
/// What a server may send before it answers the connect's PING.
const CONNECT_READ_LIMIT: usize = 64 * 1024;

/// TCP connect (with the liveness TCP backstop), the preface and SETTINGS both ways, and a
/// PING: returns once the server has answered it (as on the h2 path, a server that completes
/// the handshake but does not serve its connection is never used), with what was read.
async fn connect(
    addr: SocketAddr,
    liveness: &LivenessConfig,
) -> std::io::Result<(TcpStream, BytesMut)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    liveness::set_tcp_options(&tcp, liveness)?;
    let mut hello = BytesMut::with_capacity(64);
    hello.extend_from_slice(PREFACE);
    Settings::encode(
        false,
        &[
            Setting {
                id: SettingId::ENABLE_PUSH,
                value: 0,
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
        &mut hello,
    );
    WindowUpdate {
        stream_id: 0,
        increment: UPSTREAM_CONNECTION_WINDOW - DEFAULT_WINDOW as u32,
    }
    .encode(&mut hello);
    Ping {
        ack: false,
        opaque: CONNECT_PING,
    }
    .encode(&mut hello);
    tcp.write_all(&hello).await?;
    let mut rbuf = BytesMut::with_capacity(64 * 1024);
    loop {
        if rbuf.len() >= HEADER_LEN {
            let head = Head::decode(rbuf[..HEADER_LEN].try_into().unwrap_or(&[0; HEADER_LEN]));
            if head.kind != Kind::Settings || head.has(flags::ACK) {
                return Err(std::io::Error::other("server did not start with SETTINGS"));
            }
            let answered = Frames::new(&rbuf, MAX_FRAME).any(|frame| {
                frame.is_ok_and(|(head, payload)| {
                    head.kind == Kind::Ping && head.has(flags::ACK) && payload == CONNECT_PING
                })
            });
            if answered {
                // Leave what came in the buffer: the reader applies the SETTINGS.
                return Ok((tcp, rbuf));
            }
            if rbuf.len() > CONNECT_READ_LIMIT {
                return Err(std::io::Error::other(
                    "server did not answer the connect's PING",
                ));
            }
        }
        if tcp.read_buf(&mut rbuf).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// Reads and routes the server's frames until the connection ends.
async fn run(
    pool: Weak<CodecPool>,
    shared: Arc<UpShared>,
    signals: Arc<Signals>,
    mut read: tokio::net::tcp::OwnedReadHalf,
    mut rbuf: BytesMut,
) {
    use tokio::io::AsyncReadExt as _;
    let mut decoder = HpackDecoder::new(HEADER_TABLE_SIZE as u32);
    let mut fields = Fields::default();
    let mut dirty: Vec<Arc<ClientShared>> = Vec::new();
    let mut blocks = HeaderBlocks::default();
    loop {
        if !rbuf.is_empty() {
            let Some(p) = pool.upgrade() else { return };
            let now = Instant::now();
            let mut frames = Frames::new(&rbuf, MAX_FRAME);
            let mut failed = None;
            let mut heard = false;
            for frame in &mut frames {
                let (head, payload) = match frame {
                    Ok(f) => f,
                    Err(error) => {
                        failed = Some(ErrorCode::FRAME_SIZE_ERROR);
                        tracing::debug!(%error, "bad frame from upstream");
                        break;
                    }
                };
                heard |= matches!(head.kind, Kind::Headers | Kind::Data);
                let mut reader = Reader {
                    pool: &p,
                    shared: &shared,
                    decoder: &mut decoder,
                    fields: &mut fields,
                    dirty: &mut dirty,
                    now,
                };
                if let Err(code) = reader.frame(head, payload, &mut blocks) {
                    failed = Some(code);
                    break;
                }
            }
            let used = rbuf.len() - frames.rest().len();
            rbuf.advance(used);
            if heard {
                signals.heard();
            }
            for client in dirty.drain(..) {
                client.flush();
            }
            shared.flush();
            if let Some(code) = failed {
                let mut state = shared.lock();
                GoAway {
                    last_stream_id: 0,
                    error_code: code,
                    debug_data: b"",
                }
                .encode(&mut state.out.buf);
                shared.flush_locked(&mut state);
                return;
            }
        }
        if rbuf.capacity() - rbuf.len() < 16 * 1024 {
            rbuf.reserve(64 * 1024);
        }
        match read.read_buf(&mut rbuf).await {
            Ok(0) => return,
            Ok(_) => {}
            Err(error) => {
                tracing::debug!(%error, "upstream read failed");
                return;
            }
        }
    }
}

/// One batch's view for handling the server's frames.
struct Reader<'a> {
    pool: &'a CodecPool,
    shared: &'a Arc<UpShared>,
    decoder: &'a mut HpackDecoder,
    fields: &'a mut Fields,
    dirty: &'a mut Vec<Arc<ClientShared>>,
    now: Instant,
}

impl Reader<'_> {
    fn touch(&mut self, client: &Arc<ClientShared>) {
        if !self.dirty.iter().any(|c| Arc::ptr_eq(c, client)) {
            self.dirty.push(client.clone());
        }
    }

    /// Handles one frame; `Err` with the code of a connection error.
    fn frame(
        &mut self,
        head: Head,
        payload: &[u8],
        blocks: &mut HeaderBlocks,
    ) -> Result<(), ErrorCode> {
        if blocks.open() || matches!(head.kind, Kind::Headers | Kind::Continuation) {
            if let Some((stream, end_stream, block)) = blocks.frame(head, payload)? {
                return self.headers(stream, &block, end_stream);
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
                )
            }
            Kind::RstStream => {
                let rst =
                    RstStream::decode(&head, payload).map_err(|_| ErrorCode::PROTOCOL_ERROR)?;
                self.failed(rst.stream_id, Failure::Reset(rst.error_code));
                Ok(())
            }
            Kind::Settings => self.settings(&head, payload),
            Kind::Ping => {
                let mut state = self.shared.lock();
                if head.has(flags::ACK) && payload == PING_PAYLOAD {
                    state.ping.answered = true;
                    if let Some(waker) = state.ping.waker.take() {
                        waker.wake();
                    }
                }
                frames::answer_ping(&head, payload, &mut state.out.buf)
            }
            Kind::WindowUpdate => {
                let (stream, inc) = frames::window_update(&head, payload)?;
                let credits = {
                    let mut state = self.shared.lock();
                    let st = &mut *state;
                    // A server that overflows a window is broken: its connection ends.
                    frames::open_window(stream, inc, &mut st.limits, &mut st.routes)
                        .map_err(|_| ErrorCode::FLOW_CONTROL_ERROR)?;
                    st.resume()
                };
                self.give_back(credits);
                Ok(())
            }
            Kind::GoAway => {
                let go = GoAway::decode(&head, payload).map_err(|_| ErrorCode::PROTOCOL_ERROR)?;
                tracing::debug!(last_stream_id = go.last_stream_id, "upstream sent GOAWAY");
                {
                    let mut state = self.shared.lock();
                    state.closed = true;
                    state.went_away.notify_one();
                }
                let above: Vec<u32> = self
                    .shared
                    .lock()
                    .routes
                    .keys()
                    .copied()
                    .filter(|&id| id > go.last_stream_id)
                    .collect();
                for id in above {
                    self.failed(id, Failure::GoneAway(go.error_code));
                }
                Ok(())
            }
            Kind::PushPromise => Err(ErrorCode::PROTOCOL_ERROR),
            Kind::Headers | Kind::Continuation | Kind::Priority | Kind::Unknown(_) => Ok(()),
        }
    }

    fn settings(&mut self, head: &Head, payload: &[u8]) -> Result<(), ErrorCode> {
        let settings = Settings::decode(head, payload).map_err(|_| ErrorCode::PROTOCOL_ERROR)?;
        if settings.ack {
            return Ok(());
        }
        let credits = {
            let mut state = self.shared.lock();
            let st = &mut *state;
            for s in settings.iter() {
                frames::apply_setting(s, &mut st.limits, &mut st.routes)?;
                match s.id {
                    SettingId::MAX_CONCURRENT_STREAMS => {
                        st.limit
                            .store(s.value.min(st.max_streams), Ordering::Relaxed);
                    }
                    SettingId::HEADER_TABLE_SIZE => st.encoder.peer_table_size(s.value),
                    _ => {}
                }
            }
            Settings::encode(true, &[], &mut st.out.buf);
            st.resume()
        };
        self.give_back(credits);
        Ok(())
    }

    /// Request bytes that reached the server give their client streams' windows back.
    fn give_back(&mut self, credits: Vec<ClientCredit>) {
        for (client, client_stream, n) in credits {
            client.lock().released(client_stream, n);
            self.touch(&client);
        }
    }

    fn headers(&mut self, stream: u32, block: &[u8], end_stream: bool) -> Result<(), ErrorCode> {
        let decoded = self
            .fields
            .decode(self.decoder, block, MAX_HEADER_LIST as usize);
        if let Err(super::fields::FieldsError::Compression(error)) = &decoded {
            tracing::debug!(?error, "upstream header block does not decode");
            return Err(ErrorCode::COMPRESSION_ERROR);
        }
        let mut state = self.shared.lock();
        let Some(route) = state.routes.get_mut(&stream) else {
            return Ok(());
        };
        let first = !route.answered;
        route.answered = true;
        if first {
            route.failed_status = self
                .fields
                .get(b":status")
                .is_some_and(|s| s.first() == Some(&b'5'));
        }
        let client = route.client.clone();
        let client_stream = route.client_stream;
        let failed_status = route.failed_status;
        if first && let Some(lease) = &route.lease {
            self.pool.headers_received(lease, self.now);
        }
        let (lease, dropped) = if end_stream {
            take_lease(state.remove(stream))
        } else {
            (None, 0)
        };
        drop(state);
        if dropped > 0 {
            client.lock().released(client_stream, dropped);
        }
        if decoded.is_err() {
            // Too large a list: the call fails, the connection goes on.
            self.fail(stream, &client, client_stream, lease);
            return Ok(());
        }
        if let Some(why) = super::fields::malformed_response(self.fields, first) {
            // A malformed response (RFC 9113 section 8.1.1): the call fails; passed on, it
            // could cost the client its whole connection.
            tracing::debug!(stream, why, "malformed response from upstream");
            self.fail(stream, &client, client_stream, lease);
            return Ok(());
        }
        let responded =
            client
                .lock()
                .respond_headers(client_stream, self.fields, end_stream, self.now);
        self.touch(&client);
        if responded == Responded::PastDeadline {
            self.pool.metrics.failed(FailureReason::Deadline);
            Counters::bump(&self.pool.counters.local_deadline_exceeded);
        }
        if let Some(lease) = lease {
            let outcome =
                if failed_status || self.fields.get(b"grpc-status") == Some(b"14".as_slice()) {
                    // The backend answered UNAVAILABLE (or a 5xx): the call failed.
                    self.pool.metrics.failed(FailureReason::Unavailable);
                    Outcome::Failure
                } else {
                    Outcome::Success
                };
            self.pool.finish(lease, outcome, self.now);
        } else if responded != Responded::Sent {
            self.cancel(stream, &client, client_stream);
        }
        Ok(())
    }

    /// A DATA frame of the server's: counted against its windows (`Err`: a connection
    /// error), sent to the client as far as the client's windows take it, the rest held
    /// there. The stream's window gets back what reached the client now (and the padding);
    /// what is held comes back as the client's reader sends it.
    fn data(
        &mut self,
        stream: u32,
        data: &[u8],
        flow_len: usize,
        end_stream: bool,
    ) -> Result<(), ErrorCode> {
        let mut state = self.shared.lock();
        let st = &mut *state;
        st.recv.receive(flow_len)?;
        st.recv.release(flow_len, 0, &mut st.out.buf);
        let Some(route) = st.routes.get_mut(&stream) else {
            return Ok(());
        };
        let client = route.client.clone();
        let client_stream = route.client_stream;
        if route.recv.receive(flow_len).is_err() {
            drop(state);
            tracing::debug!(stream, "upstream overran the stream's flow-control window");
            let (lease, dropped) = self
                .shared
                .lock()
                .cancel(stream, ErrorCode::FLOW_CONTROL_ERROR);
            client
                .lock()
                .reset(client_stream, ErrorCode::INTERNAL_ERROR, dropped);
            self.touch(&client);
            if let Some(lease) = lease {
                self.pool.finish(lease, Outcome::Failure, self.now);
            }
            return Ok(());
        }
        let padding = flow_len - data.len();
        let (lease, dropped) = if end_stream {
            take_lease(st.remove(stream))
        } else {
            if padding > 0 {
                route.recv.release(padding, stream, &mut st.out.buf);
            }
            (None, 0)
        };
        drop(state);
        let sent = {
            let mut c = client.lock();
            if dropped > 0 {
                c.released(client_stream, dropped);
            }
            c.respond_data(client_stream, data, end_stream, self.now)
        };
        self.touch(&client);
        if let Some(lease) = lease {
            self.pool.finish(lease, Outcome::Success, self.now);
        } else {
            match sent {
                None => self.cancel(stream, &client, client_stream),
                Some(0) => {}
                Some(n) => self.shared.lock().released(stream, n),
            }
        }
        Ok(())
    }

    /// The server ended `stream` (`failure`): its request is sent again elsewhere if its
    /// response had not begun and the retry rules allow it; else the client's stream is
    /// reset with the server's code (REFUSED_STREAM above a GOAWAY's last stream id).
    fn failed(&mut self, stream: u32, failure: Failure) {
        let Some(mut route) = self.shared.lock().remove(stream) else {
            return;
        };
        self.touch(&route.client);
        if retried(self.pool, &mut route, failure, self.now) {
            return;
        }
        Counters::bump(&self.pool.counters.upstream_failures);
        self.pool.metrics.failed(failure.reason());
        let code = failure.code().unwrap_or(ErrorCode::INTERNAL_ERROR);
        let dropped = route.held_uncredited();
        route
            .client
            .lock()
            .reset(route.client_stream, code, dropped);
        if let Some(lease) = route.lease.take() {
            let outcome = if failure == Failure::Reset(ErrorCode::CANCEL) {
                Outcome::Cancelled
            } else {
                Outcome::Failure
            };
            self.pool.finish(lease, outcome, self.now);
        }
    }

    /// `client`'s stream `client_stream` is gone: reset the upstream one. The request bytes
    /// it held for the server give the client connection's window back.
    fn cancel(&mut self, stream: u32, client: &Arc<ClientShared>, client_stream: u32) {
        let (lease, dropped) = self.shared.lock().cancel(stream, ErrorCode::CANCEL);
        if dropped > 0 {
            client.lock().released(client_stream, dropped);
            self.touch(client);
        }
        if let Some(lease) = lease {
            self.pool.finish(lease, Outcome::Cancelled, self.now);
        }
    }

    fn fail(
        &mut self,
        stream: u32,
        client: &Arc<ClientShared>,
        client_stream: u32,
        lease: Option<Lease>,
    ) {
        client
            .lock()
            .reset(client_stream, ErrorCode::INTERNAL_ERROR, 0);
        self.touch(client);
        match lease {
            Some(lease) => self.pool.finish(lease, Outcome::Failure, self.now),
            None => self.cancel(stream, client, client_stream),
        }
    }
}

/// `route`'s request failed before its response began (`failure`): sends it again elsewhere
/// if the retry rules allow (`ClientState::retry`), finishing its lease with what the failure
/// says about the endpoint. `false`: not sent again, the lease left on the route.
fn retried(pool: &CodecPool, route: &mut Route, failure: Failure, now: Instant) -> bool {
    if route.answered {
        return false;
    }
    let Some(lease) = route.lease.take() else {
        return false;
    };
    let dropped = route.held_uncredited();
    let again =
        route
            .client
            .lock()
            .retry(route.client_stream, lease.id, dropped, failure, pool, now);
    match again {
        Some(wake) => {
            pool.finish(lease, failure.retried_outcome(), now);
            wake.notify_one();
            true
        }
        None => {
            route.lease = Some(lease);
            false
        }
    }
}

/// The connection ended: every stream on it that is not sent again fails, with UNAVAILABLE
/// where no response has begun (as gRPC clients report a lost connection), reset where one
/// has.
fn fail_all(pool: &Weak<CodecPool>, shared: &Arc<UpShared>) {
    let routes: Vec<Route> = {
        let mut state = shared.lock();
        state.closed = true;
        state.routes.drain().map(|(_, r)| r).collect()
    };
    let now = Instant::now();
    let pool = pool.upgrade();
    for mut route in routes {
        if let Some(p) = &pool
            && retried(p, &mut route, Failure::Lost, now)
        {
            route.client.flush();
            continue;
        }
        if let Some(p) = &pool {
            Counters::bump(&p.counters.upstream_failures);
            p.metrics.failed(Failure::Lost.reason());
        }
        let (stream, dropped) = (route.client_stream, route.held_uncredited());
        let mut client = route.client.lock();
        if route.answered {
            client.reset(stream, ErrorCode::INTERNAL_ERROR, dropped);
        } else {
            client.unavailable(
                stream,
                b"skewless: the upstream connection was lost",
                dropped,
            );
        }
        drop(client);
        route.client.flush();
        if let (Some(lease), Some(p)) = (route.lease.take(), &pool) {
            p.finish(lease, Outcome::Failure, now);
        }
    }
}

impl frames::Sending for Route {
    fn outgoing(&mut self) -> (&mut i64, &mut Held) {
        (&mut self.window, &mut self.held)
    }
}

impl Route {
    /// The request bytes held for the server that have not given the client's windows back
    /// (dropped with the route, they give them back then).
    fn held_uncredited(&self) -> usize {
        self.held.len().saturating_sub(self.skip)
    }
}

/// A route that ended: its lease, and the request bytes still held for the server (dropped:
/// the client's connection window gets them back).
fn take_lease(route: Option<Route>) -> (Option<Lease>, usize) {
    route.map_or((None, 0), |mut r| (r.lease.take(), r.held_uncredited()))
}

impl UpState {
    /// Sends request trailers on `stream`, which end it (after any request bytes held for
    /// the server's window).
    pub(crate) fn put_trailers(&mut self, stream: u32, trailers: &Fields) {
        if let Some(route) = self.routes.get_mut(&stream) {
            if route.held.is_waiting() {
                route.held.hold_trailers(trailers.iter());
                return;
            }
            fields::put_headers(
                &mut self.out.buf,
                &mut self.encoder,
                stream,
                true,
                trailers.iter(),
            );
        }
    }
}
