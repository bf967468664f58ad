//! Connection mode: every redirected client connection is relayed 1:1 to one backend (the
//! frame-level relay, [`crate::connection::relay`]), placed by load, and rotated with a graceful two-phase
//! GOAWAY when the Service's connections are pinned unevenly, so the client reconnects and is
//! placed again.
//!
//! One [`ConnectionBalancer`] per Service, shared by every data-plane worker (placement is per
//! connection, so a lock per accepted connection costs nothing per request, and one view of
//! the Service makes its skew and placement right whichever worker the kernel gave a
//! connection to). Its tasks run on the runtime it was made in (the agent's control plane):
//! following the endpoint set, the active health checks (one HTTP/2 connection per backend of
//! the balancer's own: a relayed connection belongs to its client), and a tick per second
//! that samples the relays' request counters into the windows and runs the
//! [`policy`](policy::RotationPolicy). Each worker relays its own connections.
//!
//! On accept: read the client's connection preface and first SETTINGS frame (nothing else is
//! spent on a client before: no placement, no backend connection, no relay buffers; the
//! handshake timeout closes a client that does not send them), then place it (the `controller`
//! module, so a connection counts for placement from then on) and connect to the backend; a
//! failed connect is retried on another backend before the client sees anything, and counts
//! against the backend (passive ejection). Then the relay carries the connection, the bytes
//! already read first, until it ends; the server's
//! [`Stop`] (max connection age, drain) and the controller (skew, backend removed or NOT_SERVING)
//! rotate it.

pub mod config;
mod controller;
pub mod policy;
pub mod relay;
pub mod status;
mod window;

#[doc(hidden)]
pub use status as stats;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use rand::SeedableRng as _;
use tokio::net::TcpStream;
use tokio::sync::{Notify, watch};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tracing::Instrument as _;

pub use config::ConnectionConfig;
pub use policy::{PolicyState, RotationConfig};
pub use status::{BackendStats, ConnectionStats, RotationCounts};

use crate::endpoints::Endpoint;
use crate::endpoints::EndpointId;
use crate::metrics::{ServiceMetrics, ServiceSnapshot};
use crate::server::{NewConnection, Stop};
use crate::upstream::AbortOnDrop;
use controller::{Controller, Placement, Rotation};
use policy::ConnId;
use relay::{RelayHandle, RelaySettings};

/// The connection-mode balancer of one Service (see the module docs). Cheap to clone: every
/// clone is the same balancer, so `Workers::serve(addr, || balancer.clone(), ..)` serves one
/// Service on every worker with one shared view.
#[derive(Clone)]
pub struct ConnectionBalancer {
    shared: Arc<Shared>,
}

struct Shared {
    config: watch::Sender<Arc<ConnectionConfig>>,
    metrics: Arc<ServiceMetrics>,
    state: Mutex<Controller>,
    /// Woken when a backend may have become usable or the policy's inputs changed (endpoint
    /// set, health, configuration). Shared with the tick task, which holds no strong reference
    /// to the rest (dropping the balancer aborts it).
    changed: Arc<Notify>,
    tasks: Mutex<Vec<AbortHandle>>,
}

impl std::fmt::Debug for ConnectionBalancer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionBalancer").finish_non_exhaustive()
    }
}

impl ConnectionBalancer {
    /// A balancer over the endpoints published on `endpoints`, with an OS-seeded RNG. Must be
    /// called inside a Tokio runtime: its tasks (endpoint set, health checks, policy ticks)
    /// run there.
    #[must_use]
    pub fn new(config: ConnectionConfig, endpoints: watch::Receiver<Vec<Endpoint>>) -> Self {
        Self::with_rng(config, endpoints, rand::rngs::SmallRng::from_os_rng())
    }

    /// Like [`ConnectionBalancer::new`] with the RNG supplied (placement, jitter), so tests are
    /// deterministic.
    #[must_use]
    pub fn with_rng(
        config: ConnectionConfig,
        endpoints: watch::Receiver<Vec<Endpoint>>,
        rng: impl rand::RngCore + Send + 'static,
    ) -> Self {
        let tick = config.tick;
        let metrics = Arc::new(ServiceMetrics::default());
        let shared = Arc::new(Shared {
            state: Mutex::new(Controller::new(&config, Box::new(rng), metrics.clone())),
            metrics,
            config: watch::Sender::new(Arc::new(config)),
            changed: Arc::new(Notify::new()),
            tasks: Mutex::new(Vec::new()),
        });
        let discovery = crate::endpoints::follow(&shared, endpoints, Shared::update);
        let ticks = tokio::spawn(
            tick_task(Arc::downgrade(&shared), shared.changed.clone(), tick)
                .instrument(tracing::debug_span!("policy")),
        );
        shared
            .lock_tasks()
            .extend([discovery, ticks.abort_handle()]);
        Self { shared }
    }

    /// Applies `config` live: the rotation policy from its next tick (a hold under way counts
    /// on unless the hold time changed), connect and health settings from the next connect or
    /// health change, the max connection age for open connections counted from the change
    /// (with jitter), the grace and PING timeout for rotations that start afterwards.
    pub fn reconfigure(&self, config: ConnectionConfig) {
        tracing::debug!(?config, "reconfigured");
        let health_changed = self.shared.config.borrow().health_service != config.health_service;
        self.shared.lock().reconfigure(&config);
        self.shared.config.send_replace(Arc::new(config));
        if health_changed {
            self.shared.restart_health();
        }
        self.shared.changed.notify_waiters();
    }

    /// The configuration in effect.
    #[must_use]
    pub fn config(&self) -> Arc<ConnectionConfig> {
        self.shared.config.borrow().clone()
    }

    /// The Service's figures (skew, rotations, per-backend connections and shares).
    #[must_use]
    pub fn stats(&self) -> ConnectionStats {
        self.shared.lock().stats(Instant::now())
    }

    /// The Service's metric cells (client connections and their lifetimes, rotations by
    /// reason). One balancer serves every worker: read it once per Service port, not once
    /// per worker.
    #[must_use]
    pub fn metrics(&self) -> ServiceSnapshot {
        self.shared.metrics.snapshot()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Controller> {
        // A panic while holding the lock leaves consistent-enough state; keep serving.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock_tasks(&self) -> MutexGuard<'_, Vec<AbortHandle>> {
        self.tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn health_service(&self) -> Option<String> {
        self.config.borrow().health_service.clone()
    }

    /// Applies the watch's endpoint list (health checks start for new backends, removed ones'
    /// connections rotate).
    fn update(self: &Arc<Self>, endpoints: &[Endpoint]) {
        let service = self.health_service();
        let (_, rotations) = self.lock().update(endpoints, service.is_some(), |id, ep| {
            service
                .clone()
                .map(|service| self.spawn_health(id, ep.addr, service))
        });
        rotate_all(rotations);
        self.changed.notify_waiters();
    }

    fn spawn_health(
        self: &Arc<Self>,
        id: EndpointId,
        addr: SocketAddr,
        service: String,
    ) -> AbortOnDrop {
        AbortOnDrop(tokio::spawn(
            health_task(Arc::downgrade(self), id, addr, service)
                .instrument(tracing::debug_span!("health", %addr)),
        ))
    }

    /// The health service changed: every backend's check stops and the new one starts (or
    /// none); until it reports, every backend serves.
    fn restart_health(self: &Arc<Self>) {
        let service = self.health_service();
        let mut state = self.lock();
        state.reset_serving();
        let backends: Vec<(EndpointId, SocketAddr)> = state
            .backends
            .iter()
            .map(|e| (e.id(), e.endpoint().addr))
            .collect();
        for (id, addr) in backends {
            let health = service
                .clone()
                .map(|service| self.spawn_health(id, addr, service));
            if let Some(e) = state.backends.get_mut(id) {
                // Dropping the old one aborts it before it can report again.
                e.value.health = health;
            }
        }
    }

    fn set_serving(&self, id: EndpointId, serving: bool) {
        let rotations = self.lock().set_serving(id, serving);
        rotate_all(rotations);
        if serving {
            self.changed.notify_waiters();
        }
    }

    /// Places a new client connection and connects to its backend, trying another backend
    /// after a failed connect; waits up to the ready timeout for a usable backend, then tries
    /// any listed one. `None` when every backend failed or there is none.
    async fn connect_backend(&self) -> Option<(Placement, TcpStream)> {
        let config = self.config.borrow().clone();
        let fail_open_at = Instant::now() + config.ready_timeout;
        let mut tried: Vec<EndpointId> = Vec::new();
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let placed = self.lock().place(now, &tried, now >= fail_open_at);
            let Some(placement) = placed else {
                if now >= fail_open_at || self.lock().backends.all_excluded(&tried) {
                    return None;
                }
                let _ = tokio::time::timeout_at(fail_open_at, notified).await;
                continue;
            };
            let connected =
                tokio::time::timeout(config.connect_timeout, TcpStream::connect(placement.addr))
                    .await;
            match connected {
                Ok(Ok(stream)) => {
                    // gRPC is latency bound: small messages must not wait for Nagle.
                    let _ = stream.set_nodelay(true);
                    return Some((placement, stream));
                }
                Ok(Err(error)) => {
                    tracing::debug!(addr = %placement.addr, %error, "backend connect failed, trying another");
                }
                Err(_) => {
                    tracing::debug!(addr = %placement.addr, "backend connect timed out, trying another");
                }
            }
            self.lock().connect_failed(placement.conn, Instant::now());
            tried.push(placement.backend);
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        for task in self.lock_tasks().iter() {
            task.abort();
        }
    }
}

fn rotate_all(rotations: Vec<Rotation>) {
    for (relay, reason) in rotations {
        relay.rotate(reason);
    }
}

impl NewConnection for ConnectionBalancer {
    type Config = ConnectionConfig;

    fn config(&self) -> watch::Receiver<Arc<ConnectionConfig>> {
        self.shared.config.subscribe()
    }

    fn random_unit(&self) -> f64 {
        self.shared.lock().random_unit()
    }

    fn metrics(&self) -> Arc<ServiceMetrics> {
        self.shared.metrics.clone()
    }

    fn serve_connection(
        &self,
        stream: TcpStream,
        _peer: SocketAddr,
        stop: Stop<ConnectionConfig>,
    ) -> impl Future<Output = ()> + Send + 'static {
        serve(self.shared.clone(), stream, stop)
    }
}

/// Forgets the connection however its task ends (relay over, cancelled by the server).
struct Registered {
    shared: Arc<Shared>,
    conn: ConnId,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.shared.lock().closed(self.conn);
    }
}

async fn serve(shared: Arc<Shared>, mut client: TcpStream, mut stop: Stop<ConnectionConfig>) {
    let settings = {
        let config = shared.config.borrow();
        RelaySettings {
            ping_timeout: config.ping_timeout,
            drain_grace: config.drain_grace,
            idle_timeout: config.idle_timeout,
            ..RelaySettings::default()
        }
    };
    // Nothing is spent on a client before its preface and SETTINGS are in (see
    // `relay::read_preface`): it is not placed yet, has no backend connection and no relay
    // buffers, so a silent client costs a few bytes, not a backend connection. Told to wind
    // down meanwhile by a drain, it has no stream to finish: it is closed at once. Its max
    // age counts from the preface on (see `Stop::drained`).
    let read = tokio::select! {
        biased;
        read = relay::read_preface(&mut client, settings.handshake_timeout) => read,
        reason = stop.drained() => {
            tracing::debug!(?reason, "client wound down before its preface, closing");
            crate::linger::close(client);
            return;
        }
    };
    // Armed once, from the preface, for the life of the connection.
    let stopped = stop.stopped();
    tokio::pin!(stopped);
    let preface = match read {
        Ok(Some(preface)) => preface,
        Ok(None) => {
            tracing::debug!("client closed before its preface");
            crate::linger::close(client);
            return;
        }
        Err(error) => {
            if let relay::RelayError::ClientProtocol(e) = &error {
                shared.metrics.client_error(e.client_error_reason());
            }
            tracing::debug!(%error, "client connection failed before its preface");
            crate::linger::close(client);
            return;
        }
    };
    let Some((placement, backend)) = shared.connect_backend().await else {
        tracing::debug!("no backend could be connected, closing the client connection");
        shared.lock().gave_up();
        // Nothing went to the client: it sees the connection close and reconnects.
        crate::linger::close(client);
        return;
    };
    let registered = Registered {
        shared: shared.clone(),
        conn: placement.conn,
    };
    let handle = RelayHandle::with_metrics(shared.metrics.clone());
    if let Some(reason) = shared
        .lock()
        .connected(placement.conn, Arc::new(handle.clone()))
    {
        handle.rotate(reason);
    }
    tracing::debug!(backend = %placement.addr, "relaying");
    let relayed = relay::relay_after(preface, client, backend, &settings, handle.clone());
    tokio::pin!(relayed);
    let end = tokio::select! {
        end = &mut relayed => end,
        reason = &mut stopped => {
            if shared.lock().rotate_for(placement.conn, reason) {
                handle.rotate(reason);
            }
            relayed.await
        }
    };
    match end {
        Ok(end) => tracing::debug!(?end, "relayed connection over"),
        // A client's protocol error was counted by the relay.
        Err(error) => tracing::debug!(%error, "relayed connection failed"),
    }
    drop(registered);
}

/// Samples the relays and runs the policy every `tick`, and runs the policy between ticks
/// when its inputs change (`changed`: endpoint set, health, configuration) and when it asked to
/// be woken (the hold's end, a budget slot freeing): a scale-up starts the hold at once and
/// the rotations start when the hold ends, not at the ticks after each.
async fn tick_task(shared: Weak<Shared>, changed: Arc<Notify>, tick: Duration) {
    let mut ticks = tokio::time::interval(tick);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick of an interval is immediate; the windows start one tick in.
    ticks.tick().await;
    let mut wake: Option<Instant> = None;
    let mut notified = std::pin::pin!(changed.notified());
    notified.as_mut().enable();
    loop {
        let woken = async {
            match wake {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let sample = tokio::select! {
            _ = ticks.tick() => true,
            () = woken => false,
            () = notified.as_mut() => false,
        };
        // Armed again before evaluating: a change from now on wakes the next round.
        notified.set(changed.notified());
        notified.as_mut().enable();
        let Some(s) = shared.upgrade() else { return };
        let now = Instant::now();
        let rotations = {
            let mut state = s.lock();
            let rotations = if sample {
                state.tick(now)
            } else {
                state.evaluate(now)
            };
            wake = state.wake().filter(|at| *at > now);
            rotations
        };
        rotate_all(rotations);
    }
}

/// The active health check of one backend, over a connection of the balancer's own
/// (`health::watch_on_own_connection`), reporting to the balancer while it lives.
async fn health_task(shared: Weak<Shared>, id: EndpointId, addr: SocketAddr, service: String) {
    let connect_timeout = {
        let shared = shared.clone();
        move || shared.upgrade().map(|s| s.config.borrow().connect_timeout)
    };
    let report = move |serving| {
        if let Some(s) = shared.upgrade() {
            s.set_serving(id, serving);
        }
    };
    crate::upstream::health::watch_on_own_connection(connect_timeout, report, addr, service).await;
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use rand::rngs::SmallRng;

    use super::controller::tests::{FakeRelay, eps};
    use super::*;

    /// The tick task's timing on a virtual clock: the balancer's own tasks (endpoint set,
    /// ticks) with fake relays placed straight into its controller.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_scale_up_holds_from_the_change_and_rotates_at_the_holds_end_not_at_a_tick() {
        let tick = Duration::from_secs(3);
        let config = ConnectionConfig {
            rotation: RotationConfig {
                hold_time: Duration::from_secs(5),
                max_rotations_per_minute: 120,
                ..RotationConfig::default()
            },
            tick,
            ..ConnectionConfig::default()
        };
        let (endpoints, rx) = watch::channel(eps(2));
        let balancer = ConnectionBalancer::with_rng(config, rx, SmallRng::seed_from_u64(21));
        let t0 = Instant::now();
        let relays: Vec<Arc<FakeRelay>> = (0..20)
            .map(|_| {
                let mut state = balancer.shared.lock();
                let p = state.place(t0, &[], false).expect("a backend");
                let relay = Arc::new(FakeRelay::default());
                assert_eq!(state.connected(p.conn, relay.clone()), None);
                relay
            })
            .collect();
        // Seed 001 on a 3 s tick: the clients send for 13.5 s, then the Deployment has 10
        // pods (between ticks: they come at 3, 6, 9, 12, 15 ...).
        let step = Duration::from_millis(100);
        let mut scaled_at = None;
        while t0.elapsed() < Duration::from_secs(30) {
            tokio::time::sleep(step).await;
            for r in &relays {
                r.requests.fetch_add(5, Ordering::Relaxed);
            }
            if scaled_at.is_none() && t0.elapsed() >= Duration::from_millis(13_500) {
                endpoints.send_replace(eps(10));
                scaled_at = Some(Instant::now());
            }
        }
        let scaled_at = scaled_at.expect("scaled");
        let rotated: Vec<Instant> = relays
            .iter()
            .filter_map(|r| r.rotated_at.lock().unwrap().first().copied())
            .collect();
        assert_eq!(
            rotated.len(),
            16,
            "10-10 over 10 pods: 16 moves to 2 per pod (3-3-2-2-2-2-2-2-1-1 is at the \
             threshold, not under the plan's band)"
        );
        assert!(
            rotated.iter().all(|t| *t == rotated[0]),
            "the whole plan at one instant: {:?}",
            rotated.iter().map(|t| *t - scaled_at).collect::<Vec<_>>()
        );
        let after = rotated[0] - scaled_at;
        assert!(
            after >= Duration::from_millis(4500) && after <= Duration::from_millis(5500),
            "the hold (5 s +-10%) counts from the scale-up and the rotations start when it \
             ends, not at the ticks after each (that would be 6.5-8.5 s here): {after:?}"
        );
    }
}
