//! The endpoint pool of one Service: the endpoint set, one HTTP/2 connection per endpoint kept
//! up by a task per endpoint, and the picker that chooses among them. The pool state sits behind one mutex whose
//! critical sections are a few comparisons long (a pick, a completion), never across an await.
//!
//! Every connection has a liveness monitor (`liveness`): a connection whose PING goes
//! unanswered is first taken out of use (suspect), then closed and its endpoint ejected (dead).
//! An ejected endpoint gets user calls again only once it has answered a PING, on its
//! connection or on a new one (every connect ends with a PING), and then gradually (the
//! picker's probes).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use rand::RngCore;
use tokio::sync::{Notify, watch};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::endpoints::Endpoint;
use crate::endpoints::{EndpointId, EndpointSet};
use crate::metrics::{EndpointMetrics, ServiceMetrics};
use crate::request::config::Config;
use crate::request::picker::{Outcome, Picker, Slot};
use crate::request::proxy::ForwardError;
use crate::request::retry_budget::RetryBudget;
use crate::request::status::{Counters, EndpointStats};
use crate::upstream::liveness::{self, LivenessConfig, Report, Signals, Verdict};
use crate::upstream::{AbortOnDrop, ConnectError, Connected, connect};

type Rng = Box<dyn RngCore + Send>;

pub(crate) struct Pool {
    /// The current configuration. Readers take the `Arc` that is current when they look (a
    /// request, a connect); [`Pool::reconfigure`] replaces it and tasks that hold state derived
    /// from it (health watches, client connections' max age) follow through `subscribe`.
    config: watch::Sender<Arc<Config>>,
    state: Mutex<State>,
    /// Woken whenever an endpoint becomes ready or the endpoint set changes.
    changed: Notify,
    pub(crate) counters: Counters,
    /// The Service port's latency, failure, rotation and connection numbers on this worker.
    pub(crate) metrics: Arc<ServiceMetrics>,
}

struct State {
    picker: Picker<Rng>,
    endpoints: EndpointSet<Member>,
    retry_budget: RetryBudget,
}

/// The pool's state of one endpoint, made when the endpoint is added.
struct Member {
    /// The endpoint's usable connections: the primary one, plus extra ones opened while every
    /// connection carries `max_streams_per_connection` streams.
    upstreams: Vec<Upstream>,
    /// Asks the connection task for one more connection.
    grow: Arc<Notify>,
    /// Asks the connection task to prove the endpoint alive with a PING (its ejection is over).
    probe: Arc<Notify>,
    /// Whether the current connection has carried a request yet: the first one pays for the
    /// connection's warm-up (server-side lazy setup, HPACK tables, TCP windows) and is not a
    /// sample of the endpoint's latency.
    warm: bool,
    task: AbortHandle,
    /// The picker's load and latency estimate.
    slot: Slot,
    /// Its latency histogram: the handle every lease on it records into.
    metrics: Arc<EndpointMetrics>,
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

/// One HTTP/2 connection to an endpoint.
#[derive(Clone)]
struct Upstream {
    /// Unique per connection, to ignore reports about older ones.
    generation: u64,
    sender: SendRequest<Bytes>,
    /// Requests open on it (also read by its liveness monitor).
    signals: Arc<Signals>,
    /// A PING on it is overdue: no new requests until it is answered.
    suspect: bool,
    /// Told when the connection is unpublished by someone else than its task (a request found
    /// it refusing new streams), so the task replaces it.
    retired: Arc<Notify>,
}

/// One request's hold on an endpoint: releases the in-flight count when dropped.
pub(crate) struct Lease {
    pool: Arc<Pool>,
    pub(crate) id: EndpointId,
    pub(crate) addr: SocketAddr,
    probe: bool,
    sample: bool,
    generation: u64,
    pub(crate) sender: SendRequest<Bytes>,
    signals: Arc<Signals>,
    sent_at: Instant,
    metrics: Arc<EndpointMetrics>,
    done: bool,
}

impl Pool {
    pub(crate) fn new(config: Config, rng: Rng) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                picker: Picker::new(config.picker.clone(), rng),
                endpoints: EndpointSet::new(),
                retry_budget: RetryBudget::new(config.retry_budget.clone(), Instant::now()),
            }),
            config: watch::Sender::new(Arc::new(config)),
            changed: Notify::new(),
            counters: Counters::default(),
            metrics: Arc::new(ServiceMetrics::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent-enough counters; keep serving.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn config(&self) -> Arc<Config> {
        self.config.borrow().clone()
    }

    /// Follows configuration changes.
    pub(crate) fn subscribe_config(&self) -> watch::Receiver<Arc<Config>> {
        self.config.subscribe()
    }

    /// Applies a new configuration to the running pool: the picker's tuning and the retry
    /// budget at once, per-request settings from the next request on, connection settings from
    /// the next connect, health watches as their connection tasks see the change.
    pub(crate) fn reconfigure(&self, config: Config) {
        let mut state = self.lock();
        state.picker.set_config(config.picker.clone());
        state
            .retry_budget
            .set_config(config.retry_budget.clone(), Instant::now());
        drop(state);
        self.config.send_replace(Arc::new(config));
        // Requests waiting for a ready endpoint look again (health checking may be off now).
        self.changed.notify_waiters();
    }

    /// A uniform number in [0, 1) from the balancer's (injectable) RNG, for jitter.
    pub(crate) fn random_unit(&self) -> f64 {
        self.lock().picker.random_unit()
    }

    pub(crate) fn stats(&self) -> Vec<EndpointStats> {
        let state = self.lock();
        let mut stats = state.picker.stats(&state.endpoints);
        // The picker knows the load; the pool knows the connections and the latency cells.
        for (s, entry) in stats.iter_mut().zip(&state.endpoints) {
            s.upstream_connections = u32::try_from(entry.value.upstreams.len()).unwrap_or(u32::MAX);
            s.latency_histogram = entry.value.metrics.latency.snapshot();
        }
        stats
    }

    /// Endpoints ejected since the pool started.
    pub(crate) fn ejections(&self) -> u64 {
        self.lock().picker.ejections()
    }

    /// Applies a new endpoint set: starts connecting to new endpoints, drops removed ones
    /// (their in-flight requests finish on the old connection).
    pub(crate) fn update(self: &Arc<Self>, endpoints: &[Endpoint]) {
        let now = Instant::now();
        let mut state = self.lock();
        let removed = state.endpoints.update(endpoints, |id, ep| {
            let span = tracing::debug_span!("endpoint", addr = %ep.addr, name = %ep.name);
            let grow = Arc::new(Notify::new());
            let probe = Arc::new(Notify::new());
            let task = tokio::spawn(
                connection_task(
                    Arc::downgrade(self),
                    id,
                    ep.addr,
                    grow.clone(),
                    probe.clone(),
                )
                .instrument(span),
            )
            .abort_handle();
            Member {
                upstreams: Vec::new(),
                grow,
                probe,
                warm: false,
                task,
                slot: Slot::new(now),
                metrics: Arc::new(EndpointMetrics::default()),
            }
        });
        drop(state);
        for entry in removed {
            entry.value.task.abort();
        }
        self.changed.notify_waiters();
    }

    /// A new connection to endpoint `id` is usable (the server answered its handshake and a
    /// PING, which also proves an ejected endpoint alive); `retired` is told if someone else
    /// unpublishes it.
    fn add_upstream(
        &self,
        id: EndpointId,
        generation: u64,
        sender: SendRequest<Bytes>,
        signals: Arc<Signals>,
        retired: Arc<Notify>,
    ) {
        let now = Instant::now();
        let mut state = self.lock();
        let State {
            picker, endpoints, ..
        } = &mut *state;
        if let Some(entry) = endpoints.get_mut(id) {
            entry.value.upstreams.push(Upstream {
                generation,
                sender,
                signals,
                suspect: false,
                retired,
            });
            entry.value.warm = false;
            endpoints.set_ready(id, true);
            picker.proven(endpoints, id, now);
        }
        drop(state);
        self.changed.notify_waiters();
    }

    /// How many connections endpoint `id`'s outstanding streams fill (those h2 queues for want
    /// of room included), at `per_conn` streams or the server's limit a connection, whichever
    /// is lower: what its connection task opens extra connections up to when asked to grow.
    fn connections_wanted(&self, id: EndpointId, per_conn: u32) -> usize {
        let state = self.lock();
        let Some(entry) = state.endpoints.get(id) else {
            return 0;
        };
        let upstreams = &entry.value.upstreams;
        let streams: u32 = upstreams.iter().map(|u| u.signals.streams()).sum();
        let room = upstreams
            .iter()
            .map(|u| {
                per_conn.min(u32::try_from(u.sender.current_max_send_streams()).unwrap_or(u32::MAX))
            })
            .max()
            .unwrap_or(per_conn)
            .max(1);
        usize::try_from(streams.div_ceil(room)).unwrap_or(usize::MAX)
    }

    /// What the liveness monitor of connection `generation` reports.
    fn liveness_report(&self, id: EndpointId, generation: u64, report: Report) {
        let now = Instant::now();
        let mut state = self.lock();
        let State {
            picker, endpoints, ..
        } = &mut *state;
        let Some(entry) = endpoints.get_mut(id) else {
            return;
        };
        let Some(up) = entry
            .value
            .upstreams
            .iter_mut()
            .find(|u| u.generation == generation)
        else {
            return;
        };
        match report {
            Report::Suspect(suspect) => {
                up.suspect = suspect;
                let ready = entry.value.upstreams.iter().any(|u| !u.suspect);
                endpoints.set_ready(id, ready);
            }
            Report::Answered => picker.proven(endpoints, id, now),
        }
        drop(state);
        if report == Report::Suspect(false) {
            self.changed.notify_waiters();
        }
    }

    /// Connection `generation` is dead (its PING went unanswered): the endpoint is ejected and
    /// the connection no longer used (its task closes it).
    fn connection_dead(&self, id: EndpointId, generation: u64) {
        let now = Instant::now();
        {
            let mut state = self.lock();
            let State {
                picker, endpoints, ..
            } = &mut *state;
            picker.connection_dead(endpoints, id, now);
        }
        self.connection_closed(id, generation);
    }

    /// The active health check of connection `generation` reports `serving`.
    pub(crate) fn set_serving(&self, id: EndpointId, generation: u64, serving: bool) {
        let mut state = self.lock();
        if let Some(entry) = state.endpoints.get(id)
            && entry
                .value
                .upstreams
                .iter()
                .any(|u| u.generation == generation)
        {
            state.endpoints.set_serving(id, serving);
        }
        drop(state);
        if serving {
            self.changed.notify_waiters();
        }
    }

    /// This connection takes no new streams (GOAWAY seen, or it ended): stop using it; the
    /// endpoint is not ready while it has no connection left. The connection's task is told,
    /// so a connection a request found refusing streams is replaced even if h2 has not
    /// noticed its end yet.
    pub(crate) fn connection_closed(&self, id: EndpointId, generation: u64) {
        let mut state = self.lock();
        if let Some(entry) = state.endpoints.get_mut(id) {
            let upstreams = &mut entry.value.upstreams;
            if let Some(i) = upstreams.iter().position(|u| u.generation == generation) {
                upstreams.swap_remove(i).retired.notify_one();
            }
            if !upstreams.iter().any(|u| !u.suspect) {
                state.endpoints.set_ready(id, false);
            }
        }
    }

    /// Takes one retry from the budget, if it has one.
    pub(crate) fn withdraw_retry_token(&self) -> bool {
        let now = Instant::now();
        self.lock().retry_budget.withdraw(now)
    }

    /// Picks an endpoint with a ready connection, waiting up to the ready timeout for one when
    /// the Service has endpoints but none is connected yet (`config`: the one the request runs
    /// under). `first`: the request's first pick, which deposits its share of the retry budget
    /// (under the same lock and clock reading as the pick, whatever the pick's outcome).
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        config: &Config,
        exclude: &[EndpointId],
        first: Option<Instant>,
    ) -> Result<Lease, ForwardError> {
        // The common case: a ready endpoint at the first look, nothing to wait for.
        if let Some(lease) = self.try_acquire(config, exclude, first)? {
            return Ok(lease);
        }
        let give_up = Instant::now() + config.ready_timeout;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            // Register before looking, so a change between the look and the wait is not lost.
            notified.as_mut().enable();
            if let Some(lease) = self.try_acquire(config, exclude, None)? {
                return Ok(lease);
            }
            if tokio::time::timeout_at(give_up, notified).await.is_err() {
                return Err(ForwardError::NoReadyEndpoint);
            }
        }
    }

    /// One look at the pool: a lease, `None` to wait for a change, or an error to give up.
    /// `first`: this is an original request's first look, at the call's arrival reading (no
    /// await lies between the two, so the pick reads no clock of its own); it first deposits
    /// the request's share of the retry budget.
    fn try_acquire(
        self: &Arc<Self>,
        config: &Config,
        exclude: &[EndpointId],
        first: Option<Instant>,
    ) -> Result<Option<Lease>, ForwardError> {
        let now = first.unwrap_or_else(Instant::now);
        let mut state = self.lock();
        let State {
            picker,
            endpoints,
            retry_budget,
        } = &mut *state;
        if first.is_some() {
            retry_budget.deposit(now);
        }
        if endpoints.is_empty() {
            return Err(ForwardError::NoEndpoints);
        }
        let pick = picker.pick(endpoints, now, exclude);
        if picker.has_unproven() {
            // Ejections that just ended: each endpoint must answer a PING before user calls.
            for id in picker.take_unproven() {
                if let Some(entry) = endpoints.get(id) {
                    entry.value.probe.notify_one();
                }
            }
        }
        let Some(pick) = pick else {
            // Every endpoint was excluded: a retry has nowhere to go. Otherwise wait for one
            // that is still connecting (right after startup or a reconnect).
            if endpoints.all_excluded(exclude) {
                return Err(ForwardError::NoReadyEndpoint);
            }
            return Ok(None);
        };
        let (per_conn, max_conns) = (
            config.max_streams_per_connection,
            config.max_connections_per_endpoint,
        );
        if let Some(entry) = endpoints.get_mut(pick.id)
            && let Some(up) = entry
                .value
                .upstreams
                .iter()
                .filter(|u| !u.suspect)
                .min_by_key(|u| u.signals.streams())
        {
            let open = up.signals.stream_opened();
            // Full at our own limit or the server's, whichever is lower.
            let full = per_conn
                .min(u32::try_from(up.sender.current_max_send_streams()).unwrap_or(u32::MAX));
            let (generation, sender, signals) =
                (up.generation, up.sender.clone(), up.signals.clone());
            let member = &mut entry.value;
            if open > full && member.upstreams.len() < max_conns {
                // Every connection is full: ask for more. This request still goes out on the
                // least busy one (h2 queues it if the server's limit is reached).
                member.grow.notify_one();
            }
            let sample = std::mem::replace(&mut member.warm, true);
            let metrics = member.metrics.clone();
            return Ok(Some(Lease {
                pool: self.clone(),
                id: pick.id,
                addr: entry.endpoint().addr,
                probe: pick.probe,
                sample,
                generation,
                sender,
                signals,
                sent_at: now,
                metrics,
                done: false,
            }));
        }
        // Ready in the picker but no sender: cannot happen (both change together); undo the
        // pick and treat the endpoint as not ready.
        picker.complete(endpoints, pick.id, pick.probe, Outcome::Cancelled, now);
        endpoints.set_ready(pick.id, false);
        Ok(None)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for entry in &state.endpoints {
            entry.value.task.abort();
        }
    }
}

impl Lease {
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// The response headers arrived: record the latency sample.
    pub(crate) fn headers_received(&self) {
        if !self.sample {
            return;
        }
        let now = Instant::now();
        let rtt = now.saturating_duration_since(self.sent_at);
        let mut state = self.pool.lock();
        let State {
            picker, endpoints, ..
        } = &mut *state;
        picker.observe_latency(endpoints, self.id, self.probe, rtt, now);
    }

    /// The request is over: release its in-flight count with its outcome. Returns the clock
    /// reading it ended at, for the call's own duration.
    pub(crate) fn finish(mut self, outcome: Outcome) -> Instant {
        let now = Instant::now();
        self.finish_at(outcome, now);
        now
    }

    /// Where the request's load on its endpoint completes: the end of the response (or of
    /// the attempt), at `now`. Its duration since the pick goes into the endpoint's
    /// histogram, so the histogram counts exactly the requests the picker counted.
    fn finish_at(&mut self, outcome: Outcome, now: Instant) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        self.signals.stream_closed();
        self.metrics
            .latency
            .record(now.saturating_duration_since(self.sent_at));
        let mut state = self.pool.lock();
        let State {
            picker, endpoints, ..
        } = &mut *state;
        picker.complete(endpoints, self.id, self.probe, outcome, now);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.done {
            self.finish_at(Outcome::Cancelled, Instant::now());
        }
    }
}

static GENERATION: AtomicU64 = AtomicU64::new(0);

/// The liveness monitor of connection `generation`, reporting to the pool. Its connect sent
/// one PING before the server sent any HEADERS or DATA.
async fn monitor(
    pool: Weak<Pool>,
    id: EndpointId,
    generation: u64,
    pings: h2::PingPong,
    signals: Arc<Signals>,
    liveness: LivenessConfig,
    probe: Option<Arc<Notify>>,
) -> Verdict {
    let report = |report| {
        if let Some(p) = pool.upgrade() {
            p.liveness_report(id, generation, report);
        }
    };
    liveness::monitor(pings, &signals, &liveness, 1, probe.as_deref(), report).await
}

/// Keeps the endpoint's primary HTTP/2 connection up: connects, publishes it, and when it stops
/// taking streams (upstream GOAWAY, close, error, dead) replaces it at once, backing off only
/// when connects fail or connections die young. Opens extra connections when asked through
/// `grow`; those live until they stop taking streams and are not replaced. `probe` asks for a
/// PING that proves the endpoint alive (its ejection is over).
async fn connection_task(
    pool: Weak<Pool>,
    id: EndpointId,
    addr: SocketAddr,
    grow: Arc<Notify>,
    probe: Arc<Notify>,
) {
    let Some(mut config) = pool.upgrade().map(|p| p.subscribe_config()) else {
        return;
    };
    // Dropped (aborting the extra connections' tasks) when this task is aborted.
    let mut extras = tokio::task::JoinSet::new();
    let mut backoff = config.borrow().reconnect_backoff.0;
    loop {
        // Connection settings as of this connect: a reconfiguration applies from the next one.
        let (timeout, (base, max), max_conns, liveness) = {
            let c = config.borrow_and_update();
            (
                c.connect_timeout,
                c.reconnect_backoff,
                c.max_connections_per_endpoint,
                c.liveness.clone(),
            )
        };
        match connect(addr, timeout, &liveness).await {
            Ok(Connected {
                sender,
                mut ended,
                go_away,
                pings,
                signals,
            }) => {
                let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(generation, "connected");
                let Some(p) = pool.upgrade() else { return };
                // With active health checking the endpoint is not used until its first
                // SERVING (A17: a new connection starts out not known to be healthy); without,
                // it serves (also when checks were switched off while it was reconnecting).
                let mut health_service = config.borrow_and_update().health_service.clone();
                p.lock().endpoints.set_serving(id, health_service.is_none());
                let retired = Arc::new(Notify::new());
                p.add_upstream(
                    id,
                    generation,
                    sender.clone(),
                    signals.clone(),
                    retired.clone(),
                );
                drop(p);
                let health_watch = |service: String| {
                    // Aborted when dropped: on a health service change and when this
                    // connection is no longer used.
                    let pool = pool.clone();
                    let report = move |serving| {
                        if let Some(p) = pool.upgrade() {
                            p.set_serving(id, generation, serving);
                        }
                    };
                    AbortOnDrop(tokio::spawn(
                        crate::upstream::health::watch(
                            report,
                            sender.clone(),
                            addr.to_string(),
                            service,
                        )
                        .in_current_span(),
                    ))
                };
                let mut health = health_service.clone().map(health_watch);
                let mut alive = std::pin::pin!(monitor(
                    pool.clone(),
                    id,
                    generation,
                    pings,
                    signals,
                    liveness.clone(),
                    Some(probe.clone()),
                ));
                let started = Instant::now();
                loop {
                    tokio::select! {
                        _ = &mut ended => break,
                        verdict = &mut alive => {
                            match verdict {
                                Verdict::Dead => {
                                    if let Some(p) = pool.upgrade() {
                                        p.connection_dead(id, generation);
                                    }
                                    // Its requests fail now (UNAVAILABLE, retried where safe),
                                    // not at their deadlines.
                                    ended.abort();
                                }
                                Verdict::ProbeNeedsNewConnection => {
                                    tracing::debug!("probing with a new connection");
                                }
                                Verdict::Closed => {}
                            }
                            break;
                        }
                        () = go_away.notified() => {
                            tracing::debug!("upstream sent GOAWAY, replacing the connection");
                            break;
                        }
                        () = retired.notified() => {
                            tracing::debug!("connection refused a stream, replacing it");
                            break;
                        }
                        () = grow.notified() => {
                            while extras.try_join_next().is_some() {}
                            // As many as the streams need: the asks of a burst come faster
                            // than this task wakes, and are one wake-up by then.
                            let per_conn = config.borrow().max_streams_per_connection;
                            let wanted = pool
                                .upgrade()
                                .map_or(0, |p| p.connections_wanted(id, per_conn))
                                .min(max_conns);
                            while extras.len() + 1 < wanted {
                                tracing::debug!(connections = extras.len() + 2, "opening another connection");
                                extras.spawn(extra_connection(pool.clone(), id, addr, timeout, liveness.clone()).in_current_span());
                            }
                        }
                        Ok(()) = config.changed() => {
                            let wanted = config.borrow_and_update().health_service.clone();
                            if wanted == health_service {
                                continue;
                            }
                            tracing::debug!(service = ?wanted, "health service changed");
                            // Stop the old watch before anything else can report for it.
                            drop(health.take());
                            match &wanted {
                                // Health checking is off: EndpointSlice readiness alone counts.
                                None => {
                                    if let Some(p) = pool.upgrade() {
                                        p.set_serving(id, generation, true);
                                    }
                                }
                                // A live connection keeps its current state until the new watch
                                // reports (a moment later), so switching health checks on does
                                // not stall a Service whose endpoints all serve.
                                Some(service) => health = Some(health_watch(service.clone())),
                            }
                            health_service = wanted;
                        }
                    }
                }
                // Our handles go: h2 closes the connection once its last stream is done.
                drop(health);
                drop(sender);
                let Some(p) = pool.upgrade() else { return };
                p.connection_closed(id, generation);
                drop(p);
                // Reconnect at once (the upstream restarts or rotates connections), unless
                // connections keep dying young: then back off so a broken peer is not hammered.
                if started.elapsed() >= Duration::from_millis(100) {
                    backoff = base;
                    continue;
                }
            }
            Err(ConnectError::Timeout) => {
                // Nothing answered (a lost node, a partition): the attempt itself waited the
                // connect timeout, so try again soon; the endpoint is back within about a
                // connect timeout of answering again.
                tracing::debug!(backoff_ms = base.as_millis(), "connect timed out");
                backoff = base;
            }
            Err(error) => {
                tracing::debug!(%error, backoff_ms = backoff.as_millis(), "connect failed");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(max);
    }
}

/// One extra connection, used until it stops taking streams (or its monitor finds it dead).
async fn extra_connection(
    pool: Weak<Pool>,
    id: EndpointId,
    addr: SocketAddr,
    timeout: Duration,
    liveness: LivenessConfig,
) {
    /// Unpublishes the connection however this task ends (closed, aborted).
    struct Unpublish(Weak<Pool>, EndpointId, u64);
    impl Drop for Unpublish {
        fn drop(&mut self) {
            if let Some(p) = self.0.upgrade() {
                p.connection_closed(self.1, self.2);
            }
        }
    }
    let Connected {
        sender,
        mut ended,
        go_away,
        pings,
        signals,
    } = match connect(addr, timeout, &liveness).await {
        Ok(ok) => ok,
        Err(error) => {
            tracing::debug!(%error, "extra connection failed");
            return;
        }
    };
    let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
    let Some(p) = pool.upgrade() else { return };
    let retired = Arc::new(Notify::new());
    p.add_upstream(id, generation, sender, signals.clone(), retired.clone());
    drop(p);
    let _unpublish = Unpublish(pool.clone(), id, generation);
    tokio::select! {
        _ = &mut ended => {}
        verdict = monitor(pool.clone(), id, generation, pings, signals, liveness, None) => {
            if verdict == Verdict::Dead {
                if let Some(p) = pool.upgrade() {
                    p.connection_dead(id, generation);
                }
                ended.abort();
            }
        }
        () = go_away.notified() => tracing::debug!("upstream sent GOAWAY to an extra connection"),
        () = retired.notified() => {}
    }
}
