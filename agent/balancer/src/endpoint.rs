//! The balancer's view of a Service endpoint.

use std::net::SocketAddr;

/// One ready endpoint (pod address) of a Service. Plain data: the Kubernetes model or the local
/// file feeds a `Vec<Endpoint>` through a `tokio::sync::watch` channel.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// Where the pod listens.
    pub addr: SocketAddr,
    /// The pod's name, for logs and stats.
    pub name: String,
}

impl Endpoint {
    /// An endpoint named `name` at `addr`.
    #[must_use]
    pub fn new(addr: SocketAddr, name: impl Into<String>) -> Self {
        Self {
            addr,
            name: name.into(),
        }
    }
}
