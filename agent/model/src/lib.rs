//! skewless's model of the world: which Services opted in (`skewless.io/mode`), with which
//! config, on which ClusterIP:ports, and which endpoints back them.
//!
//! Pure logic, no I/O. Sources (Kubernetes watchers in `skewless-k8s`, the local file in
//! `skewless-services-file`) convert their objects into [`ServiceInput`] / [`SliceInput`] and
//! feed an [`Index`]; consumers (the datapath reconciler, the balancer, status) read
//! [`Snapshot`]s from [`Index::subscribe`].
//!
//! Bad input never breaks traffic: a Service whose annotations or spec are invalid keeps its
//! last good config; the error is logged once, counted in [`Metrics`], and returned as a
//! [`Rejection`] so the source can post a Kubernetes Warning Event.

#![forbid(unsafe_code)]

pub mod annotations;
mod endpoints;
mod error;
mod index;
mod metrics;
mod service;

pub use annotations::{MethodPattern, Mode, Tuning};
pub use endpoints::{Conditions, Endpoint, EndpointInput, SliceInput, SliceKey, SlicePortInput};
pub use error::{ConfigError, ConfigErrors};
pub use index::{Index, PortState, Rejection, ServiceState, Snapshot, Vip};
pub use metrics::Metrics;
pub use service::{PortInput, ServiceConfig, ServiceInput, ServiceKey, ServicePort, TargetPort};

/// What the agent knows about the node it runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// `topology.kubernetes.io/zone`, for zone-aware endpoint choice.
    pub zone: Option<String>,
    /// `spec.podCIDRs`: the balancer accepts connections only from these (this node's pods).
    pub pod_cidrs: Vec<String>,
}
