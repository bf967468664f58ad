//! Request mode on the project's frame codec (`skewless-frame`) with `httlib_hpack` for header
//! compression, in place of h2: EXPERIMENTAL, off by default, selected per balancer
//! ([`CodecBalancer`] in place of [`crate::Balancer`]).
//!
//! Each connection (a client's, or an upstream one) has one reader task that owns its read
//! buffer and HPACK decoder, and a shared write side (`out::Shared`) that any task appends
//! frames to under the connection's lock; the connection's writer task writes them. A request's HEADERS are
//! decoded once into a reused buffer (`fields::Fields`), an endpoint is picked, and the
//! request is encoded straight into the upstream connection's buffer; the upstream's reader
//! routes the response frames back the same way. No task per call, no shared stream store,
//! one write per connection per turn of the runtime.
//!
//! Invariants: no task holds two connections' locks at once (a reader takes its own, lets
//! it go, then the peer's); every length a peer declares is checked before it is used.
//!
//! Flow control holds what a receiver's windows do not take and gives a stream's window back
//! to its sender only once its bytes have been passed on (`frames::Held`, `RecvWindow`), so
//! what the balancer holds is bounded by the windows it gave. A client's PINGs, SETTINGS and
//! RST_STREAMs spend from the flood budgets of the h2 path, and its first frame must be its
//! SETTINGS, within the handshake timeout. A drain, the max age or the idle timeout winds a
//! client connection down with the h2 path's two-phase GOAWAY; its streams get the drain
//! grace.
//!
//! A request that finds no endpoint ready while some are connecting waits for one, up to the
//! ready timeout, with its body kept in its stream's window.
//!
//! A request's `grpc-timeout` is enforced here too: at its deadline the client gets
//! DEADLINE_EXCEEDED and the upstream stream is cancelled; a request sent after a wait or a
//! refusal carries the budget that is left.
//!
//! A request whose attempt fails before its response begins is retried on another endpoint
//! by the h2 path's rules (`request::retry`: provably not processed, or a retryable method;
//! within the attempts, the deadline and the retry budget), from a copy kept until its
//! response begins (bodies up to 64 KiB); one picked on a connection that takes no new stream
//! goes elsewhere at once.
//!
//! A response whose client makes no room for it for the stalled-reader timeout is reset
//! both ways.
//!
//! Every upstream connection has the h2 path's liveness monitor (`upstream::liveness`): PINGs
//! while requests are outstanding; unanswered, the connection is first suspect (its endpoint
//! takes no new request), then dead (closed, its calls answered UNAVAILABLE, the endpoint
//! ejected). An endpoint whose ejection is over is PINGed before it gets calls again.
//!
//! Active health checks watch each endpoint as connection mode does, over a connection of
//! their own (`upstream::health::watch_on_own_connection`).
//!
//! An endpoint's connections carry at most `max_streams_per_connection` requests each (or
//! its server's SETTINGS_MAX_CONCURRENT_STREAMS); when every one is full its connection task
//! opens more, up to `max_connections_per_endpoint`, and a request that finds no room waits
//! for it as for a ready endpoint.
//!
//! What it does not do yet (so it stays off by default): CONTINUATION on the way out.

mod client;
mod fields;
mod frames;
mod out;
mod upstream;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rand::{RngCore, SeedableRng as _};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::endpoints::{Endpoint, EndpointId, EndpointSet};
use crate::metrics::{EndpointMetrics, ServiceMetrics};
use crate::request::config::Config;
use crate::request::picker::{Outcome, Picker, Slot};
use crate::request::retry_budget::RetryBudget;
use crate::request::status::{BalancerCounters, Counters};
use crate::server::{NewConnection, Stop};
use crate::upstream::liveness::{LivenessConfig, Report};

type Rng = Box<dyn RngCore + Send>;

/// One Service port's request-mode balancer on one worker, on the frame codec.
pub struct CodecBalancer {
    pool: Arc<CodecPool>,
    discovery: AbortHandle,
}

impl std::fmt::Debug for CodecBalancer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CodecBalancer").finish_non_exhaustive()
    }
}

impl CodecBalancer {
    /// A balancer over the endpoints published on `endpoints`. Must be called inside a Tokio
    /// runtime.
    #[must_use]
    pub fn new(config: Config, endpoints: watch::Receiver<Vec<Endpoint>>) -> Self {
        let pool = Arc::new(CodecPool {
            state: Mutex::new(PoolState {
                picker: Picker::new(
                    config.picker.clone(),
                    Box::new(rand::rngs::SmallRng::from_os_rng()),
                ),
                endpoints: EndpointSet::new(),
                retry_budget: RetryBudget::new(config.retry_budget.clone(), Instant::now()),
            }),
            config: watch::Sender::new(Arc::new(config)),
            metrics: Arc::new(ServiceMetrics::default()),
            counters: Counters::default(),
            ready: watch::Sender::new(0),
        });
        let discovery = crate::endpoints::follow(&pool, endpoints, CodecPool::update);
        Self { pool, discovery }
    }

    /// The Service port's numbers on this balancer's worker.
    #[must_use]
    pub fn metrics(&self) -> crate::metrics::ServiceSnapshot {
        self.pool.metrics.snapshot()
    }

    /// Applies a new configuration: the picker's tuning and the retry budget at once,
    /// everything a request reads (retryable methods, attempts, timeouts) from the next
    /// request on, the connect settings from the next connect.
    pub fn reconfigure(&self, config: Config) {
        tracing::debug!(?config, "reconfigured");
        let health = config.health_service.clone();
        let mut state = self.pool.lock();
        state.picker.set_config(config.picker.clone());
        state
            .retry_budget
            .set_config(config.retry_budget.clone(), Instant::now());
        drop(state);
        let old = self.pool.config.send_replace(Arc::new(config));
        if old.health_service != health {
            self.pool.restart_health(health.as_ref());
        }
    }

    /// The configuration in effect.
    #[must_use]
    pub fn config(&self) -> Arc<Config> {
        self.pool.config()
    }

    /// Per-endpoint state, load and latency.
    #[must_use]
    pub fn stats(&self) -> Vec<crate::EndpointStats> {
        let state = self.pool.lock();
        let mut stats = state.picker.stats(&state.endpoints);
        for (s, entry) in stats.iter_mut().zip(&state.endpoints) {
            s.upstream_connections = u32::try_from(entry.value.ups.len()).unwrap_or(u32::MAX);
            s.latency_histogram = entry.value.metrics.latency.snapshot();
        }
        stats
    }

    /// Balancer-wide counters: retries, retries the budget refused, calls failed by an
    /// upstream or locally (no endpoint, deadline), ejections.
    #[must_use]
    pub fn counters(&self) -> BalancerCounters {
        BalancerCounters {
            ejections: self.pool.lock().picker.ejections(),
            ..self.pool.counters.snapshot()
        }
    }
}

impl Drop for CodecBalancer {
    fn drop(&mut self) {
        self.discovery.abort();
    }
}

impl NewConnection for CodecBalancer {
    type Config = Config;

    fn config(&self) -> watch::Receiver<Arc<Config>> {
        self.pool.config.subscribe()
    }

    fn random_unit(&self) -> f64 {
        self.pool.random_unit()
    }

    fn metrics(&self) -> Arc<ServiceMetrics> {
        self.pool.metrics.clone()
    }

    fn serve_connection(
        &self,
        stream: TcpStream,
        _peer: SocketAddr,
        stop: Stop<Config>,
    ) -> impl Future<Output = ()> + Send + 'static {
        client::serve(self.pool.clone(), stream, stop)
    }
}

pub(crate) struct CodecPool {
    config: watch::Sender<Arc<Config>>,
    state: Mutex<PoolState>,
    pub(crate) metrics: Arc<ServiceMetrics>,
    pub(crate) counters: Counters,
    /// Counts the upstream connections that came up: client connections with calls waiting
    /// for a ready endpoint follow it to try again.
    ready: watch::Sender<u64>,
}

struct PoolState {
    picker: Picker<Rng>,
    endpoints: EndpointSet<Member>,
    retry_budget: RetryBudget,
}

struct Member {
    slot: Slot,
    /// The endpoint's connections that are up: the one its connection task keeps, and the
    /// ones it opened when they were full.
    ups: Vec<upstream::UpConn>,
    /// Picks that found every connection full since its connection task last looked.
    demand: u32,
    /// Asks its connection task for more connections (every one is full).
    grow: Arc<tokio::sync::Notify>,
    /// Dropped with the member (the endpoint left the Service): its connections take no new
    /// request, finish the ones they carry, and close.
    _listed: watch::Sender<()>,
    /// Whether the current connection has carried a request yet (the first one is no
    /// latency sample: it pays for the connection's warm-up).
    warm: bool,
    task: AbortHandle,
    /// Asks its connection's liveness monitor for a PING (its ejection is over).
    probe: Arc<tokio::sync::Notify>,
    /// Its active health check (`grpc.health.v1` over a connection of its own), when one is
    /// configured, and the number of that check: a report of an older one is ignored.
    health: Option<(AbortHandle, u64)>,
    metrics: Arc<EndpointMetrics>,
}

impl Member {
    /// Whether it has a connection that is not suspect.
    fn ready(&self) -> bool {
        self.ups.iter().any(|u| !u.suspect)
    }

    /// Stops its tasks: the connection's and the health check's.
    fn abort(&self) {
        self.task.abort();
        if let Some((health, _)) = &self.health {
            health.abort();
        }
    }
}

impl AsRef<Slot> for Member {
    fn as_ref(&self) -> &Slot {
        &self.slot
    }
}

impl AsMut<Slot> for Member {
    fn as_mut(&mut self) -> &mut Slot {
        &mut self.slot
    }
}

/// What an upstream connection is opened with (`CodecPool::connect_settings`).
pub(crate) struct ConnectSettings {
    timeout: Duration,
    liveness: LivenessConfig,
    max_streams: u32,
    max_connections: usize,
}

/// Why no endpoint was picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoPick {
    /// Endpoints are there but none is ready (connecting): the request may wait.
    NotReady,
    /// No endpoint, or every one excluded: nowhere to send it.
    Nowhere,
}

/// A request's hold on its endpoint, from the pick to the end of its response.
#[derive(Debug)]
pub(crate) struct Lease {
    pub(crate) id: EndpointId,
    probe: bool,
    /// Whether its response headers are a latency sample.
    sample: bool,
    sent_at: Instant,
    metrics: Arc<EndpointMetrics>,
}

impl CodecPool {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn update(self: &Arc<Self>, endpoints: &[Endpoint]) {
        let now = Instant::now();
        let health = self.config.borrow().health_service.clone();
        let mut state = self.lock();
        let mut added = Vec::new();
        let removed = state.endpoints.update(endpoints, |id, ep| {
            added.push(id);
            let span = tracing::debug_span!("endpoint", addr = %ep.addr, name = %ep.name);
            let probe = Arc::new(tokio::sync::Notify::new());
            let grow = Arc::new(tokio::sync::Notify::new());
            let (listed, unlisted) = watch::channel(());
            let task = tokio::spawn(
                upstream::connection_task(
                    Arc::downgrade(self),
                    id,
                    ep.addr,
                    upstream::Asks {
                        probe: probe.clone(),
                        grow: grow.clone(),
                        unlisted,
                    },
                )
                .instrument(span),
            )
            .abort_handle();
            Member {
                slot: Slot::new(now),
                ups: Vec::new(),
                demand: 0,
                grow,
                _listed: listed,
                warm: false,
                task,
                probe,
                health: health
                    .as_ref()
                    .map(|service| self.start_health(id, ep.addr, service)),
                metrics: Arc::new(EndpointMetrics::default()),
            }
        });
        if health.is_some() {
            // A17: not known to be serving until its check says so.
            for id in added {
                state.endpoints.set_serving(id, false);
            }
        }
        drop(state);
        for entry in removed {
            // Its connections wind down as the member goes; its health check stops now.
            if let Some((health, _)) = &entry.value.health {
                health.abort();
            }
        }
    }

    /// Starts the health check of endpoint `id` on `addr`, watching `service`.
    fn start_health(
        self: &Arc<Self>,
        id: EndpointId,
        addr: SocketAddr,
        service: &str,
    ) -> (AbortHandle, u64) {
        static CHECKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let check = CHECKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pool = Arc::downgrade(self);
        let connect_timeout = {
            let pool = pool.clone();
            move || pool.upgrade().map(|p| p.config.borrow().connect_timeout)
        };
        let report = move |serving| {
            if let Some(p) = pool.upgrade() {
                p.set_serving(id, check, serving);
            }
        };
        let task = tokio::spawn(
            crate::upstream::health::watch_on_own_connection(
                connect_timeout,
                report,
                addr,
                service.to_owned(),
            )
            .instrument(tracing::debug_span!("health", %addr)),
        );
        (task.abort_handle(), check)
    }

    /// Health check `check` of endpoint `id` reports `serving`.
    fn set_serving(&self, id: EndpointId, check: u64, serving: bool) {
        let mut state = self.lock();
        let current = state
            .endpoints
            .get(id)
            .is_some_and(|e| e.value.health.as_ref().is_some_and(|(_, c)| *c == check));
        if !current {
            return;
        }
        state.endpoints.set_serving(id, serving);
        drop(state);
        if serving {
            self.ready.send_modify(|n| *n += 1);
        }
    }

    /// The health service changed to `service`: every endpoint's check stops, and the new
    /// one starts with every endpoint not serving until it says so (none: every endpoint
    /// serves).
    fn restart_health(self: &Arc<Self>, service: Option<&String>) {
        let mut state = self.lock();
        let members: Vec<(EndpointId, SocketAddr)> = state
            .endpoints
            .iter()
            .map(|e| (e.id(), e.endpoint().addr))
            .collect();
        for (id, addr) in members {
            let health = service.map(|service| self.start_health(id, addr, service));
            if let Some(entry) = state.endpoints.get_mut(id)
                && let Some((old, _)) = std::mem::replace(&mut entry.value.health, health)
            {
                old.abort();
            }
            state.endpoints.set_serving(id, service.is_none());
        }
        drop(state);
        self.ready.send_modify(|n| *n += 1);
    }

    /// The settings of the next upstream connection: its connect timeout, its liveness
    /// checks, the most streams it carries, and the most connections an endpoint has.
    fn connect_settings(&self) -> ConnectSettings {
        let config = self.config.borrow();
        ConnectSettings {
            timeout: config.connect_timeout,
            liveness: config.liveness.clone(),
            max_streams: config.max_streams_per_connection.max(1),
            max_connections: config.max_connections_per_endpoint.max(1),
        }
    }

    /// When a client connection's next idle check is due after `now`: an eighth of the idle
    /// timeout in effect (none: no idle timeout), as on the h2 path.
    fn idle_check_after(&self, now: Instant) -> Option<Instant> {
        self.config.borrow().idle_timeout.map(|t| now + t / 8)
    }

    fn stalled_reader_timeout(&self) -> Option<Duration> {
        self.config.borrow().stalled_reader_timeout
    }

    fn idle_timeout(&self) -> Option<Duration> {
        self.config.borrow().idle_timeout
    }

    /// How long a client connection's streams may run on once it winds down.
    fn drain_grace(&self) -> Duration {
        self.config.borrow().drain_grace
    }

    /// A connection of endpoint `id` is up.
    fn add_upstream(&self, id: EndpointId, conn: upstream::UpConn) {
        let now = Instant::now();
        let mut state = self.lock();
        let PoolState {
            picker, endpoints, ..
        } = &mut *state;
        if let Some(entry) = endpoints.get_mut(id) {
            entry.value.ups.push(conn);
            entry.value.warm = false;
            endpoints.set_ready(id, true);
            picker.proven(endpoints, id, now);
        }
        drop(state);
        self.ready.send_modify(|n| *n += 1);
    }

    /// Connection `conn` of endpoint `id` takes no new request (it is closing, or retired).
    fn remove_upstream(&self, id: EndpointId, conn: &Arc<upstream::UpShared>) {
        let mut state = self.lock();
        if let Some(entry) = state.endpoints.get_mut(id) {
            entry.value.ups.retain(|u| !Arc::ptr_eq(&u.shared, conn));
            let ready = entry.value.ready();
            state.endpoints.set_ready(id, ready);
        }
    }

    /// What the liveness monitor of `conn`, a connection of endpoint `id`, reports: a suspect
    /// connection takes no new request until its PING is answered (nor its endpoint, when it
    /// has no other); an answer proves an endpoint whose ejection is over.
    fn liveness_report(&self, id: EndpointId, conn: &Arc<upstream::UpShared>, report: Report) {
        let now = Instant::now();
        let mut state = self.lock();
        let PoolState {
            picker, endpoints, ..
        } = &mut *state;
        let Some(member) = endpoints.get_mut(id).map(|e| &mut e.value) else {
            return;
        };
        let Some(up) = member.ups.iter_mut().find(|u| Arc::ptr_eq(&u.shared, conn)) else {
            return;
        };
        match report {
            Report::Suspect(suspect) => {
                up.suspect = suspect;
                let ready = member.ready();
                endpoints.set_ready(id, ready);
            }
            Report::Answered => picker.proven(endpoints, id, now),
        }
        drop(state);
        if report == Report::Suspect(false) {
            self.ready.send_modify(|n| *n += 1);
        }
    }

    /// A request on a connection that was full is over: requests waiting for room try again.
    pub(crate) fn room_freed(&self) {
        self.ready.send_modify(|n| *n += 1);
    }

    /// How many connections endpoint `id` wants for the requests it carries and the picks
    /// that found it full since the last look (which this look forgets), at what its
    /// connections take each (`ours`, or less where its server says so); at most `max`.
    fn connections_wanted(&self, id: EndpointId, ours: u32, max: usize) -> usize {
        let mut state = self.lock();
        let Some(member) = state.endpoints.get_mut(id).map(|e| &mut e.value) else {
            return 0;
        };
        let open: u32 = member.ups.iter().map(upstream::UpConn::streams).sum();
        let room = member
            .ups
            .iter()
            .map(upstream::UpConn::limit)
            .max()
            .unwrap_or(ours)
            .max(1);
        let wanted = (open + std::mem::take(&mut member.demand)).div_ceil(room);
        usize::try_from(wanted).unwrap_or(usize::MAX).min(max)
    }

    /// Endpoint `id`'s connection is dead (its PING went unanswered): the endpoint is
    /// ejected; its connection task closes the connection.
    fn connection_dead(&self, id: EndpointId) {
        let now = Instant::now();
        let mut state = self.lock();
        let PoolState {
            picker, endpoints, ..
        } = &mut *state;
        picker.connection_dead(endpoints, id, now);
    }

    /// The configuration in effect.
    pub(crate) fn config(&self) -> Arc<Config> {
        self.config.borrow().clone()
    }

    /// A retry's token from the retry budget at `now`; `false` when it has none.
    pub(crate) fn withdraw_retry_token(&self, now: Instant) -> bool {
        self.lock().retry_budget.withdraw(now)
    }

    /// A number uniform in [0, 1) from the picker's RNG, for jitter.
    pub(crate) fn random_unit(&self) -> f64 {
        self.lock().picker.random_unit()
    }

    /// Follows the upstream connections that come up.
    pub(crate) fn readiness(&self) -> watch::Receiver<u64> {
        self.ready.subscribe()
    }

    /// How long a call waits for a ready endpoint.
    pub(crate) fn ready_timeout(&self) -> Duration {
        self.config.borrow().ready_timeout
    }

    /// Picks an endpoint for one request at `now`, none of `exclude` (those it was sent to
    /// before): its connection and the lease. `first`: the request's first pick, which
    /// deposits its share of the retry budget (whatever the pick's outcome).
    pub(crate) fn pick(
        &self,
        now: Instant,
        exclude: &[EndpointId],
        first: bool,
    ) -> Result<(Arc<upstream::UpShared>, Lease), NoPick> {
        let mut state = self.lock();
        let PoolState {
            picker,
            endpoints,
            retry_budget,
        } = &mut *state;
        if first {
            retry_budget.deposit(now);
        }
        // Endpoints whose every connection is full, with `exclude`: allocated only then.
        let mut full: Vec<EndpointId> = Vec::new();
        loop {
            let skip = if full.is_empty() { exclude } else { &full };
            let pick = picker.pick(endpoints, now, skip);
            if picker.has_unproven() {
                // Ejections that just ended: each endpoint must answer a PING before user
                // calls.
                for id in picker.take_unproven() {
                    if let Some(entry) = endpoints.get(id) {
                        entry.value.probe.notify_one();
                    }
                }
            }
            let Some(pick) = pick else {
                return Err(if endpoints.is_empty() || endpoints.all_excluded(exclude) {
                    NoPick::Nowhere
                } else {
                    // Connecting, or full: it waits for a connection or for room.
                    NoPick::NotReady
                });
            };
            let Some(member) = endpoints.get_mut(pick.id).map(|e| &mut e.value) else {
                return Err(NoPick::NotReady);
            };
            if let Some(up) = member.ups.iter().find(|u| u.takes_one()) {
                let up = up.shared.clone();
                let sample = std::mem::replace(&mut member.warm, true);
                return Ok((
                    up,
                    Lease {
                        id: pick.id,
                        probe: pick.probe,
                        sample,
                        sent_at: now,
                        metrics: member.metrics.clone(),
                    },
                ));
            }
            // Every connection full (or none up, though ready: both change together): its
            // connection task opens more if it may, and another endpoint is tried.
            if !member.ups.is_empty() {
                member.demand += 1;
                member.grow.notify_one();
            }
            picker.complete(endpoints, pick.id, pick.probe, Outcome::Cancelled, now);
            if full.is_empty() {
                full.extend_from_slice(exclude);
            }
            full.push(pick.id);
        }
    }

    /// The response headers of `lease`'s request arrived at `now`.
    pub(crate) fn headers_received(&self, lease: &Lease, now: Instant) {
        if !lease.sample {
            return;
        }
        let rtt = now.saturating_duration_since(lease.sent_at);
        let mut state = self.lock();
        let PoolState {
            picker, endpoints, ..
        } = &mut *state;
        picker.observe_latency(endpoints, lease.id, lease.probe, rtt, now);
    }

    /// `lease`'s request is over at `now`, with `outcome`.
    pub(crate) fn finish(&self, lease: Lease, outcome: Outcome, now: Instant) {
        lease
            .metrics
            .latency
            .record(now.saturating_duration_since(lease.sent_at));
        let mut state = self.lock();
        let PoolState {
            picker, endpoints, ..
        } = &mut *state;
        picker.complete(endpoints, lease.id, lease.probe, outcome, now);
    }
}

impl Drop for CodecPool {
    fn drop(&mut self) {
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for entry in &state.endpoints {
            entry.value.abort();
        }
    }
}

/// A hasher for stream ids (small integers chosen by the peer, bounded in number): one
/// multiplication, no SipHash.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub(crate) type StreamMap<V> =
    std::collections::HashMap<u32, V, std::hash::BuildHasherDefault<IdHasher>>;
