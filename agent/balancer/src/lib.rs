//! skewless's node balancer, request mode.
//!
//! A ClusterIP balances per connection and a gRPC client keeps one HTTP/2 connection, so every
//! call of a client lands on one pod. The balancer terminates the client's HTTP/2 connection
//! and forwards every request to an endpoint of the Service picked for that request (see
//! [`picker`] for the algorithm), over one HTTP/2 connection per endpoint.
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
#![forbid(unsafe_code)]

pub mod config;
pub mod endpoint;
pub mod endpoints;
mod error;
pub mod grpc;
mod health;
mod io;
pub mod picker;
mod pool;
mod proxy;
pub mod stats;
pub mod workers;

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use rand::SeedableRng as _;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinSet};
use tracing::Instrument as _;

pub use config::{Config, PickerConfig};
pub use endpoint::Endpoint;
pub use error::BalancerError;
pub use stats::{BalancerCounters, EndpointState, EndpointStats};
pub use workers::{Served, Workers, reuseport_listeners};

use std::net::SocketAddr;

use pool::Pool;

/// The balancer of one Service. Cheap to share behind an `Arc`; dropping it stops following
/// the endpoint set and closes its upstream connections once their streams end.
pub struct Balancer {
    pool: Arc<Pool>,
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

    /// Balancer-wide counters (retries, locally generated errors).
    #[must_use]
    pub fn counters(&self) -> BalancerCounters {
        self.pool.counters.snapshot()
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
        let (drain_tx, drain_rx) = watch::channel(false);
        let mut conns = JoinSet::new();
        tokio::pin!(shutdown);
        let result = loop {
            let accepted = tokio::select! {
                () = &mut shutdown => break Ok(()),
                accepted = listener.accept() => accepted,
                // Reap finished connection tasks so the set does not grow without bound.
                Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            };
            let (stream, peer) = match accepted {
                Ok(ok) => ok,
                Err(error) if is_connection_error(&error) => {
                    tracing::debug!(%error, "accept failed for one connection");
                    continue;
                }
                Err(error) => break Err(BalancerError::Accept(error)),
            };
            if !admit(peer) {
                tracing::debug!(%peer, "connection refused: peer not admitted");
                drop(stream);
                continue;
            }
            let _ = stream.set_nodelay(true);
            let pool = self.pool.clone();
            let mut drain = drain_rx.clone();
            let mut config = self.pool.subscribe_config();
            // +-10% jitter so connections accepted together do not all rotate together.
            let jitter = 0.9 + 0.2 * self.pool.random_unit();
            conns.spawn(
                async move {
                    let handshake = h2::server::Builder::new()
                        // Fixed windows; see `pool::STREAM_WINDOW`.
                        .initial_window_size(pool::STREAM_WINDOW)
                        .initial_connection_window_size(pool::CONNECTION_WINDOW)
                        .max_concurrent_streams(MAX_CLIENT_STREAMS)
                        .max_header_list_size(pool::MAX_HEADER_LIST)
                        .max_send_buffer_size(pool::MAX_SEND_BUFFER)
                        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
                        .handshake::<_, Bytes>(stream);
                    let mut conn = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
                        Ok(Ok(conn)) => conn,
                        Ok(Err(error)) => {
                            tracing::debug!(%error, "client handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!("client sent no HTTP/2 preface in time");
                            return;
                        }
                    };
                    // Every stream runs on its own task; this one drives the connection.
                    let spawn_stream = |(req, respond)| {
                        // Boxed: tokio moves a task's future by value when it spawns and
                        // finishes it; a pointer is cheaper to move than the call's state
                        // machine.
                        tokio::spawn(Box::pin(proxy::handle(pool.clone(), req, respond)));
                    };
                    // The age counts from the accept, or from the change for a max age set or
                    // changed while the connection is open.
                    let mut since = tokio::time::Instant::now();
                    let mut max_age = config.borrow_and_update().max_connection_age;
                    let mut following_config = true;
                    loop {
                        // Armed once per configuration, not once per accepted stream.
                        let stop = {
                            let aged = async {
                                match max_age {
                                    Some(age) => tokio::time::sleep_until(since + age.mul_f64(jitter)).await,
                                    None => std::future::pending().await,
                                }
                            };
                            let changed = config.changed();
                            let draining = drain.wait_for(|d| *d);
                            tokio::pin!(aged, changed, draining);
                            loop {
                                tokio::select! {
                                    next = conn.accept() => match next {
                                        Some(Ok(stream)) => spawn_stream(stream),
                                        Some(Err(error)) => {
                                            tracing::debug!(%error, "client connection failed");
                                            return;
                                        }
                                        None => return,
                                    },
                                    _ = &mut draining => {
                                        tracing::debug!("draining client connection");
                                        break true;
                                    }
                                    () = &mut aged => {
                                        tracing::debug!("client connection reached its max age");
                                        break true;
                                    }
                                    res = &mut changed, if following_config => {
                                        following_config = res.is_ok();
                                        break false;
                                    }
                                }
                            }
                        };
                        if stop {
                            break;
                        }
                        let age = config.borrow_and_update().max_connection_age;
                        if age != max_age {
                            max_age = age;
                            since = tokio::time::Instant::now();
                        }
                    }
                    let grace = pool.config().drain_grace;
                    // Two-phase GOAWAY (last stream id 2^31-1 and a PING, then the real last
                    // stream id): the client stops opening streams on this connection and
                    // reconnects; streams in flight finish within the grace period, and streams
                    // the client opened before it saw the GOAWAY are still served.
                    conn.graceful_shutdown();
                    let drained = tokio::time::timeout(grace, async {
                        while let Some(next) = conn.accept().await {
                            match next {
                                Ok(stream) => spawn_stream(stream),
                                Err(error) => {
                                    tracing::debug!(%error, "client connection failed while draining");
                                    return;
                                }
                            }
                        }
                    })
                    .await;
                    if drained.is_err() {
                        tracing::debug!("grace period over, closing client connection");
                        conn.abrupt_shutdown(h2::Reason::NO_ERROR);
                        // Flush the final GOAWAY, briefly.
                        let _ = tokio::time::timeout(
                            std::time::Duration::from_millis(100),
                            std::future::poll_fn(|cx| conn.poll_closed(cx)),
                        )
                        .await;
                    }
                }
                .instrument(tracing::debug_span!("client", %peer)),
            );
        };
        drop(listener);
        let _ = drain_tx.send(true);
        let grace = self.pool.config().drain_grace;
        let drained =
            tokio::time::timeout(grace, async { while conns.join_next().await.is_some() {} }).await;
        if drained.is_err() {
            tracing::info!(
                left = conns.len(),
                "drain grace period over, closing connections"
            );
            conns.shutdown().await;
        }
        result
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.discovery.abort();
    }
}

/// Most streams one client connection may have open at once. A pinned client sends all its
/// calls over one connection, so this is its concurrency; what it can make the balancer buffer
/// is bounded by the connection's flow-control window, not by this.
const MAX_CLIENT_STREAMS: u32 = 1024;
/// Streams the balancer may reset for a client's protocol errors before it closes the
/// connection (h2's guard against reset floods; hyper's default).
const MAX_LOCAL_ERROR_RESETS: usize = 1024;
/// How long a new client connection may take to send its HTTP/2 preface and SETTINGS.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Accept errors that concern one connection only (the peer gave up during the handshake).
fn is_connection_error(error: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        error.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    )
}
