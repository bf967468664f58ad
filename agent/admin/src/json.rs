//! The `/status` document: served by the agent, read by `skewless status` and the tests.

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
}

/// One eBPF redirect entry: a Service address and where its connects go.
#[derive(Debug, Serialize, Deserialize)]
pub struct RedirectStatus {
    pub service: String,
    pub target: String,
}

/// One redirected Service port.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ServiceStatus {
    pub service: String,
    pub mode: String,
    pub vip: String,
    pub listener: String,
    pub ready_endpoints: usize,
    pub endpoints: Vec<EndpointStatus>,
}

/// One backend of a redirected Service port, over all data-plane workers.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EndpointStatus {
    pub name: String,
    pub addr: String,
    pub state: String,
    pub requests: u64,
    pub failures: u64,
    pub share: f64,
    pub latency_ms: Option<f64>,
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
