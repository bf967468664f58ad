//! Plain statistics the admin crate turns into metrics (bounded by services x endpoints).

use std::net::SocketAddr;
use std::time::Duration;

/// Where an endpoint stands in the rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointState {
    /// No usable connection yet (connecting or reconnecting).
    Connecting,
    /// Its grpc.health.v1 Watch says NOT_SERVING (or the watch failed): no requests.
    NotServing,
    /// In rotation.
    Active,
    /// Too slow compared to its peers: only probe requests.
    Degraded,
    /// Failed repeatedly: no requests until its ejection time is over.
    Ejected,
}

/// Counters of one endpoint since it was added.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointStats {
    /// Endpoint address.
    pub addr: SocketAddr,
    /// Pod name.
    pub name: String,
    /// Rotation state.
    pub state: EndpointState,
    /// Requests sent to it (probes included).
    pub requests: u64,
    /// Requests that failed on it.
    pub failures: u64,
    /// Of `requests`, how many were probes.
    pub probes: u64,
    /// Requests in flight now.
    pub in_flight: u32,
    /// Its fraction of all requests the balancer sent (0..=1).
    pub share: f64,
    /// Its peak-EWMA latency estimate, once it has one.
    pub latency: Option<Duration>,
}

/// Balancer-wide counters since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BalancerCounters {
    /// Requests re-sent to another endpoint after the upstream did not process them
    /// (REFUSED_STREAM, above a GOAWAY's last stream id); each spent retry budget.
    pub retries: u64,
    /// Requests sent on another connection because theirs closed before they were written
    /// (free: nothing reached a server).
    pub redispatches: u64,
    /// Retries the budget refused.
    pub retries_refused_by_budget: u64,
    /// Calls the balancer answered itself with UNAVAILABLE (no endpoint, none ready).
    pub local_unavailable: u64,
    /// Calls that failed upstream after they were sent (answered with UNAVAILABLE).
    pub upstream_failures: u64,
    /// Calls the balancer answered itself with DEADLINE_EXCEEDED.
    pub local_deadline_exceeded: u64,
}

/// Lock-free cells behind [`BalancerCounters`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) retries: std::sync::atomic::AtomicU64,
    pub(crate) redispatches: std::sync::atomic::AtomicU64,
    pub(crate) retries_refused_by_budget: std::sync::atomic::AtomicU64,
    pub(crate) local_unavailable: std::sync::atomic::AtomicU64,
    pub(crate) upstream_failures: std::sync::atomic::AtomicU64,
    pub(crate) local_deadline_exceeded: std::sync::atomic::AtomicU64,
}

impl Counters {
    pub(crate) fn bump(cell: &std::sync::atomic::AtomicU64) {
        cell.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> BalancerCounters {
        let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        BalancerCounters {
            retries: get(&self.retries),
            redispatches: get(&self.redispatches),
            retries_refused_by_budget: get(&self.retries_refused_by_budget),
            local_unavailable: get(&self.local_unavailable),
            upstream_failures: get(&self.upstream_failures),
            local_deadline_exceeded: get(&self.local_deadline_exceeded),
        }
    }
}
