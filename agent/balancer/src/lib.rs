//! skewless's node balancer, in two modes. Request mode ([`Balancer`]) terminates a client's
//! HTTP/2 connection and forwards every request to an endpoint of the Service picked for that
//! request ([`picker`]). Connection mode ([`ConnectionBalancer`]) relays each client connection
//! frame by frame to one backend placed by load, and rotates connections with a graceful
//! GOAWAY when they are pinned unevenly ([`connection`], [`relay`]).
//!
//! Owns everything between the redirected client socket and the backends (HTTP/2, placement,
//! health, retries, drain, the per-Service metric cells); never the kernel side (the datapath
//! crate redirects connections here), where endpoints come from (a `watch` channel), or which
//! Services are balanced. Guarantees (request mode): gRPC semantics end to end (streaming,
//! trailers, `grpc-timeout` forwarded as the remaining budget, flow control end to end), the
//! balancer's own failures as gRPC statuses, and retries only when safe. Design and
//! measurements: docs/balancer.md and docs/connection-mode.md.
//!
//! ```no_run
//! # async fn run() -> Result<(), skewless_balancer::BalancerError> {
//! use skewless_balancer::{Balancer, Config, Endpoint};
//! let (tx, rx) = tokio::sync::watch::channel(vec![Endpoint::new(
//!     "10.0.0.7:50051".parse().unwrap(),
//!     "echo-0",
//! )]);
//! let balancer = Balancer::new(Config::default(), rx);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
//! // Later: tx.send(new_endpoints) whenever the endpoint set changes.
//! balancer.serve(listener, async { /* SIGTERM */ }).await?;
//! # drop(tx); Ok(()) }
//! ```
//!
//! Shape: top-level modules serve both modes, `request/` and `connection/` one each, and
//! neither of those two imports the other. Shared: [`endpoints`], [`server`] (the
//! client-connection lifecycle, the mode's behaviour behind [`NewConnection`]), [`workers`],
//! [`metrics`], [`grpc`], the tapped socket, the lingering close, the frame budgets, and
//! `upstream` (backend HTTP/2 connections: connect, the read tap, [`liveness`], [`health`]).
#![forbid(unsafe_code)]

mod label;

pub mod connection;
pub mod endpoints;
mod error;
mod flood;
pub mod grpc;
mod linger;
pub mod metrics;
mod request;
pub mod server;
mod settle;
mod socket;
mod upstream;
pub mod workers;

pub use connection::relay;
pub use request::{config, picker, status};
pub use upstream::{health, liveness};

// The modules' former paths, for callers.
#[doc(hidden)]
pub use endpoints as endpoint;
#[doc(hidden)]
pub use request::status as stats;

pub use config::{Config, LivenessConfig, PickerConfig, RetryBudgetConfig};
pub use connection::{ConnectionBalancer, ConnectionConfig, ConnectionStats, RotationConfig};
pub use endpoints::Endpoint;
pub use error::BalancerError;
pub use relay::RotateReason;
pub use request::codec::CodecBalancer;
pub use request::{Balancer, DataPath, RequestBalancer};
pub use server::{Lifecycle, NewConnection, Stop, StopReason};
pub use status::{BalancerCounters, EndpointState, EndpointStats};
pub use workers::{Served, Workers, reuseport_listeners};
