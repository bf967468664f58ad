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
