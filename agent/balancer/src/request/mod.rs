//! Request mode: the balancer terminates each client's HTTP/2 connection (`client`) and
//! forwards every stream (`proxy`) to an endpoint picked for that request ([`picker`]) over
//! the pool's upstream connections (`pool`), retrying only where that is safe (`proxy`, within
//! the `retry_budget`); a client that floods its connection with control frames is cut off
//! (`flood`). [`Balancer`] is one Service port's request-mode balancer on one worker.

pub(crate) mod client;
pub mod codec;
pub mod config;
pub(crate) mod flood_guard;
pub mod picker;
mod pool;
mod proxy;
mod retry;
mod retry_budget;
pub mod status;
mod wind_down;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use rand::SeedableRng as _;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::AbortHandle;

use crate::endpoints::Endpoint;
use crate::error::BalancerError;
use crate::metrics;
use crate::server;
use config::Config;
use pool::Pool;
use status::{BalancerCounters, EndpointStats};

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
        endpoints: watch::Receiver<Vec<Endpoint>>,
        rng: impl rand::RngCore + Send + 'static,
    ) -> Self {
        let pool = Pool::new(config, Box::new(rng));
        let discovery = crate::endpoints::follow(&pool, endpoints, Pool::update);
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

/// Request mode's data path: h2's ([`Balancer`], the default) or the project's frame codec's
/// ([`codec::CodecBalancer`], experimental).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DataPath {
    #[default]
    H2,
    Codec,
}

impl std::str::FromStr for DataPath {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "h2" => Ok(Self::H2),
            "codec" => Ok(Self::Codec),
            other => Err(format!("unknown data path {other:?}: h2 or codec")),
        }
    }
}

impl std::fmt::Display for DataPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::H2 => "h2",
            Self::Codec => "codec",
        })
    }
}

/// What an owner reads from and tells a request-mode balancer of either data path, one per
/// worker: its numbers, and its configuration.
pub trait RequestBalancer: Send + Sync {
    /// The Service port's call latency, failures by reason, rotations and client connections.
    fn snapshot(&self) -> metrics::ServiceSnapshot;
    /// Balancer-wide counters (retries, locally generated errors, ejections).
    fn counters(&self) -> BalancerCounters;
    /// Per-endpoint state, load and latency.
    fn stats(&self) -> Vec<EndpointStats>;
    /// Applies a new configuration to the running balancer.
    fn reconfigure(&self, config: Config);
    /// The configuration in effect.
    fn config(&self) -> Arc<Config>;
    /// Which data path it is.
    fn data_path(&self) -> DataPath;
}

/// Both paths' balancers have the same inherent methods under these names.
macro_rules! request_balancer {
    ($balancer:ty, $path:expr) => {
        impl RequestBalancer for $balancer {
            fn snapshot(&self) -> metrics::ServiceSnapshot {
                self.metrics()
            }
            fn counters(&self) -> BalancerCounters {
                Self::counters(self)
            }
            fn stats(&self) -> Vec<EndpointStats> {
                Self::stats(self)
            }
            fn reconfigure(&self, config: Config) {
                Self::reconfigure(self, config);
            }
            fn config(&self) -> Arc<Config> {
                Self::config(self)
            }
            fn data_path(&self) -> DataPath {
                $path
            }
        }
    };
}

request_balancer!(Balancer, DataPath::H2);
request_balancer!(codec::CodecBalancer, DataPath::Codec);
