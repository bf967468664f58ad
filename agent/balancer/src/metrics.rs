//! Lock-free numbers the data path updates and the agent reads when it is scraped.
//!
//! Every handle is created once, where its target appears (an endpoint when it is added, a
//! balancer when it starts), and held by what records into it (the endpoint's lease, the
//! call, the client connection): recording is a few relaxed atomic adds, with no lookup by
//! label and no lock. Reading ([`Histogram::snapshot`], [`ServiceMetrics::snapshot`]) copies
//! the cells; a reading taken while requests complete may be a request apart between two
//! cells, never torn within one.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::label::label_enum;

/// Upper bounds (seconds) of the request duration buckets: 0.5 ms to 10 s, with the usual SLO
/// points (2.5 ms, 25 ms, 250 ms, 2.5 s) as bounds, so an SLO threshold is a bucket.
pub const LATENCY_BOUNDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Upper bounds (seconds) of the client connection lifetime buckets: 100 ms to a day.
pub const CONNECTION_BOUNDS: &[f64] = &[
    0.1, 1.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0,
];

const LATENCY_BUCKETS: usize = LATENCY_BOUNDS.len() + 1;
const CONNECTION_BUCKETS: usize = CONNECTION_BOUNDS.len() + 1;

/// A histogram over fixed bounds (`N` = bounds + 1, the last bucket is +Inf), in nanoseconds.
#[derive(Debug)]
pub struct Histogram<const N: usize> {
    bounds_ns: [u64; N],
    counts: [AtomicU64; N],
    sum_ns: AtomicU64,
}

/// Request durations.
pub type LatencyHistogram = Histogram<LATENCY_BUCKETS>;
/// Client connection lifetimes.
pub type ConnectionHistogram = Histogram<CONNECTION_BUCKETS>;

impl<const N: usize> Histogram<N> {
    /// Over `bounds` (seconds, ascending, `N - 1` of them).
    fn with_bounds(bounds: &[f64]) -> Self {
        debug_assert_eq!(bounds.len() + 1, N);
        let mut bounds_ns = [u64::MAX; N];
        for (b, s) in bounds_ns.iter_mut().zip(bounds) {
            // Exact for these bounds: all are whole microseconds at most 1 day.
            *b = Duration::from_secs_f64(*s)
                .as_nanos()
                .try_into()
                .unwrap_or(u64::MAX);
        }
        Self {
            bounds_ns,
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }

    /// Counts one observation, in the first bucket whose bound it does not exceed (`le`).
    pub fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let i = self.bounds_ns.partition_point(|&b| b < ns).min(N - 1);
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    /// The counts per bucket (not cumulative) and the sum in seconds.
    #[must_use]
    pub fn snapshot(&self) -> HistogramSnapshot {
        #[expect(clippy::cast_precision_loss, reason = "a sum of durations in seconds")]
        let sum = self.sum_ns.load(Relaxed) as f64 / 1e9;
        HistogramSnapshot {
            counts: self.counts.iter().map(|c| c.load(Relaxed)).collect(),
            sum,
        }
    }
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::with_bounds(LATENCY_BOUNDS)
    }
}

impl Default for ConnectionHistogram {
    fn default() -> Self {
        Self::with_bounds(CONNECTION_BOUNDS)
    }
}

/// A reading of a histogram: counts per bucket, the last for +Inf, and the sum (seconds).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HistogramSnapshot {
    pub counts: Vec<u64>,
    pub sum: f64,
}

impl HistogramSnapshot {
    /// Observations in every bucket.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Adds `other` bucket by bucket (another worker's reading of the same target).
    pub fn add(&mut self, other: &Self) {
        if self.counts.len() < other.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.sum += other.sum;
    }
}

label_enum! {
    /// Why a call failed: a bounded set (a metric label).
    pub enum FailureReason {
        /// Answered UNAVAILABLE without a transport fault: no ready endpoint, or the backend
        /// itself answered UNAVAILABLE (or an HTTP 5xx).
        Unavailable => "unavailable",
        /// The caller's deadline ran out in the balancer.
        Deadline => "deadline",
        /// The backend reset the stream, or it ended abnormally after it was sent.
        Reset => "reset",
        /// The upstream connection failed under the call.
        Connect => "connect",
        /// The backend refused the stream and no retry was left.
        Refused => "refused",
        /// The client made no room for the response for the stalled-reader timeout while the
        /// balancer held response data for it: the balancer reset the stream.
        StalledReader => "stalled_reader",
    }
}

label_enum! {
    /// Why a client connection is rotated (told to go away with a GOAWAY), in both modes: a
    /// bounded set (a metric label). The server's lifecycle stops a connection for `MaxAge` and
    /// `Drain` (see [`crate::server::Stop`]), both modes for `Idle`; connection mode's controller also for `Skew`,
    /// `BackendRemoved` and `NotServing`.
    pub enum RotationReason {
        /// Its backend holds more than its share (connection mode).
        Skew => "skew",
        /// Its backend left the endpoint set (connection mode).
        BackendRemoved => "backend_removed",
        /// Its backend's health check says NOT_SERVING (connection mode).
        NotServing => "not_serving",
        /// It reached its max connection age.
        MaxAge => "max_age",
        /// The balancer is draining (opt-out, agent shutdown).
        Drain => "drain",
        /// It carried no stream (and no keepalive PING) for the idle timeout.
        Idle => "idle",
    }
}

label_enum! {
    /// Why the balancer closed a client connection for what the client sent, or failed to
    /// send: a bounded set (a metric label). See docs/balancer.md and docs/connection-mode.md.
    pub enum ClientErrorReason {
        /// No HTTP/2 connection preface and SETTINGS within the handshake timeout.
        NoPreface => "no_preface",
        /// Not HTTP/2, or a malformed or oversized frame.
        Malformed => "malformed",
        /// More PINGs than the balancer answers (or relays).
        PingFlood => "ping_flood",
        /// More SETTINGS than the balancer applies (or relays).
        SettingsFlood => "settings_flood",
        /// More RST_STREAMs than the balancer processes (rapid reset).
        RstStreamFlood => "rst_stream_flood",
        /// More open streams than the balancer tracks on one connection.
        TooManyStreams => "too_many_streams",
        /// Closed at its accept: the balancer had its most client connections open
        /// (`max_client_connections`).
        ConnectionLimit => "connection_limit",
    }
}

/// The numbers of one endpoint, created when the endpoint is added to a balancer.
#[derive(Debug, Default)]
pub struct EndpointMetrics {
    /// Durations of its requests, from the attempt's send to the end of its response (where
    /// the request's load on it completes).
    pub latency: LatencyHistogram,
}

/// The numbers of one balancer (one Service port on one worker), created with it.
#[derive(Debug, Default)]
pub struct ServiceMetrics {
    /// Every call, from the client's request headers to the end of the response.
    pub latency: LatencyHistogram,
    failures: [AtomicU64; FailureReason::ALL.len()],
    rotations: [AtomicU64; RotationReason::ALL.len()],
    client_connections: AtomicU64,
    /// Lifetimes of the client connections that closed.
    pub connection_duration: ConnectionHistogram,
    client_errors: [AtomicU64; ClientErrorReason::ALL.len()],
}

/// A reading of [`ServiceMetrics`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServiceSnapshot {
    pub latency: HistogramSnapshot,
    /// By [`FailureReason::ALL`].
    pub failures: [u64; FailureReason::ALL.len()],
    /// By [`RotationReason::ALL`].
    pub rotations: [u64; RotationReason::ALL.len()],
    pub client_connections: u64,
    pub connection_duration: HistogramSnapshot,
    /// Client connections closed for what the client sent, by [`ClientErrorReason::ALL`].
    pub client_errors: [u64; ClientErrorReason::ALL.len()],
}

impl ServiceSnapshot {
    /// Adds another worker's reading of the same Service port.
    pub fn add(&mut self, other: &Self) {
        self.latency.add(&other.latency);
        for (a, b) in self.failures.iter_mut().zip(other.failures) {
            *a += b;
        }
        for (a, b) in self.rotations.iter_mut().zip(other.rotations) {
            *a += b;
        }
        self.client_connections += other.client_connections;
        self.connection_duration.add(&other.connection_duration);
        for (a, b) in self.client_errors.iter_mut().zip(other.client_errors) {
            *a += b;
        }
    }
}

impl ServiceMetrics {
    /// Counts a failed call.
    pub fn failed(&self, reason: FailureReason) {
        self.failures[reason.index()].fetch_add(1, Relaxed);
    }

    /// Counts a GOAWAY sent to a client connection.
    pub fn rotated(&self, reason: RotationReason) {
        self.rotations[reason.index()].fetch_add(1, Relaxed);
    }

    /// Counts a client connection closed for what the client sent (or failed to send).
    pub fn client_error(&self, reason: ClientErrorReason) {
        self.client_errors[reason.index()].fetch_add(1, Relaxed);
    }

    /// Client connections open now.
    #[must_use]
    pub fn open_connections(&self) -> u64 {
        self.client_connections.load(Relaxed)
    }

    /// A client connection opened; the guard counts it closed (and its lifetime) on drop.
    #[must_use]
    pub fn connection_opened(self: &Arc<Self>) -> ConnectionGuard {
        self.client_connections.fetch_add(1, Relaxed);
        ConnectionGuard {
            metrics: Arc::clone(self),
            opened: tokio::time::Instant::now(),
        }
    }

    /// A call started at `at`; the guard records its duration when it is dropped (the call is
    /// over). The caller passes a clock reading it takes anyway (the request path reads the
    /// clock once for the call's arrival, its deadline and its first pick).
    #[must_use]
    pub fn call_started(&self, at: tokio::time::Instant) -> CallGuard<'_> {
        CallGuard {
            metrics: self,
            started: at,
            ended: None,
        }
    }

    /// Reads every cell.
    #[must_use]
    pub fn snapshot(&self) -> ServiceSnapshot {
        ServiceSnapshot {
            latency: self.latency.snapshot(),
            failures: std::array::from_fn(|i| self.failures[i].load(Relaxed)),
            rotations: std::array::from_fn(|i| self.rotations[i].load(Relaxed)),
            client_connections: self.client_connections.load(Relaxed),
            connection_duration: self.connection_duration.snapshot(),
            client_errors: std::array::from_fn(|i| self.client_errors[i].load(Relaxed)),
        }
    }
}

/// One open client connection; dropping it counts the connection closed.
#[derive(Debug)]
pub struct ConnectionGuard {
    metrics: Arc<ServiceMetrics>,
    opened: tokio::time::Instant,
}

/// One call in progress; dropping it records the call's duration.
#[derive(Debug)]
pub struct CallGuard<'a> {
    metrics: &'a ServiceMetrics,
    started: tokio::time::Instant,
    ended: Option<tokio::time::Instant>,
}

impl CallGuard<'_> {
    /// The call ended at `at` (the reading its lease ended with): the drop records the
    /// duration up to then and reads no clock of its own.
    pub fn ended(&mut self, at: tokio::time::Instant) {
        self.ended = Some(at);
    }
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        let ended = self.ended.unwrap_or_else(tokio::time::Instant::now);
        self.metrics
            .latency
            .record(ended.saturating_duration_since(self.started));
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.metrics.client_connections.fetch_sub(1, Relaxed);
        self.metrics
            .connection_duration
            .record(self.opened.elapsed());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_observation_on_a_bound_goes_in_that_bucket() {
        let h = LatencyHistogram::default();
        h.record(Duration::from_micros(500)); // le="0.0005"
        h.record(Duration::from_micros(501)); // le="0.001"
        h.record(Duration::from_millis(250)); // le="0.25"
        h.record(Duration::from_secs(11)); // +Inf
        let s = h.snapshot();
        assert_eq!(s.counts.len(), LATENCY_BOUNDS.len() + 1);
        assert_eq!(s.counts[0], 1);
        assert_eq!(s.counts[1], 1);
        let quarter = LATENCY_BOUNDS.iter().position(|b| *b == 0.25).unwrap();
        assert_eq!(s.counts[quarter], 1);
        assert_eq!(s.counts[LATENCY_BOUNDS.len()], 1);
        assert_eq!(s.count(), 4);
        assert!((s.sum - 11.251_001).abs() < 1e-9, "sum {}", s.sum);
    }

    #[test]
    fn bounds_ascend_and_cover_half_a_millisecond_to_ten_seconds() {
        for bounds in [LATENCY_BOUNDS, CONNECTION_BOUNDS] {
            assert!(bounds.windows(2).all(|w| w[0] < w[1]));
        }
        assert_eq!(LATENCY_BOUNDS.first(), Some(&0.0005));
        assert_eq!(LATENCY_BOUNDS.last(), Some(&10.0));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_connection_guard_counts_open_connections_and_their_lifetimes() {
        let m = Arc::new(ServiceMetrics::default());
        let a = m.connection_opened();
        let b = m.connection_opened();
        assert_eq!(m.snapshot().client_connections, 2);
        tokio::time::advance(Duration::from_secs(45)).await;
        drop(a);
        let s = m.snapshot();
        assert_eq!(s.client_connections, 1);
        let thirty_to_sixty = CONNECTION_BOUNDS.iter().position(|b| *b == 60.0).unwrap();
        assert_eq!(s.connection_duration.counts[thirty_to_sixty], 1);
        drop(b);
        assert_eq!(m.snapshot().client_connections, 0);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_call_guard_records_from_its_start_to_the_end_it_is_told_or_its_drop() {
        let m = ServiceMetrics::default();
        let bucket = |s: &ServiceSnapshot, upper: f64| {
            s.latency.counts[LATENCY_BOUNDS.iter().position(|b| *b == upper).unwrap()]
        };
        let t0 = tokio::time::Instant::now();
        tokio::time::advance(Duration::from_millis(3)).await;
        // Started at an earlier reading, told its end: 0-3 ms would be the drop's own clock.
        let mut told = m.call_started(t0 - Duration::from_millis(20));
        tokio::time::advance(Duration::from_millis(30)).await;
        told.ended(t0 + Duration::from_millis(3));
        drop(told);
        assert_eq!(
            bucket(&m.snapshot(), 0.025),
            1,
            "23 ms, from start to the told end"
        );
        // Not told: up to the drop.
        let untold = m.call_started(tokio::time::Instant::now());
        tokio::time::advance(Duration::from_millis(70)).await;
        drop(untold);
        assert_eq!(bucket(&m.snapshot(), 0.1), 1, "70 ms, up to the drop");
        assert_eq!(m.snapshot().latency.count(), 2);
    }

    #[test]
    fn label_sets_list_every_value_once_in_index_order_with_the_dashboards_labels() {
        for (i, r) in RotationReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
        for (i, r) in FailureReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
        for (i, r) in ClientErrorReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
        let labels = |all: &[&'static str]| all.to_vec();
        assert_eq!(
            labels(&RotationReason::ALL.map(RotationReason::label)),
            [
                "skew",
                "backend_removed",
                "not_serving",
                "max_age",
                "drain",
                "idle"
            ],
            "label values are a contract with the dashboards and alerts"
        );
        assert_eq!(
            labels(&FailureReason::ALL.map(FailureReason::label)),
            [
                "unavailable",
                "deadline",
                "reset",
                "connect",
                "refused",
                "stalled_reader"
            ]
        );
        assert_eq!(
            labels(&ClientErrorReason::ALL.map(ClientErrorReason::label)),
            [
                "no_preface",
                "malformed",
                "ping_flood",
                "settings_flood",
                "rst_stream_flood",
                "too_many_streams",
                "connection_limit"
            ]
        );
        assert_eq!(
            RotationReason::BackendRemoved.to_string(),
            "backend_removed"
        );
    }

    #[test]
    fn readings_of_workers_add_up() {
        let (a, b) = (ServiceMetrics::default(), ServiceMetrics::default());
        a.failed(FailureReason::Deadline);
        b.failed(FailureReason::Deadline);
        b.failed(FailureReason::Refused);
        a.rotated(RotationReason::Drain);
        a.latency.record(Duration::from_millis(3));
        b.latency.record(Duration::from_millis(3));
        let mut s = a.snapshot();
        s.add(&b.snapshot());
        assert_eq!(s.failures, [0, 2, 0, 0, 1, 0]);
        assert_eq!(s.rotations, [0, 0, 0, 0, 1, 0]);
        assert_eq!(s.latency.count(), 2);
    }

    proptest::proptest! {
        /// Every observation lands in exactly one bucket, the first whose bound is not below it.
        #[test]
        fn every_observation_lands_in_the_first_bucket_not_below_it(us in 0u64..20_000_000) {
            let h = LatencyHistogram::default();
            h.record(Duration::from_micros(us));
            let s = h.snapshot();
            proptest::prop_assert_eq!(s.count(), 1);
            let i = s.counts.iter().position(|&c| c == 1).unwrap();
            #[expect(clippy::cast_precision_loss, reason = "test values below 2^52")]
            let secs = us as f64 / 1e6;
            if let Some(&upper) = LATENCY_BOUNDS.get(i) {
                proptest::prop_assert!(secs <= upper + 1e-12);
            }
            if i > 0 {
                proptest::prop_assert!(secs > LATENCY_BOUNDS[i - 1] - 1e-12);
            }
        }
    }
}
