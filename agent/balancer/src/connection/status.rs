//! What `skewless status` and the admin crate read of a connection-mode Service: the policy's
//! state, skew, and per-backend figures, bounded by services x backends (nothing per
//! connection). The histograms and labelled counters both modes record into are
//! [`crate::metrics`].

use std::net::SocketAddr;

use super::policy::PolicyState;
use crate::endpoints::EndpointState;
use crate::metrics::RotationReason;

/// Rotations started since the balancer started, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RotationCounts {
    pub skew: u64,
    pub backend_removed: u64,
    pub not_serving: u64,
    pub max_age: u64,
    pub drain: u64,
    pub idle: u64,
}

impl RotationCounts {
    /// The count of `reason`.
    #[must_use]
    pub fn get(&self, reason: RotationReason) -> u64 {
        match reason {
            RotationReason::Skew => self.skew,
            RotationReason::BackendRemoved => self.backend_removed,
            RotationReason::NotServing => self.not_serving,
            RotationReason::MaxAge => self.max_age,
            RotationReason::Drain => self.drain,
            RotationReason::Idle => self.idle,
        }
    }

    /// From the Service's metric cells (by [`RotationReason::index`]).
    pub(crate) fn from_metrics(counts: &[u64; RotationReason::ALL.len()]) -> Self {
        let get = |reason: RotationReason| counts[reason.index()];
        Self {
            skew: get(RotationReason::Skew),
            backend_removed: get(RotationReason::BackendRemoved),
            not_serving: get(RotationReason::NotServing),
            max_age: get(RotationReason::MaxAge),
            drain: get(RotationReason::Drain),
            idle: get(RotationReason::Idle),
        }
    }

    /// Every reason with its count (the metric's label values).
    #[must_use]
    pub fn iter(&self) -> [(RotationReason, u64); RotationReason::ALL.len()] {
        RotationReason::ALL.map(|r| (r, self.get(r)))
    }

    /// All reasons together.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.iter().iter().map(|(_, n)| n).sum()
    }
}

/// One backend of a connection-mode Service.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendStats {
    pub addr: SocketAddr,
    /// Pod name.
    pub name: String,
    /// Active (takes new connections), NotServing (its health check says so) or Ejected
    /// (connects to it failed; retried after a backoff).
    pub state: EndpointState,
    /// Relayed client connections open on it now.
    pub connections: usize,
    /// Requests its connections carried since it was added.
    pub requests: u64,
    /// Its share of the Service's requests over the last 30 s (0..=1).
    pub share: f64,
    /// Requests per second of the connections that stay on it (the placement's load).
    pub rate: f64,
    /// Failed connects to it since it was added.
    pub connect_failures: u64,
}

/// A connection-mode Service's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnectionStats {
    /// Where the rotation policy stands.
    pub state: PolicyState,
    /// Largest request share / fair share over the ready backends, over the last 30 s (the
    /// definition `observe` reports; 1 = even, 0 = no traffic).
    pub skew: f64,
    /// The same over the current placement (each connection at its recent rate).
    pub live_skew: f64,
    /// Backends that take new connections (listed, serving, not ejected).
    pub ready_backends: usize,
    /// Backends with requests in the last 30 s.
    pub backends_receiving: usize,
    /// Relayed client connections open now.
    pub connections: usize,
    /// Of those, connections whose client does not survive a GOAWAY (tonic): never rotated
    /// for skew, counted as load.
    pub unrotatable_connections: usize,
    /// Rotations since the start, by reason.
    pub rotations: RotationCounts,
    /// Skew rotations in the last minute.
    pub rotations_last_minute: usize,
    /// The skew is above the threshold but no rotation can lower it: as even as connection
    /// mode can be (request mode balances per call).
    pub as_even_as_possible: bool,
    /// Client connections closed because no backend could be connected.
    pub no_backend: u64,
    /// Per backend.
    pub backends: Vec<BackendStats>,
}
