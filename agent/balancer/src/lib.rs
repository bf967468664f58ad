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
//! Shape: [`endpoints`] is the endpoint set both modes own (ids, the watch's diff, readiness,
//! active and passive health); [`server`] is the client-connection lifecycle (accept, admit,
//! max age, drain), with the per-connection behaviour behind [`NewConnection`]; request mode
//! is `request` (one client connection), `proxy` (one stream), `pool` and [`picker`];
//! connection mode is [`connection`] (placement, the skew policy, rotations) over [`relay`].
#![forbid(unsafe_code)]

mod budget;
pub mod config;
pub mod connection;
pub mod endpoint;
pub mod endpoints;
mod error;
mod flood;
pub mod grpc;
pub mod health;
mod io;
mod linger;
pub mod liveness;
pub mod metrics;
pub mod picker;
mod pool;
mod proxy;
pub mod relay;
mod request;
mod retry_budget;
pub mod server;
mod socket;
pub mod stats;
pub mod workers;

use std::future::Future;
use std::sync::Arc;

use rand::SeedableRng as _;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tracing::Instrument as _;

pub use config::{Config, LivenessConfig, PickerConfig, RetryBudgetConfig};
pub use connection::{ConnectionBalancer, ConnectionConfig, ConnectionStats, RotationConfig};
pub use endpoint::Endpoint;
pub use error::BalancerError;
pub use relay::RotateReason;
pub use server::{Lifecycle, NewConnection, Stop, StopReason};
pub use stats::{BalancerCounters, EndpointState, EndpointStats};
pub use workers::{Served, Workers, reuseport_listeners};

use std::net::SocketAddr;

use pool::Pool;

/// The balancer of one Service. Cheap to share behind an `Arc`; dropping it stops following
/// the endpoint set and closes its upstream connections once their streams end.
pub struct Balancer {
    pub(crate) pool: Arc<Pool>,
    discovery: AbortHandle,
}

impl std::fmt::Debug for Balancer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Balancer").finish_non_exhaustive()
    }
}

impl Balancer {
    /// A balancer over the endpoints published on `endpoints`, with an OS-seeded RNG.
    /// Must be called inside a Tokio runtime (it spawns the tasks that follow the endpoint set
    /// and keep connections up).
    #[must_use]
    pub fn new(config: Config, endpoints: watch::Receiver<Vec<Endpoint>>) -> Self {
        Self::with_rng(config, endpoints, rand::rngs::SmallRng::from_os_rng())
    }

    /// Like [`Balancer::new`] with the picker's RNG supplied, so tests are deterministic.
    #[must_use]
    pub fn with_rng(
        config: Config,
        mut endpoints: watch::Receiver<Vec<Endpoint>>,
        rng: impl rand::RngCore + Send + 'static,
    ) -> Self {
        let pool = Pool::new(config, Box::new(rng));
        // Take the current set now, so a request arriving right after construction does not
        // see an empty Service.
        pool.update(&endpoints.borrow_and_update());
        let discovery = tokio::spawn(
            pool::discovery_task(Arc::downgrade(&pool), endpoints)
                .instrument(tracing::debug_span!("discovery")),
        )
        .abort_handle();
        Self { pool, discovery }
    }

    /// Applies `config` to the running balancer without dropping a connection or a call.
    ///
    /// Everything takes effect live: the picker's tuning, retries (retryable methods, budget,
    /// attempts) and timeouts from the next request on; connection settings (connect timeout,
    /// backoff, streams and connections per endpoint) from the next upstream connect; a changed
    /// health service stops the old `grpc.health.v1` watches and starts the new ones on the
    /// open upstream connections (switched off, every endpoint counts as serving again);
    /// `max_connection_age` applies to new client connections, and to open ones counted from
    /// the change (with the usual jitter, so they do not all reconnect at once); `drain_grace`
    /// applies to drains that start afterwards.
    pub fn reconfigure(&self, config: Config) {
        tracing::debug!(?config, "reconfigured");
        self.pool.reconfigure(config);
    }

    /// The configuration in effect.
    #[must_use]
    pub fn config(&self) -> Arc<Config> {
        self.pool.config()
    }

    /// Per-endpoint counters, for metrics and `skewless status`.
    #[must_use]
    pub fn stats(&self) -> Vec<EndpointStats> {
        self.pool.stats()
    }

    /// Balancer-wide counters (retries, locally generated errors, ejections).
    #[must_use]
    pub fn counters(&self) -> BalancerCounters {
        BalancerCounters {
            ejections: self.pool.ejections(),
            ..self.pool.counters.snapshot()
        }
    }

    /// The Service port's call latency, failures by reason, rotations and client connections
    /// on this balancer's worker.
    #[must_use]
    pub fn metrics(&self) -> metrics::ServiceSnapshot {
        self.pool.metrics.snapshot()
    }

    /// Serves client connections from `listener` until `shutdown` resolves, then drains: every
    /// client connection gets a graceful two-phase GOAWAY (last-stream-id 2^31-1
    /// and a PING, then the real last stream id), in-flight requests get up to
    /// [`Config::drain_grace`] to finish, and what is left after that is cut.
    ///
    /// # Errors
    /// When accepting a connection fails in a way that is not about one connection.
    pub async fn serve(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), BalancerError> {
        self.serve_admitting(listener, shutdown, |_| true).await
    }

    /// Like [`Balancer::serve`], but a connection whose peer `admit` refuses is closed at once,
    /// before any HTTP/2 is spoken: the agent uses it so that only this node's pods can use
    /// the balancer.
    ///
    /// # Errors
    /// As [`Balancer::serve`].
    pub async fn serve_admitting(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
        admit: impl Fn(SocketAddr) -> bool,
    ) -> Result<(), BalancerError> {
        server::serve(self, listener, shutdown, admit).await
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.discovery.abort();
    }
}
