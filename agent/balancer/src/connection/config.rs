//! Tuning of a connection-mode balancer. The agent fills the rotation policy and the health
//! and age settings from the Service's annotations; `ConnectionBalancer::reconfigure` applies
//! a new one live.

use std::time::Duration;

use super::policy::RotationConfig;

/// What the server's drain adds to the relays' grace (see [`ConnectionConfig::drain_grace`]).
const DRAIN_MARGIN: Duration = Duration::from_secs(2);

/// Configuration of one Service's connection-mode balancer.
#[derive(Debug, Clone)]
pub struct ConnectionConfig {
    /// When and how fast to rotate for skew.
    pub rotation: RotationConfig,
    /// How long one TCP connect to a backend may take before the next backend is tried.
    pub connect_timeout: Duration,
    /// How long a new client connection waits for a backend that is ready and serving before
    /// any listed backend is tried (fail open: the backend itself then answers).
    pub ready_timeout: Duration,
    /// Service name to watch with `grpc.health.v1.Health/Watch` on every backend, over a
    /// connection of the balancer's own ("" for the whole server); `None`: no active health
    /// checks. A backend turning NOT_SERVING takes no new connections and its connections are
    /// rotated.
    pub health_service: Option<String>,
    /// Client connections older than this (+-10% jitter) are rotated.
    pub max_connection_age: Option<Duration>,
    /// A relayed connection with no stream open, and no PING from the client, for this long
    /// (checked every eighth of it) is rotated, counted as `idle`; as request mode's
    /// `Config::idle_timeout` (the same default). Applies to connections accepted afterwards.
    pub idle_timeout: Option<Duration>,
    /// Most client connections relayed at once by this balancer (one per Service, shared by
    /// the workers); one accepted beyond is closed at once, before a backend is connected, and
    /// counted (`connection_limit`); as request mode's `Config::max_client_connections`.
    pub max_client_connections: usize,
    /// How long a rotated connection's streams may run on before they are reset, and how long
    /// a drain waits for connections.
    pub drain_grace: Duration,
    /// How long a rotation's PING may go unanswered before the final GOAWAY (the relay clamps
    /// it to 5-20 s).
    pub ping_timeout: Duration,
    /// Connect failures in a row that eject a backend from placement.
    pub failure_threshold: u32,
    /// First and largest ejection time; it doubles with every ejection in a row.
    pub ejection_backoff: (Duration, Duration),
    /// How often the controller samples the relays' counters and evaluates the policy.
    pub tick: Duration,
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        Self {
            rotation: RotationConfig::default(),
            connect_timeout: Duration::from_secs(1),
            ready_timeout: Duration::from_secs(1),
            health_service: None,
            max_connection_age: None,
            idle_timeout: Some(crate::server::DEFAULT_IDLE_TIMEOUT),
            max_client_connections: crate::server::DEFAULT_MAX_CLIENT_CONNECTIONS,
            drain_grace: Duration::from_secs(10),
            ping_timeout: Duration::from_secs(10),
            failure_threshold: 1,
            ejection_backoff: (Duration::from_secs(1), Duration::from_secs(30)),
            tick: Duration::from_secs(1),
        }
    }
}

impl crate::server::Lifecycle for ConnectionConfig {
    fn max_connection_age(&self) -> Option<Duration> {
        self.max_connection_age
    }

    /// The server waits a little longer than a relay's own grace: after its grace the relay
    /// resets what is left and closes with FIN, which is better than the server cutting the
    /// sockets.
    fn drain_grace(&self) -> Duration {
        self.drain_grace + DRAIN_MARGIN
    }

    fn idle_timeout(&self) -> Option<Duration> {
        self.idle_timeout
    }

    fn max_client_connections(&self) -> usize {
        self.max_client_connections
    }
}
