//! The `/status` document: served by the agent, read by `skewless status` and the tests.
//!
//! The same numbers feed `/metrics` ([`crate::collector`]): counters are cumulative since the
//! balancer (per Service) or the endpoint (per backend) was added, so a reader that wants
//! rates or recent percentiles takes two documents and subtracts ([`Histogram::since`]).

use serde::{Deserialize, Serialize};

/// What `/status` returns.
#[derive(Debug, Serialize, Deserialize)]
pub struct Status {
    pub node: String,
    pub redirects: Vec<RedirectStatus>,
    pub connect_seen: u64,
    pub connect_redirected: u64,
    pub refused_peers: u64,
    pub services: Vec<ServiceStatus>,
    /// Services not balanced by skewless: where their connections are pinned.
    pub observed: Vec<ObservedService>,
    /// The agent itself: its health and cost.
    #[serde(default)]
    pub agent: AgentStatus,
    /// Opted-in Service ports the agent should balance but cannot (no listener, no redirect):
    /// their clients go plain L4. While any is listed, `/ready` answers 503.
    #[serde(default)]
    pub unserved: Vec<UnservedService>,
}

/// An opted-in Service port that cannot be served, and why.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UnservedService {
    pub service: String,
    pub mode: String,
    pub vip: String,
    /// The last attempt's error, with its causes.
    pub error: String,
    /// Seconds since the first failed attempt.
    pub since_seconds: f64,
}

/// The agent's health and cost: the same numbers `/metrics` exports for them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AgentStatus {
    pub version: String,
    /// Whether it has its first complete model (nothing is redirected before).
    pub model_ready: bool,
    /// Its process's figures; `None` where `/proc` cannot be read.
    pub process: Option<crate::process::Process>,
    /// The data-plane workers, in worker order.
    pub workers: Vec<crate::collector::WorkerUsage>,
    /// Connects to redirected Services sent direct because the heartbeat was stale (fail
    /// open), since the start.
    pub stale_heartbeat: u64,
    /// How full the eBPF maps are.
    pub maps: Vec<MapStatus>,
    /// The container's resource requests and limits, as its pod spec set them.
    pub resources: Resources,
}

/// The agent container's requests and limits (the DaemonSet passes them through the downward
/// API); `None` where not set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Resources {
    pub cpu_request_cores: Option<f64>,
    pub cpu_limit_cores: Option<f64>,
    pub memory_request_bytes: Option<u64>,
    pub memory_limit_bytes: Option<u64>,
}

/// How full one eBPF map is.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapStatus {
    pub map: String,
    pub entries: u64,
    pub capacity: u64,
}

/// A Service port's calls over the agent's recent window ([`crate::window`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RecentCalls {
    /// How long the window is, in seconds (30 to 60, less right after the start).
    pub seconds: f64,
    pub calls_per_sec: f64,
    /// Calls that did not fail / calls; `None` without calls.
    pub success: Option<f64>,
    /// Percentiles of the calls' durations, in seconds; `None` without calls.
    pub p50: Option<f64>,
    pub p99: Option<f64>,
}

/// One eBPF redirect entry: a Service address and where its connects go.
#[derive(Debug, Serialize, Deserialize)]
pub struct RedirectStatus {
    pub service: String,
    pub target: String,
}

/// One redirected Service port, over all data-plane workers.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ServiceStatus {
    pub service: String,
    pub mode: String,
    pub vip: String,
    pub listener: String,
    pub ready_endpoints: usize,
    pub endpoints: Vec<EndpointStatus>,
    /// Upper bounds (seconds) of the latency histograms' buckets, +Inf left out.
    #[serde(default)]
    pub latency_bounds: Vec<f64>,
    /// Every call the balancer answered, from the client's first HEADERS to the end of the
    /// response (where the request's load completes), local answers included.
    #[serde(default)]
    pub latency: Histogram,
    /// Calls that failed, by reason.
    #[serde(default)]
    pub failures: Failures,
    /// Attempts re-sent to another endpoint after one that provably did not process them (or
    /// failed, for retryable methods).
    #[serde(default)]
    pub retries: u64,
    /// Times an endpoint was ejected for failing.
    #[serde(default)]
    pub ejections: u64,
    /// Client connections told to go away (GOAWAY), by reason.
    #[serde(default)]
    pub rotations: Vec<Rotation>,
    /// Client connections open now.
    #[serde(default)]
    pub client_connections: u64,
    /// Upper bounds (seconds) of the connection duration histogram's buckets.
    #[serde(default)]
    pub connection_bounds: Vec<f64>,
    /// Lifetimes of the client connections that closed.
    #[serde(default)]
    pub connection_duration: Histogram,
    /// Largest request share over the ready endpoints / fair share (1 = even), over the
    /// agent's recent window ([`crate::window`]); `None` without recent requests.
    #[serde(default)]
    pub balancer_skew: Option<f64>,
    /// Client connections the balancer closed for what the client sent or failed to send
    /// (no preface, malformed frames, floods, too many streams), by reason.
    #[serde(default)]
    pub client_errors: Vec<ClientError>,
    /// Connection mode's rotation view; `None` in request mode. In connection mode an
    /// endpoint's `upstream_connections` are the client connections relayed to it.
    #[serde(default)]
    pub connection: Option<ConnectionStatus>,
    /// Its calls over the agent's recent window; `None` before the window's first reading.
    #[serde(default)]
    pub recent: Option<RecentCalls>,
}

/// A connection-mode Service port: how even its connections are and what rotation does.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ConnectionStatus {
    /// Largest request share / fair share over the ready backends, last 30 s (1 = even).
    pub skew: f64,
    /// The same over the current placement (each connection at its recent rate).
    pub live_skew: f64,
    /// The Service's `skew-threshold`: rotation starts above it.
    pub skew_threshold: f64,
    /// Backends that take new connections (listed, serving, not ejected).
    pub ready_backends: usize,
    /// Relayed client connections open now (per backend: its `upstream_connections`).
    pub connections: usize,
    /// Where the rotation policy stands: idle, balanced, holding, rotating, waiting,
    /// as_even_as_possible, disabled.
    pub state: String,
    /// Backends with requests in the last 30 s.
    pub backends_receiving: usize,
    /// Skew rotations in the last minute.
    pub rotations_last_minute: usize,
    /// Relayed client connections whose client fails calls on a GOAWAY (tonic): never
    /// rotated for skew.
    pub unrotatable_connections: usize,
    /// The skew is above the threshold and no rotation can lower it (request mode balances
    /// per call).
    pub as_even_as_possible: bool,
    /// Client connections closed because no backend could be connected.
    pub no_backend: u64,
}

/// One backend of a redirected Service port, over all data-plane workers.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EndpointStatus {
    pub name: String,
    pub addr: String,
    pub state: String,
    pub requests: u64,
    pub failures: u64,
    pub share: f64,
    pub latency_ms: Option<f64>,
    /// Requests in flight on it now.
    #[serde(default)]
    pub in_flight: u64,
    /// Open HTTP/2 connections from the balancer to it.
    #[serde(default)]
    pub upstream_connections: u64,
    /// Durations of its requests (same buckets as the Service's).
    #[serde(default)]
    pub latency: Histogram,
    /// 99th percentile of its request durations over the agent's recent window, in seconds.
    #[serde(default)]
    pub recent_p99: Option<f64>,
    /// Its requests per second over the agent's recent window.
    #[serde(default)]
    pub recent_per_sec: Option<f64>,
    /// Its share of the Service's requests over the agent's recent window (the fair share is
    /// 1 / ready endpoints); `None` without recent requests.
    #[serde(default)]
    pub recent_share: Option<f64>,
}

/// Per-bucket counts (not cumulative); one more count than bounds, the last for +Inf.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    pub counts: Vec<u64>,
    /// Sum of the observed values (seconds).
    pub sum: f64,
}

impl Histogram {
    /// An empty histogram for `bounds`.
    #[must_use]
    pub fn empty(bounds: &[f64]) -> Self {
        Self {
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    /// Observations in all buckets.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Adds `other` bucket by bucket (same bounds).
    pub fn add(&mut self, other: &Self) {
        if self.counts.len() < other.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.sum += other.sum;
    }

    /// What was observed after `earlier` (an older reading of the same histogram). If any
    /// bucket went down, the histogram was reset in between and all of `self` is new.
    #[must_use]
    pub fn since(&self, earlier: &Self) -> Self {
        let reset = self.counts.len() != earlier.counts.len()
            || self.counts.iter().zip(&earlier.counts).any(|(a, b)| a < b);
        if reset {
            return self.clone();
        }
        Self {
            counts: self
                .counts
                .iter()
                .zip(&earlier.counts)
                .map(|(a, b)| a - b)
                .collect(),
            sum: (self.sum - earlier.sum).max(0.0),
        }
    }

    /// The `q` quantile (0..=1) as Prometheus's `histogram_quantile` estimates it: linear
    /// interpolation inside the bucket that holds it (from 0 for the first bucket); the
    /// highest finite bound when it falls in +Inf. `None` without observations.
    #[must_use]
    pub fn quantile(&self, bounds: &[f64], q: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 || bounds.is_empty() || self.counts.len() != bounds.len() + 1 {
            return None;
        }
        #[expect(
            clippy::cast_precision_loss,
            reason = "counts far below 2^52 in practice; an estimate anyway"
        )]
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let mut below = 0u64;
        for (i, &n) in self.counts.iter().enumerate() {
            #[expect(clippy::cast_precision_loss, reason = "as above")]
            let upto = (below + n) as f64;
            if n > 0 && upto >= rank {
                let Some(&upper) = bounds.get(i) else {
                    return bounds.last().copied();
                };
                let lower = if i == 0 { 0.0 } else { bounds[i - 1] };
                #[expect(clippy::cast_precision_loss, reason = "as above")]
                let into = (rank - below as f64) / n as f64;
                return Some(lower + (upper - lower) * into);
            }
            below += n;
        }
        bounds.last().copied()
    }
}

/// Failed calls by reason: a bounded set, each a label value of `request_failures_total`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failures {
    /// Answered UNAVAILABLE without a transport fault: no ready endpoint, or the backend
    /// itself answered UNAVAILABLE (or an HTTP 5xx).
    pub unavailable: u64,
    /// The caller's deadline ran out in the balancer (answered DEADLINE_EXCEEDED).
    pub deadline: u64,
    /// The backend reset the stream or it broke off after it was sent.
    pub reset: u64,
    /// The upstream connection failed under the call (I/O error, connection-level error).
    pub connect: u64,
    /// The backend refused the stream (REFUSED_STREAM, above a GOAWAY's last stream id) and
    /// no retry was left (attempts, budget, another endpoint).
    pub refused: u64,
}

impl Failures {
    /// (reason label, count), every reason always present.
    #[must_use]
    pub fn by_reason(&self) -> [(&'static str, u64); 5] {
        [
            ("unavailable", self.unavailable),
            ("deadline", self.deadline),
            ("reset", self.reset),
            ("connect", self.connect),
            ("refused", self.refused),
        ]
    }

    /// Every failed call.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.by_reason().iter().map(|(_, n)| n).sum()
    }

    /// Adds `other`'s counts.
    pub fn add(&mut self, other: &Self) {
        self.unavailable += other.unavailable;
        self.deadline += other.deadline;
        self.reset += other.reset;
        self.connect += other.connect;
        self.refused += other.refused;
    }
}

/// Client connections told to go away for one reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rotation {
    /// A bounded label value (`max_age`, `drain`; connection mode adds its own).
    pub reason: String,
    pub count: u64,
}

/// Client connections closed for one reason of the client's making.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientError {
    /// A bounded label value (`no_preface`, `malformed`, `ping_flood`, `settings_flood`,
    /// `rst_stream_flood`, `too_many_streams`).
    pub reason: String,
    pub count: u64,
}

/// One observed Service port (not balanced by skewless): where this node's pods' connections
/// are pinned.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ObservedService {
    pub service: String,
    pub mode: String,
    pub vip: String,
    pub ready_backends: usize,
    pub backends_receiving: usize,
    pub largest_share: f64,
    /// Largest share / fair share: 1.0 is even; the number of ready backends means everything
    /// lands on one.
    pub skew: f64,
    pub unresolved: usize,
    pub backends: Vec<ObservedBackend>,
}

/// One backend of an observed Service port.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ObservedBackend {
    pub backend: String,
    pub open_connections: usize,
    pub share: f64,
    pub sent_per_sec: f64,
    pub received_per_sec: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: &[f64] = &[0.001, 0.01, 0.1];

    #[test]
    fn quantile_interpolates_inside_the_bucket_like_prometheus() {
        // 100 observations: 50 in (0, 1ms], 40 in (1ms, 10ms], 10 in (10ms, 100ms].
        let h = Histogram {
            counts: vec![50, 40, 10, 0],
            sum: 0.0,
        };
        let p50 = h.quantile(BOUNDS, 0.5).unwrap();
        assert!((p50 - 0.001).abs() < 1e-12, "p50 at the first bound: {p50}");
        let p90 = h.quantile(BOUNDS, 0.9).unwrap();
        assert!((p90 - 0.01).abs() < 1e-12, "p90 at the second bound: {p90}");
        let p95 = h.quantile(BOUNDS, 0.95).unwrap();
        assert!(
            (p95 - 0.055).abs() < 1e-12,
            "p95 halfway into the third: {p95}"
        );
        assert_eq!(Histogram::empty(BOUNDS).quantile(BOUNDS, 0.99), None);
    }

    #[test]
    fn quantile_in_the_inf_bucket_is_the_highest_bound() {
        let h = Histogram {
            counts: vec![0, 0, 0, 5],
            sum: 50.0,
        };
        assert_eq!(h.quantile(BOUNDS, 0.99), Some(0.1));
    }

    #[test]
    fn since_subtracts_and_treats_a_decrease_as_a_reset() {
        let old = Histogram {
            counts: vec![1, 2, 3, 0],
            sum: 1.0,
        };
        let new = Histogram {
            counts: vec![2, 2, 5, 1],
            sum: 3.0,
        };
        assert_eq!(
            new.since(&old),
            Histogram {
                counts: vec![1, 0, 2, 1],
                sum: 2.0
            }
        );
        let reset = Histogram {
            counts: vec![0, 1, 0, 0],
            sum: 0.1,
        };
        assert_eq!(reset.since(&old), reset, "a reset counts from zero");
    }
}
