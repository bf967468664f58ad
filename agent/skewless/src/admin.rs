//! The admin API server: `/live`, `/ready`, `/status` (JSON), the status page `/ui` (HTML
//! from the same document) and `/metrics` (OpenMetrics).
//!
//! Two kinds of listener ([`Scope`]): the public one (`--metrics-addr`, reachable from other
//! hosts) answers only the probes and `/metrics`; the local one (`--admin-addr`, loopback by
//! default) answers everything. What only the local listener serves is routed in one place,
//! [`local_route`], so a new view of the node's state lands beside `/status`.
//!
//! This file routes requests and gathers the numbers each answer needs from the datapath,
//! the reconciler and the observer; what the answers say (JSON types, metric families) is
//! `skewless-admin`'s.

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{Arc, Mutex, atomic::Ordering},
};

use anyhow::{Context as _, Result};
use http_body_util::Full;
use hyper::{Request, Response, StatusCode, body::Bytes, service::service_fn};
use hyper_util::rt::TokioIo;
use skewless_admin::{
    collector::{Kernel, MapUsage, Metrics, Scrape, WorkerUsage},
    json::{AgentStatus, MapStatus, ObservedService, RedirectStatus, ServiceStatus, Status},
    page,
    process::{ProcTexts, Process},
    window::{self, Window},
};
use skewless_datapath::{Counter, Counters, Datapath};
use tokio::net::TcpListener;
use tracing::{debug, warn};

use crate::{observer::Published, peers::PeerFilter, reconcile::Reconciler, stall::StallCounts};

/// What the worker families read: the workers' threads and the heartbeat's stall counts.
pub struct WorkerFigures {
    pub workers: Arc<skewless_balancer::Workers>,
    pub stalls: Arc<StallCounts>,
}

impl WorkerFigures {
    /// Each worker's scheduler times (zero while its thread is unknown) and stalls.
    fn usage(&self) -> Vec<WorkerUsage> {
        self.workers
            .liveness()
            .iter()
            .enumerate()
            .map(|(i, live)| {
                let sample = live
                    .tid
                    .and_then(skewless_balancer::workers::ThreadSample::read);
                WorkerUsage {
                    busy_seconds: sample.map_or(0.0, |s| s.on_cpu.as_secs_f64()),
                    cpu_wait_seconds: sample.map_or(0.0, |s| s.waiting.as_secs_f64()),
                    stalls: self.stalls.get(i),
                }
            })
            .collect()
    }
}

/// This process's figures from `/proc`; `None` (and a debug line) where they cannot be read.
fn process() -> Option<Process> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let (stat, status, limits, system_stat) = (
        read("/proc/self/stat")?,
        read("/proc/self/status")?,
        read("/proc/self/limits")?,
        read("/proc/stat")?,
    );
    let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    Process::parse(&ProcTexts {
        stat: &stat,
        status: &status,
        limits: &limits,
        system_stat: &system_stat,
        open_fds,
    })
    .inspect_err(|error| debug!(%error, "process figures"))
    .ok()
}

/// Whether the agent has a model yet, and what it waits for until then (`/ready` says it).
pub struct Readiness {
    pub synced: tokio::sync::watch::Receiver<bool>,
    pub waiting_for: String,
}

impl Readiness {
    fn ready(&self) -> bool {
        *self.synced.borrow()
    }
}

pub struct State {
    peers: Arc<PeerFilter>,
    node: String,
    datapath: Arc<Mutex<Datapath>>,
    reconciler: Arc<tokio::sync::Mutex<Reconciler>>,
    metrics: Metrics,
    /// The balancers' numbers of the last 30 to 60 s, for the gauges that need a window.
    window: Mutex<Window>,
    /// The window's clock: its readings are taken at times since this.
    started: tokio::time::Instant,
    /// With a model source: whether it has delivered its first complete model.
    model: Option<Readiness>,
    /// The observer's latest per-Service reports and its figures of the connection map.
    observed: Arc<Published>,
    workers: WorkerFigures,
    resources: skewless_admin::json::Resources,
}

/// Where the admin API's answers come from.
pub struct Sources {
    pub peers: Arc<PeerFilter>,
    pub node: String,
    pub datapath: Arc<Mutex<Datapath>>,
    pub reconciler: Arc<tokio::sync::Mutex<Reconciler>>,
    pub metrics: Metrics,
    /// With a model source: whether it has delivered its first complete model.
    pub model: Option<Readiness>,
    pub observed: Arc<Published>,
    pub workers: WorkerFigures,
    pub resources: skewless_admin::json::Resources,
}

impl State {
    pub fn new(sources: Sources) -> Self {
        let Sources {
            peers,
            node,
            datapath,
            reconciler,
            metrics,
            model,
            observed,
            workers,
            resources,
        } = sources;
        Self {
            peers,
            node,
            datapath,
            reconciler,
            metrics,
            window: Mutex::new(Window::default()),
            started: tokio::time::Instant::now(),
            model,
            observed,
            workers,
            resources,
        }
    }

    /// Takes a reading of the balancers every [`window::PERIOD`], forever.
    pub async fn follow_window(self: Arc<Self>) {
        let mut tick = tokio::time::interval(window::PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let services = self.reconciler.lock().await.status();
            if let Ok(mut w) = self.window.lock() {
                w.rotate(&services, self.started.elapsed());
            }
        }
    }

    /// Every redirected Service port, with the window's gauges filled in.
    async fn services(&self) -> Vec<ServiceStatus> {
        let mut services = self.reconciler.lock().await.status();
        if let Ok(w) = self.window.lock() {
            w.apply(&mut services, self.started.elapsed());
        }
        services
    }
}

/// What a listener of the admin API answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Reachable from other hosts (Prometheus, the kubelet): `/live`, `/ready`, `/metrics`.
    Public,
    /// This node only: everything, `/status` included.
    Local,
}

/// How long a listener's address may stay taken before binding gives up: a predecessor agent
/// (a rolling update) frees its admin addresses when it gets SIGTERM, but a listener of
/// another program on the address is an error within this bound.
const BIND_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(30);

/// Binds an admin listener, waiting while the address is in use (a predecessor agent between
/// its SIGTERM and its exit may still hold it).
pub async fn bind(addr: SocketAddr, scope: Scope) -> Result<TcpListener> {
    let started = tokio::time::Instant::now();
    let mut warned = false;
    loop {
        match TcpListener::bind(addr).await {
            Ok(listener) => return Ok(listener),
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && started.elapsed() < BIND_RETRY_FOR =>
            {
                if !warned {
                    warn!(%addr, ?scope, "admin address in use (a predecessor agent draining?); retrying");
                    warned = true;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("binding the admin API ({scope:?}) to {addr}"));
            }
        }
    }
}

/// Serves the admin API's `scope` on `listener` until the task is aborted.
pub async fn serve(listener: TcpListener, scope: Scope, state: Arc<State>) -> Result<()> {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                warn!(error = %e, "admin accept");
                continue;
            }
        };
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let state = Arc::clone(&state);
                async move { Ok::<_, Infallible>(route(&req, &state, scope).await) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                debug!(%peer, error = %e, "admin connection");
            }
        });
    }
}

async fn route(
    req: &Request<hyper::body::Incoming>,
    state: &State,
    scope: Scope,
) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    match (path, scope) {
        ("/live", _) => text(StatusCode::OK, "ok\n"),
        ("/ready", _) => ready(state).await,
        ("/metrics", _) => match metrics_of(state).await {
            Ok(body) => Response::builder()
                .header(
                    "content-type",
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )
                .body(Full::new(Bytes::from(body)))
                .unwrap_or_default(),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e:#}\n")),
        },
        (_, Scope::Local) => local_route(path, state).await,
        (_, Scope::Public) => text(
            StatusCode::NOT_FOUND,
            "not found: this address serves /live, /ready and /metrics; the rest of the \
             admin API is on the agent's local address (--admin-addr)\n",
        ),
    }
}

/// Everything only the local listener serves: `/status`, the status page (`/ui`) drawn from
/// it, and any other view of the node's Services, VIPs and backends (they stay off the public
/// listener).
async fn local_route(path: &str, state: &State) -> Response<Full<Bytes>> {
    match path {
        "/status" => match status_of(state).await {
            Ok(s) => Response::builder()
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(
                    serde_json::to_vec_pretty(&s).unwrap_or_default(),
                )))
                .unwrap_or_default(),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e:#}\n")),
        },
        // The status page: beside `/status`, from the same document.
        "/ui" | "/ui/" => match status_of(state).await {
            Ok(s) => page_response("text/html; charset=utf-8", page::page(&s)),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e:#}\n")),
        },
        "/ui/fragment" => match status_of(state).await {
            Ok(s) => page_response("text/html; charset=utf-8", page::fragment(&s)),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e:#}\n")),
        },
        "/ui/style.css" => page_response("text/css; charset=utf-8", page::STYLE.to_owned()),
        "/ui/app.js" => page_response("text/javascript; charset=utf-8", page::SCRIPT.to_owned()),
        "/ui/icon.svg" => page_response("image/svg+xml", page::ICON.to_owned()),
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// Ready once the model is complete and every opted-in Service port that should be balanced
/// is (docs/install.md, "Readiness"): a node whose agent cannot serve a Service is not ready,
/// which stops a rolling update of a broken version at its first node.
async fn ready(state: &State) -> Response<Full<Bytes>> {
    if let Some(m) = state.model.as_ref().filter(|m| !m.ready()) {
        return text(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!(
                "no model yet: {}; nothing is redirected until then\n",
                m.waiting_for
            ),
        );
    }
    let unserved = state.reconciler.lock().await.unserved();
    if unserved.is_empty() {
        return text(StatusCode::OK, "ok\n");
    }
    let mut body = format!(
        "{} opted-in Service port(s) cannot be served (their clients go plain L4):\n",
        unserved.len()
    );
    for u in &unserved {
        body.push_str(&format!("{} {}: {}\n", u.service, u.vip, u.error));
    }
    text(StatusCode::SERVICE_UNAVAILABLE, &body)
}

/// The kernel's counters, the redirect entries, and how full the redirect maps are.
fn kernel(state: &State) -> Result<(Counters, Vec<RedirectStatus>, Vec<MapUsage>)> {
    let dp = state
        .datapath
        .lock()
        .map_err(|_| anyhow::anyhow!("datapath lock poisoned"))?;
    let redirects = dp.redirects();
    let entries = |v6: bool| redirects.iter().filter(|(s, _)| s.is_ipv6() == v6).count() as u64;
    let maps = vec![
        MapUsage {
            map: "redirect4",
            entries: entries(false),
            capacity: skewless_common::REDIRECT4_CAPACITY.into(),
        },
        MapUsage {
            map: "redirect6",
            entries: entries(true),
            capacity: skewless_common::REDIRECT6_CAPACITY.into(),
        },
        MapUsage {
            map: "conns",
            entries: state.observed.entries.load(Ordering::Relaxed),
            capacity: skewless_common::CONNS_CAPACITY.into(),
        },
    ];
    let redirects = redirects
        .into_iter()
        .map(|(service, target)| RedirectStatus {
            service: service.to_string(),
            target: target.to_string(),
        })
        .collect();
    Ok((dp.counters()?, redirects, maps))
}

/// The kernel's counters as exported: IPv4 and IPv6 summed.
fn exported(c: &Counters, observer: &Published) -> Kernel {
    Kernel {
        connect_seen: c[Counter::Connect4Seen] + c[Counter::Connect6Seen],
        connect_redirected: c[Counter::Connect4Redirected]
            + c[Counter::Connect6Redirected]
            + c[Counter::Connect6NativeRedirected],
        stale_heartbeat: c[Counter::StaleHeartbeat],
        origdst_update_failed: c[Counter::OrigDstUpdateFailed],
        observed_connections: c[Counter::ConnEstablished],
        observed_record_failed: c[Counter::ConnUpdateFailed] + c[Counter::ConnCbFlagsFailed],
        observed_records_evicted: observer.evicted.load(Ordering::Relaxed),
    }
}

/// The agent's health and cost: what `/status` says of it, and what `/metrics` exports.
fn agent_of(state: &State, kernel: &Kernel, maps: &[MapUsage]) -> AgentStatus {
    AgentStatus {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        model_ready: state.model.as_ref().is_none_or(Readiness::ready),
        process: process(),
        workers: state.workers.usage(),
        stale_heartbeat: kernel.stale_heartbeat,
        maps: maps
            .iter()
            .map(|m| MapStatus {
                map: m.map.to_owned(),
                entries: m.entries,
                capacity: m.capacity,
            })
            .collect(),
        resources: state.resources,
    }
}

async fn status_of(state: &State) -> Result<Status> {
    let services = state.services().await;
    let (counters, redirects, maps) = kernel(state)?;
    let k = exported(&counters, &state.observed);
    Ok(Status {
        node: state.node.clone(),
        redirects,
        connect_seen: k.connect_seen,
        connect_redirected: k.connect_redirected,
        refused_peers: state.peers.refused(),
        services,
        observed: observed_of(state),
        agent: agent_of(state, &k, &maps),
        unserved: state.reconciler.lock().await.unserved(),
    })
}

fn observed_of(state: &State) -> Vec<ObservedService> {
    state
        .observed
        .reports
        .lock()
        .map(|o| o.clone())
        .unwrap_or_default()
}

async fn metrics_of(state: &State) -> Result<String> {
    let services = state.services().await;
    let (counters, _, maps) = kernel(state)?;
    let kernel = exported(&counters, &state.observed);
    let agent = agent_of(state, &kernel, &maps);
    let scrape = Scrape {
        process: agent.process,
        workers: agent.workers,
        resources: agent.resources,
        model_ready: agent.model_ready,
        kernel,
        maps,
        refused_peers: state.peers.refused(),
        services,
        observed: observed_of(state),
        unserved: state.reconciler.lock().await.unserved(),
    };
    Ok(state.metrics.encode(scrape)?)
}

/// A status-page response: its policy (nothing but this origin's own files), no sniffing,
/// no caching (the figures are live), no referrer.
fn page_response(content_type: &str, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .header("content-type", content_type)
        .header("content-security-policy", page::CONTENT_SECURITY_POLICY)
        .header("x-content-type-options", "nosniff")
        .header("cache-control", "no-store")
        .header("referrer-policy", "no-referrer")
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_default()
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_owned())));
    *r.status_mut() = status;
    r
}
