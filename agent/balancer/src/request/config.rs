//! Tuning of the balancer. Every field has a default chosen for gRPC services on one node; the
//! agent fills some from the Service's annotations, and `Balancer::reconfigure` applies a new
//! `Config` to a running balancer (every field takes effect live; see there for when).

use std::time::Duration;

pub use crate::request::retry_budget::RetryBudgetConfig;
pub use crate::upstream::liveness::LivenessConfig;

/// Configuration of one Service's balancer.
#[derive(Debug, Clone)]
pub struct Config {
    /// How long one TCP connect + HTTP/2 handshake to an endpoint may take.
    pub connect_timeout: Duration,
    /// How long a request waits for some endpoint to become ready (startup, reconnect) before
    /// it fails with UNAVAILABLE.
    pub ready_timeout: Duration,
    /// First and largest pause between reconnect attempts to an endpoint that refuses.
    pub reconnect_backoff: (Duration, Duration),
    /// Streams the balancer opens on one upstream connection before it opens another one to
    /// the same endpoint. The server's own SETTINGS_MAX_CONCURRENT_STREAMS counts too, when
    /// lower: a connection is full at the lower of the two. The default (1000) leaves it to
    /// the server in practice; a lower cap spreads a busy endpoint's streams over more
    /// connections, which costs CPU (more HTTP/2 state, smaller writes: 11.2 against 10.1 us
    /// per call at 100 against 1000, 8 client connections x 200 calls in flight).
    pub max_streams_per_connection: u32,
    /// Most connections to one endpoint.
    pub max_connections_per_endpoint: usize,
    /// How a silently dead upstream connection is found: HTTP/2 PINGs while requests are
    /// outstanding, TCP keepalive and `TCP_USER_TIMEOUT` (see [`LivenessConfig`]). Applies from
    /// the next upstream connect.
    pub liveness: LivenessConfig,
    /// Service name to watch with `grpc.health.v1.Health/Watch` on every endpoint ("" for
    /// the whole server); `None` turns active health checking off.
    pub health_service: Option<String>,
    /// Picker tuning.
    pub picker: PickerConfig,
    /// Retry budget, sized from the traffic: retries within its window may be `ratio` of the
    /// requests in that window plus `min_per_second`, so a burst of failures as large as the
    /// calls in flight is retried while a sustained failure adds at most that ratio to the
    /// load (the retry budgets of Finagle and Linkerd; see [`RetryBudgetConfig`]).
    pub retry_budget: RetryBudgetConfig,
    /// gRPC methods safe to retry after any transport failure (idempotent ones), as paths:
    /// `/pkg.Service/Method`, or `/pkg.Service/` for all of a service's methods. Other
    /// requests are retried only when the upstream provably did not process them.
    pub retryable_methods: Vec<String>,
    /// Most attempts per request that reach an upstream, the first one included. Re-dispatching
    /// a request that never left the balancer (its connection had been told GOAWAY) is not a
    /// retry and costs no budget, but is bounded too (`4 x max_attempts`).
    pub max_attempts: u32,
    /// Pause before retrying a request that failed while an upstream was processing it (a
    /// retryable method after a transport failure): the n-th retry waits a random time
    /// between half and all of `retry_backoff x 2^(n-1)` (the jittered exponential backoff of
    /// gRPC's retry policy and Envoy's). Pods that die together do not close their
    /// connections in the same instant, and an immediate retry can land on a pod whose death
    /// has not been seen yet, then on another: the pause lets their failures be seen first.
    /// Requests the upstream provably did not process are retried at once, and no retry
    /// starts unless its pause ends before the caller's deadline.
    pub retry_backoff: Duration,
    /// How long in-flight requests may run after shutdown starts (or after a connection reached
    /// its max age) before connections are cut.
    pub drain_grace: Duration,
    /// Client connections older than this (+-10% jitter) get a graceful GOAWAY, so long-lived
    /// clients reconnect now and then (and a new agent takes them over after an upgrade).
    pub max_connection_age: Option<Duration>,
    /// A client connection with no stream open, and no PING from the client, for this long
    /// (checked every eighth of it) gets a graceful GOAWAY, counted as an `idle` rotation: a
    /// client that went away without closing (or never uses its connection) holds nothing for
    /// ever. A gRPC client's keepalive PINGs keep its connection (they say the client wants
    /// it). `None`: no idle timeout.
    pub idle_timeout: Option<Duration>,
    /// Most client connections this balancer serves at once (one balancer per Service port and
    /// data-plane worker); one accepted beyond is closed at once and counted as
    /// `skewless_client_protocol_errors_total{reason="connection_limit"}`. Bounds what idle or
    /// hostile connections can cost (about 25 KiB each when idle).
    pub max_client_connections: usize,
    /// A response stream whose client makes no room for it (no WINDOW_UPDATE) for this long,
    /// while the balancer holds response data for it, is reset both ways (RST_STREAM(CANCEL)
    /// to the client and to the backend) and counted as a failed call,
    /// `reason="stalled_reader"`: a client that stopped reading frees what it held in bounded
    /// time. A client reading slowly is never reset (its window moves), nor one whose server
    /// has sent nothing. `None`: never.
    pub stalled_reader_timeout: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(1),
            ready_timeout: Duration::from_secs(1),
            reconnect_backoff: (Duration::from_millis(50), Duration::from_secs(5)),
            max_streams_per_connection: 1000,
            max_connections_per_endpoint: 4,
            liveness: LivenessConfig::default(),
            health_service: None,
            picker: PickerConfig::default(),
            retryable_methods: Vec::new(),
            retry_budget: RetryBudgetConfig::default(),
            max_attempts: 3,
            retry_backoff: Duration::from_millis(25),
            drain_grace: Duration::from_secs(10),
            max_connection_age: None,
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
            max_client_connections: DEFAULT_MAX_CLIENT_CONNECTIONS,
            stalled_reader_timeout: Some(DEFAULT_STALLED_READER_TIMEOUT),
        }
    }
}

pub use crate::server::{DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CLIENT_CONNECTIONS};

/// Default stalled-reader timeout: five minutes without a byte of room for a response the
/// balancer holds (Envoy's default stream idle timeout is the same five minutes, for streams
/// with no activity at all).
pub const DEFAULT_STALLED_READER_TIMEOUT: Duration = Duration::from_secs(300);

/// Tuning of the picker (see the `picker` module docs for the algorithm).
#[derive(Debug, Clone)]
pub struct PickerConfig {
    /// Time constant of the peak-EWMA latency estimate.
    pub decay: Duration,
    /// Latencies below this count as equal: on one node sub-millisecond differences are noise,
    /// and treating them as equal is what makes idle, equal pods share round-robin evenly.
    pub latency_floor: Duration,
    /// An endpoint whose latency estimate exceeds this many times the median of its peers
    /// (and by more than `degraded_min_gap`) is degraded: it only gets probe requests.
    pub degraded_ratio: f64,
    /// Latency samples in a row above that threshold that degrade an endpoint...
    pub degraded_samples: u32,
    /// ... over at least this long (a node-wide stall is shorter than this).
    pub degraded_after: Duration,
    /// Smallest absolute excess over the median that can degrade an endpoint, so scheduling
    /// jitter of a few milliseconds does not take healthy pods out of rotation.
    pub degraded_min_gap: Duration,
    /// Pause between two probe requests to a degraded or recovering endpoint (one in flight at
    /// most), i.e. the trickle that lets it prove it has recovered.
    pub probe_interval: Duration,
    /// Consecutive probes within the threshold that bring a degraded endpoint back.
    pub recovery_probes: u32,
    /// Consecutive failures that eject an endpoint.
    pub failure_threshold: u32,
    /// First and largest ejection time; it doubles with every ejection in a row.
    pub ejection_backoff: (Duration, Duration),
    /// The random candidate must be this much cheaper than the round-robin candidate to win.
    pub tie_ratio: f64,
}

impl Default for PickerConfig {
    fn default() -> Self {
        Self {
            decay: Duration::from_secs(1),
            latency_floor: Duration::from_millis(5),
            degraded_ratio: 2.0,
            degraded_samples: 5,
            degraded_after: Duration::from_millis(100),
            degraded_min_gap: Duration::from_millis(5),
            probe_interval: Duration::from_millis(200),
            recovery_probes: 2,
            failure_threshold: 5,
            ejection_backoff: (Duration::from_secs(1), Duration::from_secs(30)),
            tie_ratio: 1.25,
        }
    }
}
