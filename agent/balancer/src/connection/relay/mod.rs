//! Connection mode's frame-level relay: one redirected client connection relayed 1:1 to one
//! backend TCP connection, frame by frame. Payloads are not decoded and HPACK is not touched:
//! SETTINGS, flow control and header compression stay end to end. The relay follows frame
//! boundaries (skewless-frame) to count requests and open streams, and rotates the connection
//! on the wire when told to, with the two-phase GOAWAY of `rotation`.
//!
//! Guarantees: no frame of the relay's own is written inside a header block, inside a
//! forwarded frame, or to the client before the backend's first frame; no GOAWAY is sent to
//! the backend; the last-stream-id the client is told never rises. Memory per connection is
//! two fixed buffers (`buffer_size` each) and a bounded stream table: a full buffer stops
//! reading that side (TCP backpressure), nothing is queued. The wire sequence and its
//! reasoning: docs/connection-mode.md.

mod conn;
mod detect;
mod pipe;
mod preface;
mod rotation;
mod streams;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

use crate::metrics::{RotationReason, ServiceMetrics};

pub use crate::flood::Flood;
pub use conn::ProtocolError;
pub use pipe::{Io, RelayEnd, RelayError};
pub use preface::{Preface, read_preface};

/// Another name of [`RotationReason`], the one rotation-reason type of both modes.
pub use crate::metrics::RotationReason as RotateReason;

/// A rotation reason as the relay's atomic cell holds it (0 is "none").
fn reason_code(reason: RotationReason) -> u8 {
    u8::try_from(reason.index() + 1).expect("a handful of reasons")
}

/// The reason `code` holds ([`reason_code`]), if any.
fn reason_of(code: u8) -> Option<RotationReason> {
    RotationReason::ALL
        .get(usize::from(code).checked_sub(1)?)
        .copied()
}

/// Limits and timeouts of one relayed connection.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// How long the first GOAWAY's PING may go unanswered before the final GOAWAY is sent
    /// anyway; clamped to 5-20 s, the range gRPC servers use (grpc-go 5 s, Java 10 s, C-core
    /// 20 s), and to half of `drain_grace` (the streams get time to finish after it).
    pub ping_timeout: Duration,
    /// From the first GOAWAY of a rotation to the reset of the streams still open.
    pub drain_grace: Duration,
    /// Bytes buffered per direction (at least 16 KiB + 9, one default-sized frame).
    pub buffer_size: usize,
    /// Open streams tracked per connection; a client that opens more (with a backend that
    /// allows it) has its connection closed.
    pub max_streams: usize,
    /// How long a new client connection may take to send its connection preface and first
    /// SETTINGS frame (request mode's handshake timeout).
    pub handshake_timeout: Duration,
    /// With no stream open and no PING from the client for this long (checked every eighth of
    /// it), the connection is rotated (`RotationReason::Idle`); `None`: never.
    pub idle_timeout: Option<Duration>,
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            ping_timeout: Duration::from_secs(10),
            drain_grace: Duration::from_secs(10),
            buffer_size: 32 * 1024,
            max_streams: 8192,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: None,
        }
    }
}

/// Live counters of one relayed connection, read by the controller without locks.
#[derive(Debug, Default)]
pub struct RelayStats {
    requests: AtomicU64,
    open_streams: AtomicU32,
    refused: AtomicU64,
    unrotatable: AtomicBool,
    lazy_requests: AtomicBool,
    user_agent_known: AtomicBool,
    backend_go_away: AtomicBool,
    rotating: AtomicU8,
}

impl RelayStats {
    /// Client HEADERS that opened a stream (refused ones excluded).
    #[must_use]
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Streams opened and not yet ended both ways or reset.
    #[must_use]
    pub fn open_streams(&self) -> u32 {
        self.open_streams.load(Ordering::Relaxed)
    }

    /// Streams the client opened after our final GOAWAY, refused with REFUSED_STREAM.
    #[must_use]
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// The client fails calls on any GOAWAY (tonic, recognised from the first request's
    /// user-agent): the controller should never rotate it, only place it well.
    #[must_use]
    pub fn unrotatable(&self) -> bool {
        self.unrotatable.load(Ordering::Relaxed)
    }

    /// The client writes its requests' HEADERS lazily and refuses the unwritten ones on any
    /// GOAWAY (nghttp2, in grpc-js; recognised from the first request's user-agent): its
    /// rotations hold the backend's frames behind a PING of ours until the client answers it,
    /// before the first GOAWAY.
    #[must_use]
    pub fn lazy_requests(&self) -> bool {
        self.lazy_requests.load(Ordering::Relaxed)
    }

    /// The first request's header block has been checked (false while pending, when it was
    /// too large to check, and when decoding it took over a second: such a connection counts
    /// as rotatable, and its rotations start with a quiesce as a lazy client's do).
    #[must_use]
    pub fn user_agent_known(&self) -> bool {
        self.user_agent_known.load(Ordering::Relaxed)
    }

    /// The backend sent a GOAWAY (its own max connection age, a restart).
    #[must_use]
    pub fn backend_go_away(&self) -> bool {
        self.backend_go_away.load(Ordering::Relaxed)
    }

    /// The reason of the rotation under way, if any.
    #[must_use]
    pub fn rotating(&self) -> Option<RotationReason> {
        reason_of(self.rotating.load(Ordering::Relaxed))
    }
}

struct Shared {
    stats: RelayStats,
    /// The Service's cells: every stream's duration (open to end, or reset) and the streams
    /// the backend reset or refused. `None` for a relay outside a balancer (tests).
    metrics: Option<Arc<ServiceMetrics>>,
    /// The reason asked for by the controller (0: none).
    rotate: AtomicU8,
    rotate_asked: Notify,
}

/// The controller's handle on one relayed connection: its counters, and `rotate`.
#[derive(Clone)]
pub struct RelayHandle {
    shared: Arc<Shared>,
}

impl Default for RelayHandle {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for RelayHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayHandle")
            .field("stats", &self.shared.stats)
            .finish_non_exhaustive()
    }
}

impl RelayHandle {
    #[must_use]
    pub fn new() -> Self {
        Self::with(None)
    }

    /// A handle whose relay records its streams into `metrics` (the Service's cells): each
    /// stream's duration from the client's HEADERS to its end both ways (or its reset), and
    /// the streams the backend reset or refused as failed calls.
    #[must_use]
    pub fn with_metrics(metrics: Arc<ServiceMetrics>) -> Self {
        Self::with(Some(metrics))
    }

    fn with(metrics: Option<Arc<ServiceMetrics>>) -> Self {
        Self {
            shared: Arc::new(Shared {
                stats: RelayStats::default(),
                metrics,
                rotate: AtomicU8::new(0),
                rotate_asked: Notify::new(),
            }),
        }
    }

    #[must_use]
    pub fn stats(&self) -> &RelayStats {
        &self.shared.stats
    }

    /// Starts the two-phase GOAWAY (once; later calls change nothing).
    pub fn rotate(&self, reason: RotationReason) {
        if self
            .shared
            .rotate
            .compare_exchange(0, reason_code(reason), Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.shared.rotate_asked.notify_one();
        }
    }
}

/// Relays `client` (an accepted `TcpStream` whose bytes have not been read yet) to `backend`
/// (a connected TCP stream to the chosen backend) until both sides are done; rotates the
/// connection when `handle.rotate` is called. Ends both sides with FIN, never RST.
///
/// # Errors
/// The client or the backend broke HTTP/2 (not HTTP/2 at all, a malformed or oversized
/// frame, too many streams), the client flooded it with PINGs, SETTINGS or RST_STREAMs or sent
/// no preface within `handshake_timeout`, or a socket failed; that connection alone is closed
/// (a client that spoke HTTP/2 first gets a GOAWAY with the error, then FIN both ways).
pub async fn relay(
    client: impl Io,
    backend: impl Io,
    settings: &RelaySettings,
    handle: RelayHandle,
) -> Result<RelayEnd, RelayError> {
    pipe::run(client, &[], backend, settings, handle.shared).await
}

/// [`relay`] for a client whose connection preface and first SETTINGS frame [`read_preface`]
/// has already read: they are relayed to the backend first, then what the client sends next.
///
/// # Errors
/// As [`relay`].
pub async fn relay_after(
    preface: Preface,
    client: impl Io,
    backend: impl Io,
    settings: &RelaySettings,
    handle: RelayHandle,
) -> Result<RelayEnd, RelayError> {
    pipe::run(client, preface.bytes(), backend, settings, handle.shared).await
}
