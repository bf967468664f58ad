//! The controller state of one connection-mode Service: its backends (the endpoint set), the
//! relayed connections placed on them, the windows of requests, and the rotation policy.
//! Plain synchronous state behind the balancer's lock, with time and randomness passed in:
//! the tasks in `mod.rs` drive it (placement on accept, a tick per second, endpoint and health
//! changes), and tests drive it on a virtual clock with fake relays.
//!
//! One controller serves every data-plane worker of the Service: placement is per connection
//! (a lock per accepted connection and per tick, never per request), and a shared view is what
//! makes the skew and the placement right whichever worker a connection landed on.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, RngCore};
use tokio::time::Instant;

use super::config::ConnectionConfig;
use super::policy::{
    BackendLoad, ConnId, ConnLoad, Evaluation, PolicyState, RotationPolicy, WINDOW,
};
use super::status::{BackendStats, ConnectionStats, RotationCounts};
use super::window::Window;
use crate::endpoints::Endpoint;
use crate::endpoints::EndpointState;
use crate::endpoints::{EndpointId, EndpointSet};
use crate::metrics::{RotationReason, ServiceMetrics};

/// Ticks over which a connection's request rate is measured.
const RATE_TICKS: usize = 10;
/// A connection younger than this has no rate of its own yet: it counts at an estimate (the
/// rate of the client it probably is, or the Service's mean per connection).
const SETTLE: Duration = Duration::from_secs(2);
/// How long a skew rotation's client is expected back (its reconnect is placed on the
/// least-loaded backend, at the rotated connection's rate).
const EXPECT_FOR: Duration = Duration::from_secs(10);

/// What the controller needs of a relayed connection (the relay's handle; a fake in tests).
pub(crate) trait Relayed: Send + Sync {
    /// Requests the connection carried so far.
    fn requests(&self) -> u64;
    /// Its client fails calls on a GOAWAY (never rotated for skew).
    fn unrotatable(&self) -> bool;
    /// Starts the graceful two-phase GOAWAY.
    fn rotate(&self, reason: RotationReason);
}

impl Relayed for crate::connection::relay::RelayHandle {
    fn requests(&self) -> u64 {
        self.stats().requests()
    }

    fn unrotatable(&self) -> bool {
        self.stats().unrotatable()
    }

    fn rotate(&self, reason: RotationReason) {
        crate::connection::relay::RelayHandle::rotate(self, reason);
    }
}

/// The controller's state of one backend.
#[derive(Debug)]
pub(crate) struct Backend {
    /// Requests per tick of the connections placed on it (closed ones included).
    window: Window,
    /// Requests of connections closed since the last tick.
    pending: u64,
    /// Requests since it was added.
    total_requests: u64,
    /// Connect failures since it was added.
    connect_failures: u64,
    /// Its active health check, when one runs (aborted with the backend).
    pub(crate) health: Option<crate::upstream::AbortOnDrop>,
}

impl Backend {
    fn new(ticks: usize) -> Self {
        Self {
            window: Window::new(ticks),
            pending: 0,
            total_requests: 0,
            connect_failures: 0,
            health: None,
        }
    }
}

struct Conn {
    backend: EndpointId,
    /// `None` while its backend connect is under way.
    relay: Option<Arc<dyn Relayed>>,
    placed_at: Instant,
    /// The relay's request count at the last tick.
    seen: u64,
    /// Requests per tick.
    recent: Window,
    /// The rate of the rotated client it probably is (a skew rotation's reconnect), counted
    /// until it has a rate of its own; other young connections count at the Service's mean.
    provisional: Option<f64>,
    /// Why it is being rotated, once it is.
    rotation: Option<RotationReason>,
}

/// Where a new client connection goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    pub(crate) conn: ConnId,
    pub(crate) backend: EndpointId,
    pub(crate) addr: SocketAddr,
}

/// A rotation to start (outside the lock is fine, the relay's `rotate` is cheap).
pub(crate) type Rotation = (Arc<dyn Relayed>, RotationReason);

pub(crate) struct Controller {
    pub(crate) backends: EndpointSet<Backend>,
    conns: BTreeMap<ConnId, Conn>,
    policy: RotationPolicy,
    rng: Box<dyn RngCore + Send>,
    next_conn: u64,
    /// Reconnects expected from skew rotations: (until, rate).
    expected: VecDeque<(Instant, f64)>,
    last: Evaluation,
    /// When the policy's outcome can change without new traffic (its last evaluation's
    /// [`Evaluation::wake`]).
    wake: Option<Instant>,
    /// Where rotations are counted (the lifecycle's max age and drain by the server, the
    /// others here).
    metrics: Arc<ServiceMetrics>,
    /// Client connections closed because no backend could be connected.
    no_backend: u64,
    /// Window length in ticks.
    window_ticks: usize,
    tick: Duration,
    failure_threshold: u32,
    ejection_backoff: (Duration, Duration),
}

impl Controller {
    pub(crate) fn new(
        config: &ConnectionConfig,
        rng: Box<dyn RngCore + Send>,
        metrics: Arc<ServiceMetrics>,
    ) -> Self {
        let tick = config.tick.max(Duration::from_millis(10));
        Self {
            backends: EndpointSet::new(),
            conns: BTreeMap::new(),
            policy: RotationPolicy::new(config.rotation.clone()),
            rng,
            next_conn: 0,
            expected: VecDeque::new(),
            last: Evaluation {
                state: PolicyState::Idle,
                skew: 0.0,
                live_skew: 0.0,
                rotate: None,
                wake: None,
            },
            wake: None,
            metrics,
            no_backend: 0,
            window_ticks: ticks_in(WINDOW, tick),
            tick,
            failure_threshold: config.failure_threshold.max(1),
            ejection_backoff: config.ejection_backoff,
        }
    }

    /// Applies new tuning (the tick length stays: the windows are made of it).
    pub(crate) fn reconfigure(&mut self, config: &ConnectionConfig) {
        self.policy.set_config(config.rotation.clone());
        self.failure_threshold = config.failure_threshold.max(1);
        self.ejection_backoff = config.ejection_backoff;
    }

    /// A uniform number in [0, 1) from the controller's RNG.
    pub(crate) fn random_unit(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// Applies the watch's endpoint list. New backends get `health` (their health check, if
    /// one runs) and are ready at once; with health checks on they serve only once their check
    /// says so. Connections on removed backends are rotated.
    pub(crate) fn update(
        &mut self,
        endpoints: &[Endpoint],
        checking: bool,
        mut health: impl FnMut(EndpointId, &Endpoint) -> Option<crate::upstream::AbortOnDrop>,
    ) -> (Vec<EndpointId>, Vec<Rotation>) {
        let ticks = self.window_ticks;
        let mut added = Vec::new();
        let removed = self.backends.update(endpoints, |id, ep| {
            added.push(id);
            let mut b = Backend::new(ticks);
            b.health = health(id, ep);
            b
        });
        for id in &added {
            self.backends.set_ready(*id, true);
            self.backends.set_serving(*id, !checking);
        }
        let mut rotations = Vec::new();
        for entry in removed {
            rotations.extend(self.rotate_backend(entry.id(), RotationReason::BackendRemoved));
        }
        (added, rotations)
    }

    /// The active health check of `id` reports `serving`; a backend turning NOT_SERVING has
    /// its connections rotated.
    pub(crate) fn set_serving(&mut self, id: EndpointId, serving: bool) -> Vec<Rotation> {
        let Some(entry) = self.backends.get(id) else {
            return Vec::new();
        };
        let (was, addr) = (entry.serving(), entry.endpoint().addr);
        self.backends.set_serving(id, serving);
        if was && !serving {
            tracing::info!(%addr, "backend not serving, rotating its connections");
            return self.rotate_backend(id, RotationReason::NotServing);
        }
        Vec::new()
    }

    /// Health checking was switched on or off: every backend serves until its (new) check
    /// reports, or for good.
    pub(crate) fn reset_serving(&mut self) {
        let ids: Vec<EndpointId> = self.backends.iter().map(|e| e.id()).collect();
        for id in ids {
            self.backends.set_serving(id, true);
        }
    }

    fn rotate_backend(&mut self, id: EndpointId, reason: RotationReason) -> Vec<Rotation> {
        let mut out = Vec::new();
        for conn in self.conns.values_mut().filter(|c| c.backend == id) {
            if let Some(r) = start(conn, reason, &self.metrics) {
                out.push(r);
            }
        }
        out
    }

    /// The server asks `conn` to wind down (max age, drain). True when this is its first
    /// rotation (the caller then tells its relay).
    pub(crate) fn rotate_for(&mut self, conn: ConnId, reason: RotationReason) -> bool {
        let Some(c) = self.conns.get_mut(&conn) else {
            return false;
        };
        let first = c.rotation.is_none();
        start(c, reason, &self.metrics);
        first
    }

    /// Chooses the backend of a new client connection, skipping `tried` (connects that failed
    /// for it already), and registers the connection there. Ready, serving, not ejected
    /// backends first; with `fail_open`, any listed backend not tried yet. The reconnect of a
    /// client rotated for skew goes to the least-loaded backend; other connections by power of
    /// two choices over the backends' load (requests per second of their connections, young
    /// ones at an estimate), so concurrent placements do not herd. `None`: nothing to try.
    pub(crate) fn place(
        &mut self,
        now: Instant,
        tried: &[EndpointId],
        fail_open: bool,
    ) -> Option<Placement> {
        while self
            .expected
            .front()
            .is_some_and(|(until, _)| *until <= now)
        {
            self.expected.pop_front();
        }
        for e in self.backends.iter_mut() {
            e.ejection.expire(now);
        }
        let mut candidates: Vec<EndpointId> = self
            .backends
            .iter()
            .filter(|e| e.usable() && !e.ejection.is_ejected() && !tried.contains(&e.id()))
            .map(|e| e.id())
            .collect();
        if candidates.is_empty() && fail_open {
            // Ejected last: a backend that refused connects a moment ago is the worst bet.
            let mut rest: Vec<(bool, EndpointId)> = self
                .backends
                .iter()
                .filter(|e| !tried.contains(&e.id()))
                .map(|e| (e.ejection.is_ejected(), e.id()))
                .collect();
            rest.sort();
            if let Some(&(ejected, _)) = rest.first() {
                candidates = rest
                    .iter()
                    .filter(|(e, _)| *e == ejected)
                    .map(|(_, id)| *id)
                    .collect();
            }
        }
        if candidates.is_empty() {
            return None;
        }
        let loads = self.loads(now);
        let load = |id: EndpointId| {
            loads
                .iter()
                .find(|(b, ..)| *b == id)
                .map_or((0.0, 0), |(_, l, n)| (*l, *n))
        };
        let cheaper = |a: EndpointId, b: EndpointId| {
            let ((la, na), (lb, nb)) = (load(a), load(b));
            la < lb || (la == lb && na < nb)
        };
        let (backend, provisional) = if let Some((_, rate)) = self.expected.pop_front() {
            let best = candidates
                .iter()
                .copied()
                .reduce(|a, b| if cheaper(b, a) { b } else { a })?;
            (best, Some(rate))
        } else {
            // A backend without a connection (a new pod) is the best place there is: the two
            // choices are made among those first, so the connections of a scale-up's clients
            // that connect late reach every new pod instead of leaving one empty by chance.
            let empty: Vec<EndpointId> = candidates
                .iter()
                .copied()
                .filter(|b| load(*b).1 == 0)
                .collect();
            if !empty.is_empty() {
                candidates = empty;
            }
            if candidates.len() == 1 {
                (candidates[0], None)
            } else {
                let i = self.rng.random_range(0..candidates.len());
                let mut j = self.rng.random_range(0..candidates.len() - 1);
                if j >= i {
                    j += 1;
                }
                let (a, b) = (candidates[i], candidates[j]);
                (if cheaper(b, a) { b } else { a }, None)
            }
        };
        let addr = self.backends.get(backend)?.endpoint().addr;
        let conn = ConnId(self.next_conn);
        self.next_conn += 1;
        self.conns.insert(
            conn,
            Conn {
                backend,
                relay: None,
                placed_at: now,
                seen: 0,
                recent: Window::new(RATE_TICKS),
                provisional,
                rotation: None,
            },
        );
        Some(Placement {
            conn,
            backend,
            addr,
        })
    }

    /// The placed connection's backend connect succeeded: `relay` carries it from now on.
    /// Returns the reason of a rotation decided while it was connecting (its backend left, or
    /// the server drains): the caller tells the relay at once.
    pub(crate) fn connected(
        &mut self,
        conn: ConnId,
        relay: Arc<dyn Relayed>,
    ) -> Option<RotationReason> {
        let c = self.conns.get_mut(&conn)?;
        c.relay = Some(relay);
        let (backend, rotation) = (c.backend, c.rotation);
        if let Some(e) = self.backends.get_mut(backend) {
            e.ejection.record_success(true);
        }
        rotation
    }

    /// The placed connection's backend connect failed: the connection is forgotten and the
    /// backend's passive health counts the failure.
    pub(crate) fn connect_failed(&mut self, conn: ConnId, now: Instant) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        let (threshold, backoff) = (self.failure_threshold, self.ejection_backoff);
        if let Some(e) = self.backends.get_mut(c.backend) {
            e.value.connect_failures += 1;
            let (endpoint, ejection, _) = e.split_mut();
            if let Some(time) = ejection.record_failure(now, threshold, backoff, false, true) {
                tracing::info!(addr = %endpoint.addr, name = %endpoint.name, ejection_ms = time.as_millis(), "backend ejected after failed connects");
            }
        }
    }

    /// No backend could be connected for a client connection.
    pub(crate) fn gave_up(&mut self) {
        self.no_backend += 1;
    }

    /// The connection ended: its last requests stay in its backend's window.
    pub(crate) fn closed(&mut self, conn: ConnId) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        let delta = c
            .relay
            .as_ref()
            .map_or(0, |r| r.requests().saturating_sub(c.seen));
        if let Some(e) = self.backends.get_mut(c.backend) {
            e.value.pending += delta;
            e.value.total_requests += delta;
        }
    }

    /// One tick: takes every relay's new requests into the windows, then [`Self::evaluate`].
    pub(crate) fn tick(&mut self, now: Instant) -> Vec<Rotation> {
        self.sample();
        self.evaluate(now)
    }

    /// When to evaluate again even if no tick comes first: the hold ends, or a budget slot
    /// frees.
    pub(crate) fn wake(&self) -> Option<Instant> {
        self.wake
    }

    /// Takes every relay's new requests into the windows (one slot per tick).
    fn sample(&mut self) {
        let mut per_backend: BTreeMap<EndpointId, u64> = BTreeMap::new();
        for c in self.conns.values_mut() {
            let count = c.relay.as_ref().map_or(0, |r| r.requests());
            let delta = count.saturating_sub(c.seen);
            c.seen = count;
            c.recent.push(delta);
            *per_backend.entry(c.backend).or_default() += delta;
        }
        for e in self.backends.iter_mut() {
            let delta = per_backend.get(&e.id()).copied().unwrap_or(0);
            let b = &mut e.value;
            b.window.push(delta + std::mem::take(&mut b.pending));
            b.total_requests += delta;
        }
    }

    /// Evaluates the policy and returns the rotations it decided: the policy is asked again
    /// after each, with that connection now in transit, so the whole plan starts at once as
    /// far as the budget reaches. Also called between ticks (endpoint or health changes, the
    /// hold's end): the windows then stay as the last tick left them.
    pub(crate) fn evaluate(&mut self, now: Instant) -> Vec<Rotation> {
        let backends: Vec<BackendLoad> = self
            .backends
            .iter()
            .map(|e| BackendLoad {
                id: e.id(),
                usable: e.usable() && !e.ejection.is_ejected(),
                window_requests: e.value.window.sum(),
            })
            .collect();
        let mut out = Vec::new();
        // Each pass either starts a rotation (one connection fewer to choose from) or ends.
        for _ in 0..=self.conns.len() {
            let conns = self.conn_loads(now);
            let eval = self.policy.evaluate(now, &backends, &conns, &mut self.rng);
            let rotation = eval.rotate.and_then(|(id, after)| {
                let rate = conns.iter().find(|c| c.id == id).map_or(0.0, |c| c.rate);
                let r = start(
                    self.conns.get_mut(&id)?,
                    RotationReason::Skew,
                    &self.metrics,
                )?;
                tracing::info!(
                    skew = eval.skew,
                    live_skew = eval.live_skew,
                    after,
                    rate,
                    "rotating a connection for skew"
                );
                self.expected.push_back((now + EXPECT_FOR, rate));
                Some(r)
            });
            self.wake = eval.wake;
            // What status shows: the first pass's state when nothing more was due.
            if rotation.is_some() || out.is_empty() {
                self.last = eval;
            }
            match rotation {
                Some(r) => out.push(r),
                None => break,
            }
        }
        out
    }

    /// The policy's view of every open connection.
    fn conn_loads(&self, now: Instant) -> Vec<ConnLoad> {
        let mean = self.mean_rate(now);
        self.conns
            .iter()
            .map(|(id, c)| ConnLoad {
                id: *id,
                backend: c.backend,
                rate: self.estimate(c, now, mean),
                age: now.saturating_duration_since(c.placed_at),
                unrotatable: c.relay.as_ref().is_some_and(|r| r.unrotatable()),
                // Still connecting counts as not movable.
                rotating: c.rotation.is_some() || c.relay.is_none(),
            })
            .collect()
    }

    /// Requests per second over the connection's recent ticks (its life, while shorter).
    fn measured_rate(&self, c: &Conn, now: Instant) -> f64 {
        let covered = self.tick.mul_f64(c.recent.filled() as f64);
        let age = now.saturating_duration_since(c.placed_at);
        let span = covered.min(age).max(self.tick);
        c.recent.sum() as f64 / span.as_secs_f64()
    }

    /// A connection's load: its measured rate, or while it is young the larger of that and its
    /// estimate.
    fn estimate(&self, c: &Conn, now: Instant, mean: f64) -> f64 {
        let rate = self.measured_rate(c, now);
        if now.saturating_duration_since(c.placed_at) < SETTLE {
            rate.max(c.provisional.unwrap_or(mean))
        } else {
            rate
        }
    }

    /// What a connection without a rate of its own counts as: the mean measured rate of the
    /// settled connections; while none is settled (every connection is young: the Service's
    /// clients are just connecting), the largest young one's, so every young connection counts
    /// alike and placement goes by connection counts rather than by which backend's first
    /// connections happened to send first (their partial first ticks). 0 without any rate.
    fn mean_rate(&self, now: Instant) -> f64 {
        let (settled, young): (Vec<&Conn>, Vec<&Conn>) = self
            .conns
            .values()
            .partition(|c| now.saturating_duration_since(c.placed_at) >= SETTLE);
        if settled.is_empty() {
            young
                .iter()
                .map(|c| self.measured_rate(c, now))
                .fold(0.0, f64::max)
        } else {
            settled
                .iter()
                .map(|c| self.measured_rate(c, now))
                .sum::<f64>()
                / settled.len() as f64
        }
    }

    /// Per backend: (id, load, connections) of the connections that stay on it.
    fn loads(&self, now: Instant) -> Vec<(EndpointId, f64, usize)> {
        let mean = self.mean_rate(now);
        self.backends
            .iter()
            .map(|e| {
                let (load, n) = self
                    .conns
                    .values()
                    .filter(|c| c.backend == e.id() && c.rotation.is_none())
                    .fold((0.0, 0), |(l, n), c| {
                        (l + self.estimate(c, now, mean), n + 1)
                    });
                (e.id(), load, n)
            })
            .collect()
    }

    /// The Service's figures for metrics and `skewless status`.
    pub(crate) fn stats(&self, now: Instant) -> ConnectionStats {
        let total_window: u64 = self.backends.iter().map(|e| e.value.window.sum()).sum();
        let loads = self.loads(now);
        let backends: Vec<BackendStats> = self
            .backends
            .iter()
            .map(|e| {
                let window = e.value.window.sum();
                let connections = self.conns.values().filter(|c| c.backend == e.id()).count();
                BackendStats {
                    addr: e.endpoint().addr,
                    name: e.endpoint().name.clone(),
                    state: if !e.serving() {
                        EndpointState::NotServing
                    } else if e.ejection.is_ejected() {
                        EndpointState::Ejected
                    } else {
                        EndpointState::Active
                    },
                    connections,
                    requests: e.value.total_requests,
                    share: if total_window == 0 {
                        0.0
                    } else {
                        window as f64 / total_window as f64
                    },
                    rate: loads
                        .iter()
                        .find(|(id, ..)| *id == e.id())
                        .map_or(0.0, |(_, l, _)| *l),
                    connect_failures: e.value.connect_failures,
                }
            })
            .collect();
        ConnectionStats {
            state: self.last.state,
            skew: self.last.skew,
            live_skew: self.last.live_skew,
            ready_backends: self
                .backends
                .iter()
                .filter(|e| e.usable() && !e.ejection.is_ejected())
                .count(),
            backends_receiving: backends.iter().filter(|b| b.share > 0.0).count(),
            connections: self.conns.len(),
            unrotatable_connections: self
                .conns
                .values()
                .filter(|c| c.relay.as_ref().is_some_and(|r| r.unrotatable()))
                .count(),
            rotations: RotationCounts::from_metrics(&self.metrics.snapshot().rotations),
            rotations_last_minute: self.policy.rotations_last_minute(now),
            as_even_as_possible: self.last.state == PolicyState::AsEvenAsPossible,
            no_backend: self.no_backend,
            backends,
        }
    }
}

/// Starts `conn`'s rotation unless one is under way (and it has a relay to tell); counts the
/// controller's own reasons (the server counts max age and drain when its `Stop` resolves).
fn start(conn: &mut Conn, reason: RotationReason, metrics: &ServiceMetrics) -> Option<Rotation> {
    if conn.rotation.is_some() {
        return None;
    }
    conn.rotation = Some(reason);
    if !matches!(reason, RotationReason::MaxAge | RotationReason::Drain) {
        metrics.rotated(reason);
    }
    // A connection still connecting is told when its relay starts (see `mod.rs`).
    conn.relay.clone().map(|r| (r, reason))
}

fn ticks_in(window: Duration, tick: Duration) -> usize {
    (window.as_secs_f64() / tick.as_secs_f64()).ceil().max(1.0) as usize
}

#[cfg(test)]
pub(super) mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use rand::SeedableRng as _;
    use rand::rngs::SmallRng;

    use super::*;
    use crate::connection::policy::RotationConfig;

    /// A relay as the controller sees it: requests are added by the test, rotations recorded
    /// with the (virtual) instant they were started.
    #[derive(Default)]
    pub(in crate::connection) struct FakeRelay {
        pub(in crate::connection) requests: AtomicU64,
        unrotatable: AtomicBool,
        rotated: Mutex<Vec<RotationReason>>,
        pub(in crate::connection) rotated_at: Mutex<Vec<Instant>>,
    }

    impl Relayed for FakeRelay {
        fn requests(&self) -> u64 {
            self.requests.load(Ordering::Relaxed)
        }
        fn unrotatable(&self) -> bool {
            self.unrotatable.load(Ordering::Relaxed)
        }
        fn rotate(&self, reason: RotationReason) {
            self.rotated.lock().unwrap().push(reason);
            self.rotated_at.lock().unwrap().push(Instant::now());
        }
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    pub(in crate::connection) fn eps(n: u16) -> Vec<Endpoint> {
        (0..n)
            .map(|i| Endpoint::new(([10, 0, 0, 1], 9000 + i).into(), format!("pod-{i}")))
            .collect()
    }

    fn controller(rotation: RotationConfig, backends: u16) -> Controller {
        let config = ConnectionConfig {
            rotation,
            ..ConnectionConfig::default()
        };
        let mut c = Controller::new(
            &config,
            Box::new(SmallRng::seed_from_u64(11)),
            Arc::new(ServiceMetrics::default()),
        );
        c.update(&eps(backends), false, |_, _| None);
        c
    }

    /// A connected client connection with a fake relay.
    fn open(c: &mut Controller, now: Instant) -> (Placement, Arc<FakeRelay>) {
        let p = c.place(now, &[], false).expect("a backend");
        let relay = Arc::new(FakeRelay::default());
        assert_eq!(c.connected(p.conn, relay.clone()), None);
        (p, relay)
    }

    fn backend_of(c: &Controller, id: EndpointId) -> usize {
        c.backends
            .iter()
            .position(|e| e.id() == id)
            .expect("listed")
    }

    #[test]
    fn concurrent_placements_spread_instead_of_herding() {
        let mut c = controller(RotationConfig::default(), 4);
        let now = Instant::now();
        // Twenty connects under way at once (none connected yet, none has a rate).
        let mut per = [0usize; 4];
        for _ in 0..20 {
            let p = c.place(now, &[], false).expect("a backend");
            per[backend_of(&c, p.backend)] += 1;
        }
        assert!(
            per.iter().all(|n| (3..=7).contains(n)),
            "power of two choices over connection counts spreads them: {per:?}"
        );
    }

    /// A connected client connection placed on the backend at `index`.
    fn open_on(c: &mut Controller, index: usize, now: Instant) -> (Placement, Arc<FakeRelay>) {
        let others: Vec<EndpointId> = c
            .backends
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != index)
            .map(|(_, e)| e.id())
            .collect();
        let p = c.place(now, &others, false).expect("that backend");
        let relay = Arc::new(FakeRelay::default());
        assert_eq!(c.connected(p.conn, relay.clone()), None);
        (p, relay)
    }

    #[test]
    fn a_burst_of_connects_does_not_herd_onto_the_idle_backend() {
        let mut c = controller(RotationConfig::default(), 4);
        let t0 = Instant::now();
        let busy: Vec<_> = (1..4).map(|i| open_on(&mut c, i, t0)).collect();
        let mut now = t0;
        for _ in 0..5 {
            now += secs(1);
            for (_, r) in &busy {
                r.requests.fetch_add(100, Ordering::Relaxed);
            }
            c.tick(now);
        }
        // Forty connects under way at once: each placed one counts at the mean rate (100/s)
        // on its backend until it has a rate of its own, so the idle backend fills up to its
        // share instead of taking the whole burst.
        let idle = c.backends.iter().next().expect("backend 0").id();
        let to_idle = (0..40)
            .filter(|_| c.place(now, &[], false).expect("a backend").backend == idle)
            .count();
        assert!(
            (6..=14).contains(&to_idle),
            "the idle backend takes about its share of the burst (10), got {to_idle} of 40"
        );
    }

    #[test]
    fn placements_before_any_connection_settles_go_by_connection_counts() {
        let mut c = controller(RotationConfig::default(), 2);
        let t0 = Instant::now();
        // The first ten connect at once and spread 5-5; by the first tick those on backend 0
        // happened to send more (their first, partial tick).
        let first: Vec<_> = (0..10).map(|_| open(&mut c, t0)).collect();
        let on_0 = c.backends.iter().next().expect("backend 0").id();
        for (p, r) in &first {
            let sent = if p.backend == on_0 { 30 } else { 20 };
            r.requests.fetch_add(sent, Ordering::Relaxed);
        }
        c.tick(t0 + secs(1));
        // The other ten connect before any connection is 2 s old: each counts like the young
        // ones already there, so they spread instead of all going to backend 1 (seen in the
        // real-client scale-up test: 15-5 on 2 pods).
        let later = t0 + Duration::from_millis(1100);
        let to_0 = (0..10)
            .filter(|_| open(&mut c, later).0.backend == on_0)
            .count();
        assert!(
            (4..=6).contains(&to_0),
            "the second ten spread over both backends, got {to_0} of 10 on backend 0"
        );
    }

    #[test]
    fn a_scale_up_burst_reaches_every_new_backend_in_one_wave() {
        let mut c = controller(
            RotationConfig {
                hold_time: secs(5),
                max_rotations_per_minute: 120,
                ..RotationConfig::default()
            },
            2,
        );
        let t0 = Instant::now();
        let mut clients = clients_on(&mut c, 20, 50, t0);
        simulate(&mut c, &mut clients, t0, 30);
        c.update(&eps(10), false, |_, _| None);
        // Every second: the rotated clients reconnect at once (as grpcio does on GOAWAY).
        let mut waves = Vec::new();
        for s in 1..=20 {
            let rotated = simulate(&mut c, &mut clients, t0 + secs(30 + s - 1), 1);
            if rotated > 0 {
                waves.push((s, rotated));
            }
        }
        let stats = c.stats(t0 + secs(50));
        assert_eq!(
            waves.len(),
            1,
            "the hold's end rotates the whole plan at once: {waves:?}"
        );
        assert!(
            stats.backends.iter().all(|b| b.connections >= 1),
            "one wave of reconnects reaches every pod: {stats:?}"
        );
        let most = stats.backends.iter().map(|b| b.connections).max();
        assert!(most <= Some(3), "fair is 2, the threshold 1.5: {stats:?}");
    }

    #[test]
    fn new_connections_fill_the_backends_without_one_first() {
        let mut c = controller(RotationConfig::default(), 2);
        let t0 = Instant::now();
        let old: Vec<_> = (0..20).map(|_| open(&mut c, t0)).collect();
        let mut now = t0;
        for _ in 0..5 {
            now += secs(1);
            for (_, r) in &old {
                r.requests.fetch_add(50, Ordering::Relaxed);
            }
            c.tick(now);
        }
        // Scaled to 10; eight clients that started late connect now (not rotated ones).
        c.update(&eps(10), false, |_, _| None);
        for _ in 0..8 {
            open(&mut c, now);
        }
        let stats = c.stats(now);
        assert!(
            stats.backends.iter().all(|b| b.connections >= 1),
            "each of the eight goes to a pod that has none: {stats:?}"
        );
    }

    #[test]
    fn placement_weighs_request_rates_not_connection_counts() {
        let mut c = controller(RotationConfig::default(), 2);
        let t0 = Instant::now();
        let (hot, hot_relay) = open_on(&mut c, 0, t0);
        let light: Vec<_> = (0..3).map(|_| open_on(&mut c, 1, t0)).collect();
        let mut now = t0;
        for _ in 0..5 {
            now += secs(1);
            hot_relay.requests.fetch_add(1000, Ordering::Relaxed);
            for (_, r) in &light {
                r.requests.fetch_add(10, Ordering::Relaxed);
            }
            c.tick(now);
        }
        // Backend 1 carries 30 requests/s over three connections, backend 0 1000 over one; a
        // new connection counts at the Service's mean (257/s) until it has its own rate.
        for n in 0..3 {
            let (p, _) = open(&mut c, now);
            assert_ne!(
                p.backend, hot.backend,
                "connection {n} goes to the backend with less load, not fewer connections"
            );
        }
    }

    #[test]
    fn failed_connect_ejects_the_backend_and_the_next_try_goes_elsewhere() {
        let mut c = controller(RotationConfig::default(), 3);
        let t0 = Instant::now();
        let p = c.place(t0, &[], false).expect("a backend");
        c.connect_failed(p.conn, t0);
        let stats = c.stats(t0);
        assert_eq!(
            stats.backends[backend_of(&c, p.backend)].state,
            EndpointState::Ejected
        );
        assert_eq!(stats.connections, 0, "the failed placement is forgotten");
        for _ in 0..20 {
            let q = c.place(t0, &[], false).expect("another backend");
            assert_ne!(
                q.backend, p.backend,
                "an ejected backend gets no connection"
            );
            c.closed(q.conn);
        }
        // After the first backoff (1 s) it is tried again.
        let mut seen = false;
        for _ in 0..40 {
            let q = c.place(t0 + secs(1), &[], false).expect("a backend");
            seen |= q.backend == p.backend;
            c.closed(q.conn);
        }
        assert!(seen, "an ejection ends");
    }

    #[test]
    fn with_every_backend_tried_there_is_nothing_to_place() {
        let mut c = controller(RotationConfig::default(), 2);
        let t0 = Instant::now();
        let ids: Vec<EndpointId> = c.backends.iter().map(|e| e.id()).collect();
        assert_eq!(c.place(t0, &ids, true), None);
        let only = c.place(t0, &ids[..1], false).expect("the other one");
        assert_eq!(only.backend, ids[1]);
    }

    #[test]
    fn not_serving_backends_take_connections_only_when_failing_open() {
        let mut c = controller(RotationConfig::default(), 2);
        let t0 = Instant::now();
        let ids: Vec<EndpointId> = c.backends.iter().map(|e| e.id()).collect();
        for id in &ids {
            c.set_serving(*id, false);
        }
        assert_eq!(c.place(t0, &[], false), None, "wait for a serving backend");
        assert!(c.place(t0, &[], true).is_some(), "then fail open");
    }

    #[test]
    fn removed_and_not_serving_backends_have_their_connections_rotated_once() {
        let mut c = controller(RotationConfig::default(), 3);
        let t0 = Instant::now();
        let conns: Vec<(Placement, Arc<FakeRelay>)> = (0..9).map(|_| open(&mut c, t0)).collect();
        let first = c.backends.iter().next().expect("a backend").id();
        let listed = eps(3);
        let (_, rotations) = c.update(&listed[1..], false, |_, _| None);
        rotate_all_for_test(rotations);
        let second = c.backends.iter().next().expect("a backend").id();
        rotate_all_for_test(c.set_serving(second, false));
        rotate_all_for_test(c.set_serving(second, false));
        for (p, relay) in &conns {
            let rotated = relay.rotated.lock().unwrap().clone();
            if p.backend == first {
                assert_eq!(rotated, vec![RotationReason::BackendRemoved]);
            } else if p.backend == second {
                assert_eq!(
                    rotated,
                    vec![RotationReason::NotServing],
                    "once, not per report"
                );
            } else {
                assert!(rotated.is_empty());
            }
            assert!(
                !c.rotate_for(p.conn, RotationReason::Drain) || rotated.is_empty(),
                "a connection rotates once"
            );
        }
        let stats = c.stats(t0);
        assert_eq!(
            stats.rotations.backend_removed + stats.rotations.not_serving,
            conns
                .iter()
                .filter(|(p, _)| p.backend == first || p.backend == second)
                .count() as u64
        );
        // Drain and max age are the server's to count (its `Stop`), not the controller's.
        assert_eq!(stats.rotations.drain, 0);
    }

    fn rotate_all_for_test(rotations: Vec<Rotation>) {
        for (relay, reason) in rotations {
            relay.rotate(reason);
        }
    }

    #[test]
    fn a_connection_rotated_while_connecting_is_told_once_connected() {
        let mut c = controller(RotationConfig::default(), 2);
        let t0 = Instant::now();
        let p = c.place(t0, &[], false).expect("a backend");
        assert!(c.rotate_for(p.conn, RotationReason::Drain));
        let relay = Arc::new(FakeRelay::default());
        assert_eq!(c.connected(p.conn, relay), Some(RotationReason::Drain));
    }

    /// A client of the simulation: a rate and its current connection.
    struct Client {
        rate: u64,
        conn: (Placement, Arc<FakeRelay>),
        unrotatable: bool,
    }

    /// Runs `secs` one-second ticks: every client sends its rate; a rotated client's
    /// connection closes and the client reconnects at once (as grpcio does on GOAWAY).
    fn simulate(c: &mut Controller, clients: &mut [Client], t0: Instant, secs_total: u64) -> u64 {
        let mut rotations = 0;
        for s in 1..=secs_total {
            let now = t0 + secs(s);
            for cl in clients.iter_mut() {
                cl.conn.1.requests.fetch_add(cl.rate, Ordering::Relaxed);
            }
            for (relay, reason) in c.tick(now) {
                assert_eq!(reason, RotationReason::Skew);
                relay.rotate(reason);
            }
            for cl in clients.iter_mut() {
                if !cl.conn.1.rotated.lock().unwrap().is_empty() {
                    assert!(!cl.unrotatable, "an unrotatable client is never rotated");
                    rotations += 1;
                    c.closed(cl.conn.0.conn);
                    cl.conn = open(c, now);
                }
            }
        }
        rotations
    }

    fn clients_on(c: &mut Controller, n: usize, rate: u64, t0: Instant) -> Vec<Client> {
        (0..n)
            .map(|_| Client {
                rate,
                conn: open(c, t0),
                unrotatable: false,
            })
            .collect()
    }

    #[test]
    fn scale_up_rotates_old_backends_connections_onto_new_ones() {
        let mut c = controller(
            RotationConfig {
                hold_time: secs(5),
                max_rotations_per_minute: 60,
                ..RotationConfig::default()
            },
            2,
        );
        let t0 = Instant::now();
        let mut clients = clients_on(&mut c, 10, 100, t0);
        simulate(&mut c, &mut clients, t0, 60);
        assert_eq!(
            c.stats(t0 + secs(60)).rotations.skew,
            0,
            "2 of 2 even: no rotation"
        );
        // Scale from 2 to 10 pods (seed 001).
        c.update(&eps(10), false, |_, _| None);
        let rotated = simulate(&mut c, &mut clients, t0 + secs(60), 120);
        let stats = c.stats(t0 + secs(180));
        assert_eq!(
            stats.backends_receiving, 10,
            "every pod receives traffic: {stats:?}"
        );
        let most = stats.backends.iter().map(|b| b.connections).max();
        assert_eq!(most, Some(1), "one client per pod: {stats:?}");
        assert_eq!(rotated, 8, "exactly the eight moves needed");
        assert!(stats.live_skew < 1.5, "{stats:?}");
    }

    #[test]
    fn one_heavy_client_is_reported_as_even_as_connection_mode_can_be() {
        let mut c = controller(RotationConfig::default(), 5);
        let t0 = Instant::now();
        let mut clients = clients_on(&mut c, 1, 1000, t0);
        let rotated = simulate(&mut c, &mut clients, t0, 120);
        assert_eq!(rotated, 0);
        let stats = c.stats(t0 + secs(120));
        assert!(stats.as_even_as_possible, "{stats:?}");
        assert!((stats.skew - 5.0).abs() < 1e-9);
    }

    #[test]
    fn unrotatable_clients_count_as_load_and_are_reported() {
        let mut c = controller(
            RotationConfig {
                // 3-1 (skew 1.5) is still above it: both rotatable clients must move.
                skew_threshold: 1.2,
                hold_time: secs(1),
                max_rotations_per_minute: 60,
                ..RotationConfig::default()
            },
            2,
        );
        let t0 = Instant::now();
        // Two tonic clients on backend 0 and two rotatable ones, placed there too.
        let mut clients: Vec<Client> = (0..4)
            .map(|i| {
                let conn = open_on(&mut c, 0, t0);
                conn.1.unrotatable.store(i < 2, Ordering::Relaxed);
                Client {
                    rate: 100,
                    conn,
                    unrotatable: i < 2,
                }
            })
            .collect();
        let rotated = simulate(&mut c, &mut clients, t0, 120);
        let stats = c.stats(t0 + secs(120));
        assert_eq!(stats.unrotatable_connections, 2);
        assert_eq!(
            rotated, 2,
            "both rotatable clients move off the tonic-heavy backend"
        );
        assert_eq!(
            stats
                .backends
                .iter()
                .map(|b| b.connections)
                .collect::<Vec<_>>(),
            vec![2, 2]
        );
    }
}
