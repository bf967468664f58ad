//! skewless's node balancer: request mode and connection mode.
//!
//! A ClusterIP balances per connection and a gRPC client keeps one HTTP/2 connection, so every
//! call of a client lands on one pod. In request mode ([`Balancer`]) the balancer terminates
//! the client's HTTP/2 connection and forwards every request to an endpoint of the Service
//! picked for that request (see [`picker`] for the algorithm), over one HTTP/2 connection per
//! endpoint. In connection mode ([`ConnectionBalancer`]) it relays each client connection
//! frame by frame to one backend it places by load, and rotates connections with a graceful
//! GOAWAY when they are pinned unevenly (see [`connection`] and [`relay`]).
//!
//! Owns: everything between the redirected client socket and the backends (HTTP/2, placement,
//! health, retries, drain, the per-Service metric cells). Must not touch: the kernel side (the
//! datapath crate redirects connections here) or where endpoints come from (the agent hands
//! them over a `watch` channel); it never decides which Services are balanced.
//!
//! Wiring it up:
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
//! gRPC correctness: bodies stream through frame by frame with HTTP/2 flow control end to end;
//! trailers pass through; `grpc-timeout` is enforced here and forwarded as the remaining budget;
//! failures of the balancer itself become trailers-only gRPC responses (UNAVAILABLE,
//! DEADLINE_EXCEEDED). Requests that never reached an upstream (the connection had been told
//! GOAWAY) are sent on another connection; requests the upstream provably did not process
//! (REFUSED_STREAM, above a GOAWAY's last stream id), and any failed request of a method
//! configured as retryable, are replayed on another endpoint within the deadline and a retry
//! budget. See `docs/balancer.md` for the design, the wiring and measurements.
//!
//! Shape: top-level modules serve both modes, `request/` and `connection/` one each, and
//! neither of those two imports the other. Shared: [`endpoints`] (the endpoint set: ids, the
//! watch's diff, readiness, active and passive health), [`server`] (the client-connection
//! lifecycle: accept, admit, max age, drain, with the per-connection behaviour behind
//! [`NewConnection`]), [`workers`], [`metrics`], [`grpc`], the socket tap and the lingering
//! close, the frame budgets, and `upstream` (backend HTTP/2 connections: connect, the read tap,
//! [`liveness`], [`health`]). Request mode is `request` ([`Balancer`], the client connection,
//! the call, the pool, the [`picker`], the retry budget, the flood guard, [`config`],
//! [`stats`]); connection mode is [`connection`] (placement, the skew policy, rotations) over
//! its [`relay`].
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
pub use request::Balancer;
pub use server::{Lifecycle, NewConnection, Stop, StopReason};
pub use status::{BalancerCounters, EndpointState, EndpointStats};
pub use workers::{Served, Workers, reuseport_listeners};
