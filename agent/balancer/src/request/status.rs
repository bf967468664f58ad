//! What `skewless status` and the admin crate read of a request-mode balancer: per-endpoint
//! statistics and balancer-wide counters, bounded by services x endpoints. The histograms and
//! labelled counters both modes record into are [`crate::metrics`].

use std::net::SocketAddr;

pub use crate::endpoints::EndpointState;
use crate::metrics::HistogramSnapshot;
use std::time::Duration;

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
    /// Open HTTP/2 connections to it.
    pub upstream_connections: u32,
    /// Durations of its requests, pick to end of response (the requests the picker counted).
    pub latency_histogram: HistogramSnapshot,
}

impl EndpointStats {
    /// One Service's endpoint statistics over all its workers' balancers (one list per
    /// worker): counts add up per endpoint address, `share` is recomputed over the sum, and
    /// the state and latency are those of the worker that sent the endpoint the most requests
    /// (the one whose view is best informed). Ordered as the first list that names each
    /// endpoint.
    #[must_use]
    pub fn merge_workers(per_worker: impl IntoIterator<Item = Vec<EndpointStats>>) -> Vec<Self> {
        // (merged, requests of the worker whose state/latency it carries)
        let mut merged: Vec<(Self, u64)> = Vec::new();
        for stats in per_worker {
            for e in stats {
                match merged.iter_mut().find(|(m, _)| m.addr == e.addr) {
                    Some((m, best)) => {
                        m.requests += e.requests;
                        m.failures += e.failures;
                        m.probes += e.probes;
                        m.in_flight += e.in_flight;
                        m.upstream_connections += e.upstream_connections;
                        m.latency_histogram.add(&e.latency_histogram);
                        if e.requests > *best {
                            *best = e.requests;
                            m.state = e.state;
                            m.latency = e.latency;
                        }
                    }
                    None => {
                        let requests = e.requests;
                        merged.push((e, requests));
                    }
                }
            }
        }
        let total: u64 = merged.iter().map(|(m, _)| m.requests).sum();
        merged
            .into_iter()
            .map(|(mut m, _)| {
                #[allow(clippy::cast_precision_loss)]
                {
                    m.share = if total == 0 {
                        0.0
                    } else {
                        m.requests as f64 / total as f64
                    };
                }
                m
            })
            .collect()
    }
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
    /// Endpoints ejected for failing.
    pub ejections: u64,
    /// Client connections closed for a PING flood (more PINGs than the balancer answers).
    pub ping_floods: u64,
    /// Client connections closed for a SETTINGS flood.
    pub settings_floods: u64,
    /// Client connections closed for an RST_STREAM flood.
    pub rst_stream_floods: u64,
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
    /// Client connections cut off for a flood (shared with each connection's guard).
    pub(crate) floods: std::sync::Arc<crate::request::flood_guard::FloodCounters>,
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
            // The picker counts these; the pool adds them to the snapshot.
            ejections: 0,
            ping_floods: get(&self.floods.ping),
            settings_floods: get(&self.floods.settings),
            rst_stream_floods: get(&self.floods.rst_stream),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(addr: &str, state: EndpointState, requests: u64, latency_ms: u64) -> EndpointStats {
        EndpointStats {
            addr: addr.parse().unwrap(),
            name: addr.to_owned(),
            state,
            requests,
            failures: 1,
            probes: 0,
            in_flight: 2,
            share: 0.0,
            latency: Some(Duration::from_millis(latency_ms)),
            upstream_connections: 1,
            latency_histogram: HistogramSnapshot {
                counts: vec![requests, 0],
                sum: 0.0,
            },
        }
    }

    #[test]
    fn workers_merge_by_address_and_shares_are_recomputed() {
        let a = "10.0.0.1:80";
        let b = "10.0.0.2:80";
        let merged = EndpointStats::merge_workers([
            vec![
                stats(a, EndpointState::Active, 30, 5),
                stats(b, EndpointState::Degraded, 10, 50),
            ],
            vec![
                stats(b, EndpointState::Active, 60, 6),
                stats(a, EndpointState::Active, 0, 7),
            ],
        ]);
        assert_eq!(merged.len(), 2);
        assert_eq!(merged[0].addr, a.parse().unwrap());
        assert_eq!(merged[0].requests, 30);
        assert_eq!(merged[0].failures, 2);
        assert_eq!(merged[0].in_flight, 4);
        assert_eq!(merged[0].upstream_connections, 2);
        assert_eq!(merged[1].latency_histogram.counts, [70, 0]);
        assert_eq!(merged[0].latency, Some(Duration::from_millis(5)));
        assert_eq!(merged[1].requests, 70);
        // The second worker sent b the most: its view wins.
        assert_eq!(merged[1].state, EndpointState::Active);
        assert_eq!(merged[1].latency, Some(Duration::from_millis(6)));
        assert!((merged[0].share - 0.3).abs() < 1e-9);
        assert!((merged[1].share - 0.7).abs() < 1e-9);
    }
}
