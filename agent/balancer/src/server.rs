//! The client-connection lifecycle of one Service's balancer, whichever the mode: accept,
//! admit the peer, `TCP_NODELAY`, the max connection age (+-10% jitter, following the live
//! configuration), the drain on shutdown with its grace period, and reaping finished
//! connections.
//!
//! What happens on one connection is the mode's: a [`NewConnection`] (tower's `NewService`
//! idea: one value per Service and worker, one future per accepted connection) serves it, and
//! is told through [`Stop`] when to wind down. Request mode terminates HTTP/2 and balances
//! every request; connection mode relays the connection to one backend. Winding down is a
//! graceful two-phase GOAWAY in both, sent by the mode (h2 in request mode, the relay in
//! connection mode), followed by the grace period this module sets.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::Instrument as _;

use crate::error::BalancerError;
use crate::metrics::{RotationReason, ServiceMetrics};

/// Default idle timeout of a client connection, both modes: ten minutes, twice the five
/// minutes gRPC servers allow between keepalive PINGs by default (grpc-go's and grpc-java's
/// enforcement policy), so a client that pings as often as a default server allows keeps its
/// connection.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// Default cap on client connections per balancer, both modes: far above what the pods of one
/// node open to one Service (a few per pod), low enough that the connections at the cap fit
/// the agent's memory (request mode ~25 KiB per idle connection: 50 MiB at the cap).
pub const DEFAULT_MAX_CLIENT_CONNECTIONS: usize = 2048;

/// The settings of the client-connection lifecycle, read from a mode's configuration.
pub trait Lifecycle {
    /// Client connections older than this (+-10% jitter) are wound down.
    fn max_connection_age(&self) -> Option<Duration>;
    /// How long streams may run on after a connection (or the whole server) is wound down.
    fn drain_grace(&self) -> Duration;
    /// A connection that carried no stream and received no PING for this long after its
    /// preface is wound down (GOAWAY, counted as an `idle` rotation); `None`: never.
    fn idle_timeout(&self) -> Option<Duration> {
        None
    }
    /// Most client connections open at once; one accepted beyond is closed at once, before
    /// anything is read from it, and counted (`connection_limit`).
    fn max_client_connections(&self) -> usize {
        usize::MAX
    }
}

/// Why a client connection is asked to wind down: [`RotationReason::Drain`] (the server is
/// shutting down: opt-out, agent drain) or [`RotationReason::MaxAge`] (the connection reached
/// its max age). The lifecycle's reasons are rotation reasons: one type, counted as it is.
pub type StopReason = RotationReason;

/// Makes the handler of every client connection a server accepts (see the module docs).
pub trait NewConnection {
    /// The mode's configuration; the lifecycle settings come from it.
    type Config: Lifecycle + Send + Sync + 'static;

    /// Follows the live configuration (a connection's max age follows it while it is open).
    fn config(&self) -> watch::Receiver<Arc<Self::Config>>;

    /// A uniform number in [0, 1) from the balancer's (injectable) RNG, for the max-age jitter.
    fn random_unit(&self) -> f64;

    /// The Service port's numbers: [`serve`] counts client connections, their lifetimes and
    /// the rotations of the lifecycle (max age, drain) into them.
    fn metrics(&self) -> Arc<ServiceMetrics>;

    /// Serves one admitted client connection until it is over. `stop` resolves when the
    /// connection should wind down; the mode then closes it gracefully within
    /// [`Stop::grace`].
    fn serve_connection(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        stop: Stop<Self::Config>,
    ) -> impl Future<Output = ()> + Send + 'static;
}

/// Tells one client connection when to wind down: at the server's drain, or at its max age.
#[derive(Debug)]
pub struct Stop<C> {
    config: watch::Receiver<Arc<C>>,
    drain: watch::Receiver<bool>,
    /// The connection's own factor on the max age (0.9..1.1).
    jitter: f64,
    /// Where the rotation is counted when the connection is told to wind down.
    metrics: Option<Arc<ServiceMetrics>>,
}

impl<C: Lifecycle> Stop<C> {
    /// A stop signal that follows `config` and resolves when `drain` turns true, for a handler
    /// used outside [`serve`] (tests).
    #[must_use]
    pub fn new(config: watch::Receiver<Arc<C>>, drain: watch::Receiver<bool>, jitter: f64) -> Self {
        Self {
            config,
            drain,
            jitter,
            metrics: None,
        }
    }

    /// Resolves when the connection should wind down. The max age counts from the first poll
    /// (both modes poll it once the client's preface is in; before it they wait on
    /// [`Stop::drained`]), or from the change for a max age set or changed while the
    /// connection is open. Poll the same future for the life of the connection: it arms its
    /// timers once per configuration, not once per poll.
    pub async fn stopped(&mut self) -> RotationReason {
        let reason = self.wait().await;
        if let Some(m) = &self.metrics {
            m.rotated(reason);
        }
        reason
    }

    /// Resolves when the server drains (counted as the connection's drain rotation): what
    /// stops a connection whose client has not sent its preface yet. Such a connection has no
    /// stream, so a drain closes it at once; its max age does not count yet, because closing a
    /// connection the client is still opening is no rotation: the client sees its connect
    /// fail (grpc-js then fails its calls "No connection established" until it reconnects),
    /// where a max age must wind a connection down with a GOAWAY.
    pub async fn drained(&mut self) -> RotationReason {
        // A dropped sender (the server is gone) stops the connection as a drain does.
        let _ = self.drain.wait_for(|d| *d).await;
        tracing::debug!("draining client connection");
        if let Some(m) = &self.metrics {
            m.rotated(RotationReason::Drain);
        }
        RotationReason::Drain
    }

    async fn wait(&mut self) -> RotationReason {
        let jitter = self.jitter;
        let mut since = tokio::time::Instant::now();
        let mut max_age = self.config.borrow_and_update().max_connection_age();
        let mut following_config = true;
        loop {
            let aged = async {
                match max_age {
                    Some(age) => tokio::time::sleep_until(since + age.mul_f64(jitter)).await,
                    None => std::future::pending().await,
                }
            };
            let changed = self.config.changed();
            let draining = self.drain.wait_for(|d| *d);
            tokio::select! {
                _ = draining => {
                    tracing::debug!("draining client connection");
                    return RotationReason::Drain;
                }
                () = aged => {
                    tracing::debug!("client connection reached its max age");
                    return RotationReason::MaxAge;
                }
                res = changed, if following_config => following_config = res.is_ok(),
            }
            let age = self.config.borrow_and_update().max_connection_age();
            if age != max_age {
                max_age = age;
                since = tokio::time::Instant::now();
            }
        }
    }

    /// How long the connection's streams may run on once it winds down (the configuration's
    /// drain grace as of now).
    #[must_use]
    pub fn grace(&self) -> Duration {
        self.config.borrow().drain_grace()
    }
}

/// Serves client connections from `listener` with `new` until `shutdown` resolves, then
/// drains: every connection is told to wind down, gets the drain grace to finish, and what is
/// left after that is cut. A connection whose peer `admit` refuses is closed at once, before
/// any byte is read.
///
/// # Errors
/// When accepting a connection fails in a way that is not about one connection.
pub async fn serve<N: NewConnection>(
    new: &N,
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
        let metrics = new.metrics();
        let cap = new.config().borrow().max_client_connections();
        if usize::try_from(metrics.open_connections()).unwrap_or(usize::MAX) >= cap {
            // Closed with FIN before any byte is read: the client sees its connection end
            // and reconnects after its backoff; the clients already served keep all they have.
            metrics.client_error(crate::metrics::ClientErrorReason::ConnectionLimit);
            tracing::debug!(%peer, cap, "connection refused: at the client connection limit");
            crate::linger::close(stream);
            continue;
        }
        let _ = stream.set_nodelay(true);
        let open = metrics.connection_opened();
        let stop = Stop {
            config: new.config(),
            drain: drain_rx.clone(),
            // +-10% jitter so connections accepted together do not all rotate together.
            jitter: 0.9 + 0.2 * new.random_unit(),
            metrics: Some(metrics),
        };
        let connection = new.serve_connection(stream, peer, stop);
        conns.spawn(
            async move {
                // Counted open until the connection's handler is done (or cut at the end of
                // the drain grace, which drops it too).
                let _open = open;
                connection.await;
            }
            .instrument(tracing::debug_span!("client", %peer)),
        );
    };
    drop(listener);
    let _ = drain_tx.send(true);
    let grace = new.config().borrow().drain_grace();
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

/// Accept errors that concern one connection only (the peer gave up during the handshake).
fn is_connection_error(error: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        error.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Ages(Option<Duration>);

    impl Lifecycle for Ages {
        fn max_connection_age(&self) -> Option<Duration> {
            self.0
        }
        fn drain_grace(&self) -> Duration {
            Duration::from_secs(1)
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn max_age_is_jittered_and_counts_from_a_live_change() {
        let (config_tx, config) = watch::channel(Arc::new(Ages(Some(Duration::from_secs(10)))));
        let (_drain_tx, drain) = watch::channel(false);
        let mut stop = Stop::new(config, drain, 1.1);
        let t0 = tokio::time::Instant::now();
        let stopped = stop.stopped();
        tokio::pin!(stopped);
        // Change the age 5 s in: the new age counts from the change, with the same jitter.
        tokio::select! {
            _ = &mut stopped => panic!("must not stop before the change"),
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
        config_tx.send_replace(Arc::new(Ages(Some(Duration::from_secs(20)))));
        assert_eq!(stopped.await, RotationReason::MaxAge);
        let elapsed = t0.elapsed();
        let due = Duration::from_secs(5) + Duration::from_secs(22);
        assert!(
            elapsed >= due && elapsed < due + Duration::from_millis(2),
            "20 s x 1.1 counted from the change, stopped after {elapsed:?}"
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn drain_stops_a_connection_without_max_age() {
        let (_config_tx, config) = watch::channel(Arc::new(Ages(None)));
        let (drain_tx, drain) = watch::channel(false);
        let mut stop = Stop::new(config, drain, 1.0);
        let stopped = stop.stopped();
        tokio::pin!(stopped);
        tokio::select! {
            _ = &mut stopped => panic!("no max age: must wait for the drain"),
            () = tokio::time::sleep(Duration::from_secs(3600)) => {}
        }
        drain_tx.send_replace(true);
        assert_eq!(stopped.await, RotationReason::Drain);
    }
}
