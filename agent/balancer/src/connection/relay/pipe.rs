//! The bytes: one fixed buffer per direction, read from one socket and written to the other
//! as whole frames or streamed payloads, in one task per connection that polls both sockets.
//!
//! A buffer holds `[start..scan)`: bytes whose frames are decided and not yet written, and
//! `[scan..end)`: bytes read and not yet looked at. Forwarded bytes are written straight from
//! the buffer (many frames per write; no copy, no allocation per frame). A dropped frame is cut
//! out of the buffer; frames of the relay's own (`Out`) are written only between frames and
//! outside header blocks.

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use skewless_frame::{ErrorCode, FrameError, HEADER_LEN, Head, PREFACE};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::conn::{Action, Conn, Out, ProtocolError, Side};
use super::rotation::Phase;
use super::{RelaySettings, RotationReason, Shared, detect};
use crate::linger::LINGER;

/// How a relayed connection ended (without a protocol or socket error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayEnd {
    /// A peer closed the connection (and the other side was then closed too), outside a
    /// rotation or with streams still open.
    Closed,
    /// Rotated: every stream finished, then both sides were closed (by the relay, or first by
    /// a peer once the rotation had started).
    Rotated(RotationReason),
    /// Rotated, but the drain grace ended first: `reset` streams were reset both ways.
    GraceExpired { reset: u32 },
}

/// What broke a relayed connection. Either way both of its sides are closed with FIN.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("the client broke HTTP/2")]
    ClientProtocol(#[source] ProtocolError),
    #[error("the backend broke HTTP/2")]
    BackendProtocol(#[source] ProtocolError),
    #[error("the client connection failed")]
    ClientIo(#[source] io::Error),
    #[error("the backend connection failed")]
    BackendIo(#[source] io::Error),
}

impl RelayError {
    /// The client caused it (a metric label: client or backend).
    #[must_use]
    pub fn is_client(&self) -> bool {
        matches!(self, Self::ClientProtocol(_) | Self::ClientIo(_))
    }

    fn protocol(side: Side, e: ProtocolError) -> Self {
        match side {
            Side::Client => Self::ClientProtocol(e),
            Side::Backend => Self::BackendProtocol(e),
        }
    }

    fn io(side: Side, e: io::Error) -> Self {
        match side {
            Side::Client => Self::ClientIo(e),
            Side::Backend => Self::BackendIo(e),
        }
    }
}

/// Compact the buffer when less than this is free behind its end.
const MIN_READ: usize = 4096;

/// One direction: bytes read from `side`'s socket, written to the other peer.
struct Pipe {
    side: Side,
    buf: Box<[u8]>,
    start: usize,
    scan: usize,
    end: usize,
    /// Payload bytes of the current forwarded frame not yet scanned.
    pass: u32,
    /// Payload bytes of the current dropped frame not yet removed.
    drop: u32,
    /// Client preface bytes still expected (client side only).
    preface_left: usize,
    /// The first frame has been seen: the peer's connection preface is through.
    started: bool,
    /// The source sent FIN.
    eof: bool,
    /// FIN sent to the destination.
    shut: bool,
    /// The client's first bytes, for the user-agent check (client side, until it is done).
    capture: Option<Vec<u8>>,
}

impl Pipe {
    fn new(side: Side, size: usize) -> Self {
        let client = side == Side::Client;
        Self {
            side,
            buf: vec![0; size.max(skewless_frame::DEFAULT_MAX_FRAME_SIZE as usize + HEADER_LEN)]
                .into_boxed_slice(),
            start: 0,
            scan: 0,
            end: 0,
            pass: 0,
            drop: 0,
            preface_left: if client { PREFACE.len() } else { 0 },
            started: false,
            eof: false,
            shut: false,
            capture: client.then(|| Vec::with_capacity(1024)),
        }
    }

    fn keep(&mut self, from: usize, to: usize) {
        if let Some(c) = &mut self.capture {
            if c.len() + (to - from) > detect::MAX_CAPTURE + PREFACE.len() {
                self.capture = None;
            } else {
                c.extend_from_slice(&self.buf[from..to]);
            }
        }
    }

    fn cut(&mut self, at: usize, n: usize) {
        self.buf.copy_within(at + n..self.end, at);
        self.end -= n;
    }

    /// Whether frames of the relay's own may be written now to this pipe's destination.
    fn may_inject(&self, conn: &Conn) -> bool {
        let (block, started) = match self.side {
            Side::Client => (conn.client_block, true),
            Side::Backend => (conn.backend_block, conn.backend_started),
        };
        self.started && started && self.pass == 0 && block.is_none()
    }

    /// Decides the frames in `[scan..end)`: as far as they are complete enough, or up to the
    /// next point where a frame of ours waits to be written.
    fn scan(&mut self, conn: &mut Conn, shared: &Arc<Shared>) -> Result<(), ProtocolError> {
        loop {
            if self.drop > 0 {
                let n = (self.drop as usize).min(self.end - self.scan);
                self.cut(self.scan, n);
                self.drop -= n as u32;
                if self.drop > 0 {
                    return Ok(());
                }
                continue;
            }
            if self.pass > 0 {
                let n = (self.pass as usize).min(self.end - self.scan);
                self.keep(self.scan, self.scan + n);
                self.scan += n;
                self.pass -= n as u32;
                if self.pass > 0 {
                    return Ok(());
                }
                continue;
            }
            if self.preface_left > 0 {
                let n = self.preface_left.min(self.end - self.scan);
                let at = PREFACE.len() - self.preface_left;
                if self.buf[self.scan..self.scan + n] != PREFACE[at..at + n] {
                    return Err(FrameError::BadPreface.into());
                }
                self.keep(self.scan, self.scan + n);
                self.scan += n;
                self.preface_left -= n;
                if self.preface_left > 0 {
                    return Ok(());
                }
                continue;
            }
            // At a frame boundary.
            if self.side == Side::Client
                && conn.first_block_done()
                && let Some(captured) = self.capture.take()
            {
                detect::spawn(captured, shared.clone());
            }
            let out = match self.side {
                Side::Client => &conn.to_backend,
                Side::Backend => &conn.to_client,
            };
            if (!out.is_empty() || conn.withholds(self.side)) && self.may_inject(conn) {
                return Ok(());
            }
            if self.end - self.scan < HEADER_LEN {
                return Ok(());
            }
            let header: &[u8; HEADER_LEN] = self.buf[self.scan..self.scan + HEADER_LEN]
                .try_into()
                .map_err(|_| ProtocolError::StrayContinuation)?;
            let head = Head::decode(header);
            let max = match self.side {
                Side::Client => conn.client_max_frame,
                Side::Backend => conn.backend_max_frame,
            };
            if head.len > max {
                return Err(FrameError::TooLarge {
                    kind: head.kind,
                    len: head.len,
                    max,
                }
                .into());
            }
            let need = Conn::needs(&head);
            if HEADER_LEN + need > self.buf.len() {
                return Err(ProtocolError::ControlFrameTooLarge { len: head.len });
            }
            if self.end - self.scan < HEADER_LEN + need {
                return Ok(());
            }
            let payload = self.scan + HEADER_LEN;
            let action = conn.on_frame(self.side, &head, &mut self.buf[payload..payload + need])?;
            self.started = true;
            if self.side == Side::Backend {
                conn.backend_started = true;
            }
            match action {
                Action::Forward | Action::Pass => {
                    let decided = HEADER_LEN + if action == Action::Forward { need } else { 0 };
                    self.keep(self.scan, self.scan + decided);
                    self.scan += decided;
                    self.pass = head.len - (decided - HEADER_LEN) as u32;
                }
                Action::Drop => {
                    self.cut(self.scan, HEADER_LEN);
                    self.drop = head.len;
                }
            }
        }
    }

    /// Writes the decided bytes, then (between frames) the relay's own frames for this
    /// destination. Ready(true) when something was written.
    fn poll_write(
        &mut self,
        cx: &mut Context<'_>,
        dst: &mut (impl AsyncWrite + Unpin + ?Sized),
        out: &mut Out,
        may_inject: bool,
    ) -> Poll<io::Result<bool>> {
        let mut wrote = false;
        loop {
            if self.start < self.scan {
                match Pin::new(&mut *dst).poll_write(cx, &self.buf[self.start..self.scan]) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                    Poll::Ready(Ok(n)) => {
                        self.start += n;
                        wrote = true;
                        continue;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => break,
                }
            }
            if self.start == self.end {
                self.start = 0;
                self.scan = 0;
                self.end = 0;
            }
            if !may_inject || out.is_empty() {
                break;
            }
            out.settle();
            match Pin::new(&mut *dst).poll_write(cx, &out.buf) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => {
                    out.buf.drain(..n);
                    wrote = true;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => break,
            }
        }
        if wrote {
            Poll::Ready(Ok(true))
        } else {
            Poll::Pending
        }
    }

    /// Reads what fits. Ready(true) when bytes (or the FIN) came in.
    fn poll_read(
        &mut self,
        cx: &mut Context<'_>,
        src: &mut (impl AsyncRead + Unpin + ?Sized),
    ) -> Poll<io::Result<bool>> {
        if self.eof {
            return Poll::Pending;
        }
        if self.buf.len() - self.end < MIN_READ && self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.scan -= self.start;
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            // Full: the writer (or the scan) makes room and is what wakes us.
            return Poll::Pending;
        }
        let mut rb = ReadBuf::new(&mut self.buf[self.end..]);
        ready!(Pin::new(src).poll_read(cx, &mut rb))?;
        let n = rb.filled().len();
        if n == 0 {
            self.eof = true;
        }
        self.end += n;
        Poll::Ready(Ok(true))
    }

    /// Nothing decided or of ours is left to write.
    fn flushed(&self, out: &Out) -> bool {
        self.start == self.scan && out.is_empty()
    }
}

/// A byte stream the relay can carry (a `TcpStream`; in-memory pipes in tests).
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Both halves of a peer's stream, as one object (so both directions share one loop body).
trait Stream: AsyncRead + AsyncWrite + Unpin {}
impl<T: AsyncRead + AsyncWrite + Unpin> Stream for T {}

/// What the I/O loop reports to the run loop.
enum Event {
    /// The quiesce ended with its ACK: step 1 of the rotation is queued.
    Announced,
    PingAcked,
    /// One peer closed and its FIN was passed on: the other gets `drain_grace` to follow.
    HalfClosed,
    Done(RelayEnd),
}

struct Relay {
    c2b: Pipe,
    b2c: Pipe,
    conn: Conn,
    shared: Arc<Shared>,
    grace_over: Option<u32>,
    half_closed: bool,
    /// The peer whose FIN came first.
    first_eof: Option<Side>,
    /// The backend's socket failed (a write, its FIN or a read: typically the backend closed
    /// and its kernel answered our next write with RST). Nothing more goes to it, and what it
    /// sent before still goes to the client (see [`Relay::break_backend`]).
    backend_broken: Option<io::Error>,
}

impl Relay {
    /// Moves bytes both ways until nothing more can move now (Pending) or the run loop must
    /// act (Ready).
    fn poll_io<C: Io, B: Io>(
        &mut self,
        cx: &mut Context<'_>,
        client: &mut C,
        backend: &mut B,
    ) -> Poll<Result<Event, RelayError>> {
        // Bounded rounds, then yield to the worker's other connections.
        for _ in 0..64 {
            let mut progress = false;
            for side in [Side::Client, Side::Backend] {
                // The backend's socket failed in this round: taken up after this side's turn.
                let mut broke = None;
                let broken = self.backend_broken.is_some();
                let (pipe, src, dst): (_, &mut dyn Stream, &mut dyn Stream) = match side {
                    Side::Client => (&mut self.c2b, &mut *client, &mut *backend),
                    Side::Backend => (&mut self.b2c, &mut *backend, &mut *client),
                };
                // Reading waits while our frames for the source pile up unwritten: a peer
                // that does not read cannot make the relay queue.
                let back = match side {
                    Side::Client => &self.conn.to_client,
                    Side::Backend => &self.conn.to_backend,
                };
                if back.buf.len() < 4096 {
                    match pipe.poll_read(cx, src) {
                        Poll::Ready(Ok(p)) => progress |= p,
                        Poll::Ready(Err(e)) if side == Side::Backend => {
                            // Everything the backend sent before the failure is read (the
                            // kernel returns queued bytes first): it ends there, as at a FIN.
                            pipe.eof = true;
                            broke = Some(e);
                            progress = true;
                        }
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(RelayError::io(side, e))),
                        Poll::Pending => {}
                    }
                    if pipe.eof && self.first_eof.is_none() {
                        self.first_eof = Some(side);
                    }
                }
                if let Err(e) = pipe.scan(&mut self.conn, &self.shared) {
                    return Poll::Ready(Err(RelayError::protocol(side, e)));
                }
                let may_inject = pipe.may_inject(&self.conn);
                let out = match side {
                    Side::Client => &mut self.conn.to_backend,
                    Side::Backend => &mut self.conn.to_client,
                };
                if pipe.shut {
                    // Our FIN went to that peer: nothing can follow it (a write fails with
                    // EPIPE), also not a rotation's frames queued after it (the settling's
                    // SETTINGS once a backend closed first).
                    *out = Out::default();
                }
                if pipe.eof && (out.is_empty() || !may_inject) && pipe.drop == 0 {
                    // The source is gone: a truncated last frame goes as it is.
                    pipe.scan = pipe.end;
                }
                if side == Side::Client && broken {
                    // The client's frames are still followed (its stream ends, resets and
                    // ACKs), but nothing can reach the backend any more.
                    pipe.start = pipe.scan;
                    *out = Out::default();
                    continue;
                }
                match pipe.poll_write(cx, dst, out, may_inject) {
                    Poll::Ready(Ok(p)) => progress |= p,
                    Poll::Ready(Err(e)) if side == Side::Client => {
                        broke = Some(e);
                        progress = true;
                    }
                    Poll::Ready(Err(e)) => {
                        return Poll::Ready(Err(RelayError::io(other(side), e)));
                    }
                    Poll::Pending => {}
                }
                if broke.is_none() && pipe.eof && !pipe.shut && pipe.flushed(out) {
                    match Pin::new(&mut *dst).poll_shutdown(cx) {
                        Poll::Ready(Ok(())) => {
                            pipe.shut = true;
                            progress = true;
                        }
                        Poll::Ready(Err(e)) if side == Side::Client => {
                            broke = Some(e);
                            progress = true;
                        }
                        Poll::Ready(Err(e)) => {
                            return Poll::Ready(Err(RelayError::io(other(side), e)));
                        }
                        Poll::Pending => {}
                    }
                }
                if let Some(e) = broke {
                    self.break_backend(e);
                }
            }
            if std::mem::take(&mut self.conn.rotation.quiesce_acked)
                && self.conn.rotation.phase == Phase::Quiescing
            {
                self.conn.announce();
                return Poll::Ready(Ok(Event::Announced));
            }
            progress |= self.conn.settle_step();
            if self.conn.rotation.ping_acked {
                self.conn.rotation.ping_acked = false;
                if self.conn.rotation.phase == Phase::Announced {
                    return Poll::Ready(Ok(Event::PingAcked));
                }
            }
            if let Some(end) = self.finished() {
                return Poll::Ready(Ok(Event::Done(end)));
            }
            if (self.c2b.shut || self.b2c.shut) && !self.half_closed {
                self.half_closed = true;
                return Poll::Ready(Ok(Event::HalfClosed));
            }
            if !progress {
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// The backend's socket failed. Typically the backend closed after its last stream (an h2
    /// server does once it has received a GOAWAY, e.g. one a client sent as it closed) while
    /// the client's WINDOW_UPDATEs for the end of a response were still on their way, and its
    /// kernel answered them with RST, while the relay still held the end of that response for
    /// a client that reads slowly. Aborting there cost the client a response the backend had
    /// completely sent. So the backend's side is over (nothing more is written to it; the
    /// client's frames are still followed, then discarded), and what it sent, in the buffer
    /// and in the socket (read until its end or error), still goes to the client, then FIN.
    /// The relay then ends as usual; only streams it leaves open make it a backend failure.
    fn break_backend(&mut self, e: io::Error) {
        if self.backend_broken.is_some() {
            return;
        }
        tracing::debug!(
            error = %e,
            phase = ?self.conn.rotation.phase,
            open = self.conn.open_streams(),
            held_bytes = self.b2c.end - self.b2c.start,
            "backend connection failed, delivering what it sent"
        );
        self.backend_broken = Some(e);
        self.first_eof.get_or_insert(Side::Backend);
        self.c2b.start = self.c2b.scan;
        self.c2b.shut = true;
        self.conn.to_backend = Out::default();
    }

    /// The connection is done: both peers closed, or the rotation has nothing left to carry.
    fn finished(&self) -> Option<RelayEnd> {
        if self.c2b.shut && self.b2c.shut {
            return Some(RelayEnd::Closed);
        }
        let quiet = |p: &Pipe, out: &Out| p.pass == 0 && p.flushed(out);
        let rotated = self.conn.rotation.phase == Phase::Final
            && self.conn.open_streams() == 0
            && self.conn.client_block.is_none()
            && self.conn.backend_block.is_none()
            && quiet(&self.c2b, &self.conn.to_backend)
            && quiet(&self.b2c, &self.conn.to_client);
        if !rotated {
            return None;
        }
        Some(match self.grace_over {
            Some(reset) => RelayEnd::GraceExpired { reset },
            None => RelayEnd::Rotated(self.conn.rotation.reason.unwrap_or(RotationReason::Drain)),
        })
    }

    /// FIN to both peers after writing what is decided, then read (and discard) until both
    /// close or `LINGER` passes, so nothing unread makes the kernel answer with RST (see
    /// [`crate::linger`], which closes request mode's client connections the same way).
    ///
    /// A client that broke the protocol after its preface gets `go_away` (a GOAWAY with the
    /// error) after the decided bytes, when they end between frames and outside a header
    /// block, so it learns why (ENHANCE_YOUR_CALM for a flood) instead of seeing a bare FIN;
    /// behind an empty SETTINGS of ours when no frame of the backend's reached it yet (a
    /// server's first frame is its SETTINGS).
    async fn close(
        &mut self,
        client: &mut impl Io,
        backend: &mut impl Io,
        go_away: Option<ErrorCode>,
    ) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let go_away = go_away
            .filter(|_| self.c2b.started && self.conn.backend_block.is_none() && self.b2c.pass == 0)
            .map(|code| {
                let mut frames = Vec::new();
                if !self.conn.backend_started {
                    // Nothing of the backend's reached the client yet: its first frame must
                    // be a server's SETTINGS (the connection ends after the GOAWAY anyway).
                    skewless_frame::Settings::encode(false, &[], &mut frames);
                }
                frames.extend(self.conn.error_go_away(code));
                frames
            });
        let _ = tokio::time::timeout(LINGER, async {
            let c2b = &self.c2b;
            let b2c = &self.b2c;
            let _ = backend.write_all(&c2b.buf[c2b.start..c2b.scan]).await;
            let _ = client.write_all(&b2c.buf[b2c.start..b2c.scan]).await;
            if let Some(frame) = &go_away {
                let _ = client.write_all(frame).await;
            }
            let _ = client.shutdown().await;
            let _ = backend.shutdown().await;
            // The pipes' buffers are free now: read into them.
            let (cbuf, bbuf) = (&mut self.c2b.buf, &mut self.b2c.buf);
            let (mut c_open, mut b_open) = (true, true);
            while c_open || b_open {
                tokio::select! {
                    r = client.read(cbuf), if c_open => c_open = matches!(r, Ok(n) if n > 0),
                    r = backend.read(bbuf), if b_open => b_open = matches!(r, Ok(n) if n > 0),
                }
            }
        })
        .await;
    }
}

fn other(side: Side) -> Side {
    match side {
        Side::Client => Side::Backend,
        Side::Backend => Side::Client,
    }
}

/// How long a rotation's quiesce (see `conn::Phase::Quiescing`) waits for the client's ACK
/// before the first GOAWAY goes out anyway: well above a client's PING round trip (a busy Node
/// answered within 70 ms nine times in ten in the rotation stress), short enough that a client
/// that never answers PINGs loses little.
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(1);

/// Step 1 of a rotation went out at `now`: when its PING times out, when the drain grace
/// ends, and when the settling does at the latest (half the grace).
fn announced(
    now: Instant,
    settings: &RelaySettings,
    ping_timeout: Duration,
) -> [Option<Instant>; 3] {
    [
        Some(now + ping_timeout),
        Some(now + settings.drain_grace),
        Some(now + settings.drain_grace / 2),
    ]
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Relays `client` to `backend`; `read` holds the client's first bytes, already read from it.
pub(super) async fn run<C: Io, B: Io>(
    mut client: C,
    read: &[u8],
    mut backend: B,
    settings: &RelaySettings,
    shared: Arc<Shared>,
) -> Result<RelayEnd, RelayError> {
    // Without an ACK the final GOAWAY comes at the PING timeout, but never later than half
    // the drain grace: the client's streams must get the final GOAWAY and time to finish,
    // not only the grace's resets (10 s each by default, and the grace fired first).
    let ping_timeout = settings
        .ping_timeout
        .clamp(Duration::from_secs(5), Duration::from_secs(20))
        .min(settings.drain_grace / 2);
    let mut c2b = Pipe::new(Side::Client, settings.buffer_size.max(read.len()));
    c2b.buf[..read.len()].copy_from_slice(read);
    c2b.end = read.len();
    let mut r = Relay {
        c2b,
        b2c: Pipe::new(Side::Backend, settings.buffer_size),
        conn: Conn::new(shared.clone(), settings.max_streams),
        shared: shared.clone(),
        grace_over: None,
        half_closed: false,
        first_eof: None,
        backend_broken: None,
    };
    // Cleared once the client's first frame (its SETTINGS, after the preface) is through.
    let mut handshake_deadline = Some(Instant::now() + settings.handshake_timeout);
    let mut half_closed_deadline = None;
    let mut ping_deadline = None;
    let mut grace_deadline = None;
    // Settling (our PING acknowledged): the final GOAWAY at the latest halfway through the
    // drain grace, for a client that never goes quiet.
    let mut settle_deadline = None;
    // After the grace, how long the resets may take to get out before the sockets close.
    let mut hard_deadline = None;
    // Quiescing (a lazy client's rotation): since when, and until when at most.
    let mut quiesce_started = None;
    let mut quiesce_deadline = None;
    // The idle check (see `RelaySettings::idle_timeout`): every eighth of the timeout, the
    // connection is idle since the last check that saw a stream or a client PING.
    let idle_every = settings.idle_timeout.map(|t| t / 8);
    let mut idle_check = idle_every.map(|every| Instant::now() + every);
    let mut idle_since = Instant::now();
    let mut seen = (shared.stats.requests(), r.conn.client_pings);
    let outcome = loop {
        let open = r.conn.rotation.phase == Phase::Open;
        let event = tokio::select! {
            biased;
            () = sleep_until(idle_check.filter(|_| open)) => {
                let now = Instant::now();
                idle_check = idle_every.map(|every| now + every);
                let now_seen = (shared.stats.requests(), r.conn.client_pings);
                if r.conn.open_streams() > 0 || now_seen != seen || !r.c2b.started {
                    seen = now_seen;
                    idle_since = now;
                    continue;
                }
                if settings.idle_timeout.is_some_and(|t| now - idle_since >= t) {
                    if let Some(m) = &shared.metrics {
                        m.rotated(RotationReason::Idle);
                    }
                    let at_once = r.conn.rotate(RotationReason::Idle);
                    tracing::debug!(quiesce = !at_once, "connection idle, rotating");
                    if at_once {
                        [ping_deadline, grace_deadline, settle_deadline] =
                            announced(now, settings, ping_timeout);
                    } else {
                        quiesce_started = Some(now);
                        quiesce_deadline = Some(now + QUIESCE_TIMEOUT);
                    }
                }
                continue;
            }
            () = shared.rotate_asked.notified(), if open => {
                let reason = super::reason_of(shared.rotate.load(Ordering::Relaxed))
                    .unwrap_or(RotationReason::Drain);
                let now = Instant::now();
                let at_once = r.conn.rotate(reason);
                tracing::debug!(reason = reason.label(), quiesce = !at_once, "rotating");
                if at_once {
                    [ping_deadline, grace_deadline, settle_deadline] =
                        announced(now, settings, ping_timeout);
                } else {
                    quiesce_started = Some(now);
                    quiesce_deadline = Some(now + QUIESCE_TIMEOUT);
                }
                continue;
            }
            () = sleep_until(quiesce_deadline) => {
                quiesce_deadline = None;
                tracing::debug!(
                    held_bytes = r.b2c.end - r.b2c.start,
                    "no ACK to the quiesce PING, first GOAWAY"
                );
                r.conn.announce();
                [ping_deadline, grace_deadline, settle_deadline] =
                    announced(Instant::now(), settings, ping_timeout);
                continue;
            }
            () = sleep_until(handshake_deadline) => {
                handshake_deadline = None;
                if r.c2b.started {
                    continue;
                }
                break Err(RelayError::ClientProtocol(ProtocolError::NoPreface(
                    settings.handshake_timeout,
                )));
            }
            () = sleep_until(half_closed_deadline) => break Ok(RelayEnd::Closed),
            () = sleep_until(hard_deadline) => break Ok(RelayEnd::GraceExpired {
                reset: r.grace_over.unwrap_or(0),
            }),
            () = sleep_until(grace_deadline) => {
                grace_deadline = None;
                ping_deadline = None;
                settle_deadline = None;
                let reset = r.conn.reset_all();
                tracing::debug!(reset, "drain grace over, resetting streams");
                r.grace_over = Some(reset);
                hard_deadline = Some(Instant::now() + Duration::from_secs(1));
                continue;
            }
            () = sleep_until(ping_deadline) => {
                ping_deadline = None;
                settle_deadline = None;
                tracing::debug!("no PING ACK, final GOAWAY");
                r.conn.finalize();
                continue;
            }
            () = sleep_until(settle_deadline.filter(|_| r.conn.rotation.phase == Phase::Settling)) => {
                settle_deadline = None;
                tracing::debug!(
                    open = r.conn.open_streams(),
                    "client not quiet within the settle time, final GOAWAY"
                );
                r.conn.finalize();
                continue;
            }
            event = poll_fn(|cx| r.poll_io(cx, &mut client, &mut backend)) => event,
        };
        match event {
            Ok(Event::Announced) => {
                quiesce_deadline = None;
                let now = Instant::now();
                let held_us = quiesce_started.map_or(0, |t| {
                    u64::try_from((now - t).as_micros()).unwrap_or(u64::MAX)
                });
                tracing::debug!(
                    held_us,
                    held_bytes = r.b2c.end - r.b2c.start,
                    "quiesce PING acknowledged, first GOAWAY"
                );
                [ping_deadline, grace_deadline, settle_deadline] =
                    announced(now, settings, ping_timeout);
            }
            Ok(Event::PingAcked) => {
                ping_deadline = None;
                r.conn.rotation.settle();
            }
            Ok(Event::HalfClosed) => {
                half_closed_deadline = Some(Instant::now() + settings.drain_grace);
            }
            Ok(Event::Done(end)) => break Ok(end),
            Err(e) => break Err(e),
        }
    };
    let outcome = match (outcome, r.backend_broken.take()) {
        // The backend failed with streams it never ended: those calls are lost.
        (Ok(_), Some(e)) if r.conn.open_streams() > 0 => Err(RelayError::BackendIo(e)),
        (outcome, _) => outcome,
    };
    // A peer that closes (or a backend whose socket fails) during a rotation, once every
    // stream is done, ends the rotation: it is the rotation's end, as when the relay closes
    // both sides itself. Which side closes first is timing (an h2 backend closes after its
    // last stream once the client's GOAWAY reached it, possibly before the relay has passed
    // that stream's end to a slowly reading client), and the end names why the connection
    // ended: the rotation asked for it, and nothing was lost.
    let outcome = match (outcome, r.conn.rotation.reason) {
        (Ok(RelayEnd::Closed), Some(reason)) if r.conn.open_streams() == 0 => {
            Ok(RelayEnd::Rotated(reason))
        }
        (outcome, _) => outcome,
    };
    match &outcome {
        Ok(end) => tracing::debug!(?end, requests = shared.stats.requests(), "relay done"),
        Err(error) => tracing::debug!(
            %error,
            source = std::error::Error::source(error).map(ToString::to_string),
            phase = ?r.conn.rotation.phase,
            open = r.conn.open_streams(),
            "relay failed"
        ),
    }
    let backend_lost = match &outcome {
        Err(e) => !e.is_client(),
        Ok(_) => r.first_eof == Some(Side::Backend),
    };
    r.conn.abandon(backend_lost);
    let go_away = match &outcome {
        Err(RelayError::ClientProtocol(e)) => {
            // Counted now, not after the close's linger: the client is gone for the metrics.
            if let Some(m) = &shared.metrics {
                m.client_error(e.client_error_reason());
            }
            Some(e.go_away_code())
        }
        _ => None,
    };
    r.close(&mut client, &mut backend, go_away).await;
    outcome
}
