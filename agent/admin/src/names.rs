//! Every metric family the agent exports: the one place their names live.
//!
//! Names are given without the `skewless_` prefix ([`PREFIX`], added by the registry; the
//! standard process families, [`PROCESS`], have none and are named in full) and without the
//! suffixes the encoder adds (`_total` for counters, `_bucket`/`_sum`/`_count` for histograms);
//! [`Family::series`] gives the names as a scrape shows them. The dashboard lint and the rule
//! tests check every name they reference against [`ALL`].
//!
//! Help texts are sentences without their final period: prometheus-client's
//! `Registry::register` adds it, and the collector adds it the same way ([`Family::help`]).

use prometheus_client::metrics::MetricType;

/// The prefix of every exported name but the process families'.
pub const PREFIX: &str = "skewless";

/// The namespace of the process families: the names and meanings of Prometheus' own process
/// collector (client_golang's, which every exporter shares), so the usual queries and alerts
/// about a process's cost work unchanged.
pub const PROCESS: &str = "process";

/// A metric family's type, as the encoder writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    #[must_use]
    pub fn metric_type(self) -> MetricType {
        match self {
            Self::Counter => MetricType::Counter,
            Self::Gauge => MetricType::Gauge,
            Self::Histogram => MetricType::Histogram,
        }
    }
}

/// One exported metric family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Family {
    /// The namespace the name goes under: [`PREFIX`] or [`PROCESS`].
    pub namespace: &'static str,
    /// Without type suffix, and without the prefix for [`PREFIX`]'s families (what the
    /// collector registers).
    pub name: &'static str,
    pub kind: Kind,
    /// The label names every sample carries, in order.
    pub labels: &'static [&'static str],
    /// A sentence without its final period (the encoder path adds it).
    help: &'static str,
}

impl Family {
    const fn new(
        name: &'static str,
        kind: Kind,
        labels: &'static [&'static str],
        help: &'static str,
    ) -> Self {
        Self {
            namespace: PREFIX,
            name,
            kind,
            labels,
            help,
        }
    }

    /// A standard process family (`process_...`).
    const fn process(name: &'static str, kind: Kind, help: &'static str) -> Self {
        Self {
            namespace: PROCESS,
            name,
            kind,
            labels: &[],
            help,
        }
    }

    /// The name without type suffix, prefix included (what `# TYPE` shows).
    #[must_use]
    pub fn full_name(&self) -> String {
        if self.namespace == PREFIX {
            format!("{PREFIX}_{}", self.name)
        } else {
            self.name.to_owned()
        }
    }

    /// The help text for `Registry::register`, which appends the final period itself.
    #[must_use]
    pub fn help_for_registry(&self) -> &'static str {
        self.help
    }

    /// The help text as it is encoded: the sentence with its final period.
    #[must_use]
    pub fn help(&self) -> String {
        format!("{}.", self.help)
    }

    /// The sample names a scrape shows for this family, prefix included.
    #[must_use]
    pub fn series(&self) -> Vec<String> {
        let base = self.full_name();
        match self.kind {
            Kind::Counter => vec![format!("{base}_total")],
            Kind::Gauge => vec![base],
            Kind::Histogram => ["bucket", "sum", "count"]
                .iter()
                .map(|suffix| format!("{base}_{suffix}"))
                .collect(),
        }
    }
}

const SERVICE: &[&str] = &["service", "vip"];
const BACKEND: &[&str] = &["service", "vip", "backend"];

// The kernel hooks (no labels; IPv4 and IPv6 summed).
pub const CONNECT_SEEN: Family = Family::new(
    "connect_seen",
    Kind::Counter,
    &[],
    "connect() calls (IPv4 and IPv6) seen by the hooks in attached pod cgroups",
);
pub const CONNECT_REDIRECTED: Family = Family::new(
    "connect_redirected",
    Kind::Counter,
    &[],
    "connect() calls rewritten to a node balancer listener (IPv4 and IPv6)",
);
pub const BALANCER_REFUSED: Family = Family::new(
    "balancer_refused",
    Kind::Counter,
    &[],
    "Connections to a balancer closed at once because the peer is not one of this node's pods",
);
pub const STALE_HEARTBEAT: Family = Family::new(
    "stale_heartbeat",
    Kind::Counter,
    &[],
    "connect() calls to a redirected Service sent direct because the agent's heartbeat was stale (fail open)",
);
pub const ORIGDST_UPDATE_FAILED: Family = Family::new(
    "origdst_update_failed",
    Kind::Counter,
    &[],
    "Redirected sockets whose original destination could not be recorded for getpeername",
);
pub const OBSERVED_CONNECTIONS: Family = Family::new(
    "observed_connections",
    Kind::Counter,
    &[],
    "Pod TCP connections recorded by the sock_ops hook (IPv4 and IPv6)",
);
pub const OBSERVED_RECORD_FAILED: Family = Family::new(
    "observed_record_failed",
    Kind::Counter,
    &[],
    "Pod TCP connections the hooks could not record or keep current (map update or callback setup failed); they go unobserved, never blocked",
);
pub const OBSERVED_RECORDS_EVICTED: Family = Family::new(
    "observed_records_evicted",
    Kind::Counter,
    &[],
    "Records of open pod TCP connections that left the full connection map (LRU eviction) before the observer forgot them; those connections go unobserved, never blocked",
);
pub const MAP_ENTRIES: Family = Family::new(
    "map_entries",
    Kind::Gauge,
    &["map"],
    "Entries in an eBPF map of the agent (redirect4, redirect6: Service addresses redirected; conns: recorded pod connections)",
);
pub const MAP_CAPACITY: Family = Family::new(
    "map_capacity",
    Kind::Gauge,
    &["map"],
    "Most entries an eBPF map of the agent can hold",
);
pub const BUILD_INFO: Family = Family::new(
    "build_info",
    Kind::Gauge,
    &["version"],
    "The agent's version, in its label; always 1",
);

// Per backend, both modes (the per-backend table; nothing else per backend, see
// docs/metrics.md on cardinality). In connection mode a request is a relayed stream.
pub const BACKEND_REQUESTS: Family = Family::new(
    "backend_requests",
    Kind::Counter,
    BACKEND,
    "Requests the balancer sent to a backend (probes and retries included)",
);
pub const BACKEND_FAILURES: Family = Family::new(
    "backend_failures",
    Kind::Counter,
    BACKEND,
    "Requests that failed on a backend (transport failure, refusal, UNAVAILABLE or HTTP 5xx answer)",
);
pub const BACKEND_IN_FLIGHT: Family = Family::new(
    "backend_in_flight",
    Kind::Gauge,
    BACKEND,
    "Requests in flight on a backend",
);
pub const BACKEND_UPSTREAM_CONNECTIONS: Family = Family::new(
    "backend_upstream_connections",
    Kind::Gauge,
    BACKEND,
    "Open connections from the balancer to a backend: request mode's pooled HTTP/2 connections, connection mode's relayed client connections (one each)",
);
pub const BACKEND_STATE: Family = Family::new(
    "backend_state",
    Kind::Gauge,
    &["service", "vip", "backend", "state"],
    "A backend's current state in the balancer: 1 on the series of that state (connecting, not_serving, active, degraded, ejected), the other states are not exported",
);
pub const BACKEND_LATENCY_P99: Family = Family::new(
    "backend_latency_p99_seconds",
    Kind::Gauge,
    BACKEND,
    "The 99th percentile of a backend's request durations over the last 30 to 60 s, estimated from its request duration buckets",
);

// Per Service port, both modes.
pub const SERVICE_INFO: Family = Family::new(
    "service_info",
    Kind::Gauge,
    &["service", "vip", "mode"],
    "An opted-in Service port on this node and its mode (request, connection, observe), in its labels; always 1",
);
pub const SERVICE_UNSERVED: Family = Family::new(
    "service_unserved",
    Kind::Gauge,
    SERVICE,
    "Whether an opted-in Service port this agent should balance cannot be served: 1 while its listener or redirect fails (`skewless status` says why) and its clients go plain L4, 0 while it is served",
);
pub const SERVICE_READY_BACKENDS: Family = Family::new(
    "service_ready_backends",
    Kind::Gauge,
    SERVICE,
    "Ready backends of an opted-in Service port, from the model",
);
pub const REQUEST_DURATION: Family = Family::new(
    "request_duration_seconds",
    Kind::Histogram,
    SERVICE,
    "Durations of the calls the balancer answered, from the client's request headers to the end of the response (where the request's load completes), local answers included; in connection mode, relayed streams from HEADERS to their end both ways or reset",
);
pub const REQUEST_FAILURES: Family = Family::new(
    "request_failures",
    Kind::Counter,
    &["service", "vip", "reason"],
    "Calls that failed, by reason (unavailable, deadline, reset, connect, refused, stalled_reader)",
);
pub const REQUEST_RETRIES: Family = Family::new(
    "request_retries",
    Kind::Counter,
    SERVICE,
    "Attempts re-sent to another endpoint (the first was refused or unprocessed, or failed on a retryable method)",
);
pub const EJECTIONS: Family = Family::new(
    "ejections",
    Kind::Counter,
    SERVICE,
    "Times a backend was ejected from the rotation for failing",
);
pub const EJECTED_BACKENDS: Family = Family::new(
    "ejected_backends",
    Kind::Gauge,
    SERVICE,
    "Backends ejected from the rotation now",
);
pub const ROTATIONS: Family = Family::new(
    "rotations",
    Kind::Counter,
    &["service", "vip", "reason"],
    "Client connections the balancer told to go away (two-phase GOAWAY), by reason",
);
pub const CLIENT_PROTOCOL_ERRORS: Family = Family::new(
    "client_protocol_errors",
    Kind::Counter,
    &["service", "vip", "reason"],
    "Client connections the balancer closed for what the client sent or failed to send, by reason (no_preface, malformed, ping_flood, settings_flood, rst_stream_flood, too_many_streams)",
);
pub const CLIENT_CONNECTIONS: Family = Family::new(
    "client_connections",
    Kind::Gauge,
    SERVICE,
    "Client connections open on the balancer",
);
pub const CLIENT_CONNECTION_DURATION: Family = Family::new(
    "client_connection_duration_seconds",
    Kind::Histogram,
    SERVICE,
    "Lifetimes of the client connections to the balancer that closed",
);
pub const BALANCER_SKEW: Family = Family::new(
    "balancer_skew",
    Kind::Gauge,
    SERVICE,
    "Largest request share over the ready backends / fair share (1 = even), as the balancer sent requests over the last 30 to 60 s (connection mode: the rotation policy's own 30 s window)",
);

// Connection mode, per Service port.
pub const UNROTATABLE_CONNECTIONS: Family = Family::new(
    "unrotatable_connections",
    Kind::Gauge,
    SERVICE,
    "Relayed client connections never rotated for skew because their client fails calls on a GOAWAY (tonic, recognised by its user-agent); connection mode",
);
pub const NO_BACKEND_CONNECTIONS: Family = Family::new(
    "no_backend_connections",
    Kind::Counter,
    SERVICE,
    "Client connections closed before any byte was relayed because no backend could be connected (connection mode; the client sees its calls fail as UNAVAILABLE)",
);
pub const ROTATION_STATE: Family = Family::new(
    "rotation_state",
    Kind::Gauge,
    &["service", "vip", "state"],
    "Where connection mode's rotation policy stands: 1 on the series of that state (idle, balanced, holding, rotating, waiting: the rotation budget is spent and holds the next rotation back, or the connections a move needs are younger than the minimum age, as_even_as_possible, disabled), the other states are not exported",
);

// Observed Services (eBPF, no balancer).
pub const OBSERVED_SKEW: Family = Family::new(
    "observed_skew",
    Kind::Gauge,
    SERVICE,
    "Largest backend share / fair share of an observed Service's pod connections (1 = even; the number of ready backends = all on one)",
);
pub const OBSERVED_BACKENDS_RECEIVING: Family = Family::new(
    "observed_backends_receiving",
    Kind::Gauge,
    SERVICE,
    "Backends of an observed Service that this node's pods send traffic to",
);
pub const OBSERVED_BACKEND_SHARE: Family = Family::new(
    "observed_backend_share",
    Kind::Gauge,
    BACKEND,
    "A backend's share of an observed Service's traffic from this node's pods (bytes, or open connections when idle)",
);
pub const OBSERVED_BACKEND_CONNECTIONS: Family = Family::new(
    "observed_backend_connections",
    Kind::Gauge,
    BACKEND,
    "Open connections from this node's pods pinned to a backend of an observed Service",
);

// The model.
pub const SERVICE_CONFIG_REJECTED: Family = Family::new(
    "service_config_rejected",
    Kind::Counter,
    &["reason"],
    "Service configs rejected (bad skewless.io annotation or unsupported Service), each distinct error counted once; the Service keeps its last good config",
);
pub const SOURCE_ERRORS: Family = Family::new(
    "source_errors",
    Kind::Counter,
    &["source"],
    "Failures to read Services and endpoints from a source (a failed watch, an unreadable or invalid file); the last good state stays in effect",
);
pub const MODEL_READY: Family = Family::new(
    "model_ready",
    Kind::Gauge,
    &[],
    "Whether the agent has its first complete model (the services file read, or the first full list from Kubernetes): 1 once it has, 0 before, while nothing is redirected (fail open)",
);
pub const WARNING_EVENTS_DROPPED: Family = Family::new(
    "warning_events_dropped",
    Kind::Counter,
    &[],
    "Warning Events about rejected Service configs that were not posted because the queue to the API server was full (the rejection is still logged and counted)",
);

// The agent's process, as Prometheus' process collector names it (from /proc/self).
pub const PROCESS_CPU_SECONDS: Family = Family::process(
    "process_cpu_seconds",
    Kind::Counter,
    "Total user and system CPU time spent in seconds",
);
pub const PROCESS_OPEN_FDS: Family = Family::process(
    "process_open_fds",
    Kind::Gauge,
    "Number of open file descriptors",
);
pub const PROCESS_MAX_FDS: Family = Family::process(
    "process_max_fds",
    Kind::Gauge,
    "Maximum number of open file descriptors",
);
pub const PROCESS_VIRTUAL_MEMORY: Family = Family::process(
    "process_virtual_memory_bytes",
    Kind::Gauge,
    "Virtual memory size in bytes",
);
pub const PROCESS_VIRTUAL_MEMORY_MAX: Family = Family::process(
    "process_virtual_memory_max_bytes",
    Kind::Gauge,
    "Maximum amount of virtual memory available in bytes (-1: unlimited)",
);
pub const PROCESS_RESIDENT_MEMORY: Family = Family::process(
    "process_resident_memory_bytes",
    Kind::Gauge,
    "Resident memory size in bytes",
);
pub const PROCESS_START_TIME: Family = Family::process(
    "process_start_time_seconds",
    Kind::Gauge,
    "Start time of the process since unix epoch in seconds",
);
pub const PROCESS_THREADS: Family = Family::process(
    "process_threads",
    Kind::Gauge,
    "Number of OS threads in the process",
);

// What the pod spec gives the agent (from the downward API; absent when not set).
pub const CONTAINER_CPU: Family = Family::new(
    "container_cpu_cores",
    Kind::Gauge,
    &["kind"],
    "The agent container's CPU request and limit in cores, as its pod spec sets them (kind: request, limit)",
);
pub const CONTAINER_MEMORY: Family = Family::new(
    "container_memory_bytes",
    Kind::Gauge,
    &["kind"],
    "The agent container's memory request and limit in bytes, as its pod spec sets them (kind: request, limit)",
);

// The data-plane workers (one label value per worker thread, at most 64).
pub const WORKER_BUSY: Family = Family::new(
    "worker_busy_seconds",
    Kind::Counter,
    &["worker"],
    "Time a data-plane worker thread spent on a CPU, as the kernel's scheduler counted it",
);
pub const WORKER_CPU_WAIT: Family = Family::new(
    "worker_cpu_wait_seconds",
    Kind::Counter,
    &["worker"],
    "Time a data-plane worker thread was ready to run but waited for a CPU (run-queue delay): it grows when the node or the agent's CPU limit starves the data plane",
);
pub const WORKER_STALLS: Family = Family::new(
    "worker_stalls",
    Kind::Counter,
    &["worker"],
    "Times a data-plane worker ran no task for longer than 400 ms: the heartbeat paused and new connects failed open until it ran again (the log tells why: busy, starved or blocked)",
);

/// Every family, in the order a scrape shows them.
pub const ALL: &[Family] = &[
    PROCESS_CPU_SECONDS,
    PROCESS_OPEN_FDS,
    PROCESS_MAX_FDS,
    PROCESS_VIRTUAL_MEMORY,
    PROCESS_VIRTUAL_MEMORY_MAX,
    PROCESS_RESIDENT_MEMORY,
    PROCESS_START_TIME,
    PROCESS_THREADS,
    SERVICE_CONFIG_REJECTED,
    SOURCE_ERRORS,
    WARNING_EVENTS_DROPPED,
    BUILD_INFO,
    CONNECT_SEEN,
    CONNECT_REDIRECTED,
    BALANCER_REFUSED,
    STALE_HEARTBEAT,
    ORIGDST_UPDATE_FAILED,
    OBSERVED_CONNECTIONS,
    OBSERVED_RECORD_FAILED,
    OBSERVED_RECORDS_EVICTED,
    MAP_ENTRIES,
    MAP_CAPACITY,
    MODEL_READY,
    BACKEND_REQUESTS,
    BACKEND_FAILURES,
    BACKEND_IN_FLIGHT,
    BACKEND_UPSTREAM_CONNECTIONS,
    BACKEND_STATE,
    BACKEND_LATENCY_P99,
    SERVICE_INFO,
    SERVICE_UNSERVED,
    SERVICE_READY_BACKENDS,
    REQUEST_DURATION,
    REQUEST_FAILURES,
    REQUEST_RETRIES,
    EJECTIONS,
    EJECTED_BACKENDS,
    ROTATIONS,
    CLIENT_PROTOCOL_ERRORS,
    CLIENT_CONNECTIONS,
    CLIENT_CONNECTION_DURATION,
    BALANCER_SKEW,
    UNROTATABLE_CONNECTIONS,
    NO_BACKEND_CONNECTIONS,
    ROTATION_STATE,
    OBSERVED_SKEW,
    OBSERVED_BACKENDS_RECEIVING,
    OBSERVED_BACKEND_SHARE,
    OBSERVED_BACKEND_CONNECTIONS,
    WORKER_BUSY,
    WORKER_CPU_WAIT,
    WORKER_STALLS,
    CONTAINER_CPU,
    CONTAINER_MEMORY,
];

/// Every sample name a scrape can show, prefix and suffixes included.
#[must_use]
pub fn all_series() -> Vec<String> {
    ALL.iter().flat_map(Family::series).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_follow_the_naming_guide() {
        let mut seen = std::collections::HashSet::new();
        for f in ALL {
            assert!(seen.insert(f.full_name()), "{} is listed twice", f.name);
            assert!(
                f.namespace == PREFIX
                    || (f.namespace == PROCESS
                        && f.labels.is_empty()
                        && f.name.starts_with("process_")),
                "{}: skewless_, or an unlabelled standard process family",
                f.name
            );
            assert!(
                f.name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{}: snake_case only",
                f.name
            );
            assert!(
                !f.name.ends_with("_total") && !f.name.ends_with("_count"),
                "{}: the encoder adds the type suffix",
                f.name
            );
            if f.kind == Kind::Histogram {
                assert!(
                    f.name.ends_with("_seconds"),
                    "{}: histograms are in base units",
                    f.name
                );
            }
            assert!(
                !f.name.ends_with("_bucket"),
                "{}: the encoder adds the type suffix",
                f.name
            );
            assert!(
                !f.help.ends_with('.'),
                "{}: the help text's final period is added when it is encoded",
                f.name
            );
            assert!(
                f.help.starts_with(|c: char| c.is_uppercase()) || f.help.starts_with("connect()"),
                "{}: the help text is a sentence",
                f.name
            );
        }
    }
}
