//! The admin API (`/live`, `/ready`, `/status`, `/metrics`) and the `skewless status` client.

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use anyhow::{Context as _, Result};
use http_body_util::{BodyExt as _, Full};
use hyper::{Request, Response, StatusCode, body::Bytes, service::service_fn};
use hyper_util::rt::TokioIo;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};
use serde::{Deserialize, Serialize};
use skewless_datapath::{Counters, Datapath};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

use crate::{
    observer::ObservedService,
    peers::PeerFilter,
    reconcile::{Reconciler, ServiceStatus},
};

pub struct State {
    peers: Arc<PeerFilter>,
    node: String,
    datapath: Arc<Mutex<Datapath>>,
    reconciler: Arc<tokio::sync::Mutex<Reconciler>>,
    registry: Mutex<Registry>,
    /// What the metrics collector reports; refreshed right before each scrape is encoded.
    scraped: Arc<Mutex<Scraped>>,
    /// With Kubernetes discovery: whether the first full list is in.
    synced: Option<tokio::sync::watch::Receiver<bool>>,
    /// The observer's latest per-Service reports.
    observed: Arc<Mutex<Vec<ObservedService>>>,
}

impl State {
    pub fn new(
        peers: Arc<PeerFilter>,
        node: String,
        datapath: Arc<Mutex<Datapath>>,
        reconciler: Arc<tokio::sync::Mutex<Reconciler>>,
        mut registry: Registry,
        synced: Option<tokio::sync::watch::Receiver<bool>>,
        observed: Arc<Mutex<Vec<ObservedService>>>,
    ) -> Self {
        let scraped = Arc::new(Mutex::new(Scraped::default()));
        registry.register_collector(Box::new(AgentCollector(Arc::clone(&scraped))));
        Self {
            peers,
            node,
            datapath,
            reconciler,
            registry: Mutex::new(registry),
            scraped,
            synced,
            observed,
        }
    }
}

/// What `/status` returns.
#[derive(Debug, Serialize, Deserialize)]
pub struct Status {
    pub node: String,
    pub redirects: Vec<RedirectStatus>,
    pub connect_seen: u64,
    pub connect_redirected: u64,
    pub refused_peers: u64,
    pub services: Vec<ServiceStatus>,
    /// Services not balanced by skewless: where their connections are pinned.
    pub observed: Vec<ObservedService>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct RedirectStatus {
    pub service: String,
    pub target: String,
}

pub async fn serve(addr: SocketAddr, state: Arc<State>) -> Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the admin API to {addr}"))?;
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
                async move { Ok::<_, Infallible>(route(&req, &state).await) }
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

async fn route(req: &Request<hyper::body::Incoming>, state: &State) -> Response<Full<Bytes>> {
    match req.uri().path() {
        "/live" => text(StatusCode::OK, "ok\n"),
        "/ready" if state.synced.as_ref().is_none_or(|s| *s.borrow()) => {
            text(StatusCode::OK, "ok\n")
        }
        "/ready" => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "waiting for the first list of Services and EndpointSlices\n",
        ),
        "/status" => match status_of(state).await {
            Ok(s) => Response::builder()
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(
                    serde_json::to_vec_pretty(&s).unwrap_or_default(),
                )))
                .unwrap_or_default(),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e:#}\n")),
        },
        "/metrics" => match metrics_of(state).await {
            Ok(body) => Response::builder()
                .header(
                    "content-type",
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )
                .body(Full::new(Bytes::from(body)))
                .unwrap_or_default(),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e:#}\n")),
        },
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

fn kernel(state: &State) -> Result<(Counters, Vec<RedirectStatus>)> {
    let dp = state
        .datapath
        .lock()
        .map_err(|_| anyhow::anyhow!("datapath lock poisoned"))?;
    let v4 = dp
        .redirects()
        .into_iter()
        .map(|(s, t)| (s.to_string(), t.to_string()));
    let v6 = dp
        .redirects6()
        .into_iter()
        .map(|(s, t)| (s.to_string(), t.to_string()));
    let redirects = v4
        .chain(v6)
        .map(|(service, target)| RedirectStatus { service, target })
        .collect();
    Ok((dp.counters()?, redirects))
}

async fn status_of(state: &State) -> Result<Status> {
    let services = state.reconciler.lock().await.status();
    let (counters, redirects) = kernel(state)?;
    Ok(Status {
        node: state.node.clone(),
        redirects,
        connect_seen: counters.connect4_seen + counters.connect6_seen,
        connect_redirected: counters.connect4_redirected
            + counters.connect6_redirected
            + counters.connect6_native_redirected,
        refused_peers: state.peers.refused(),
        services,
        observed: observed_of(state),
    })
}

fn observed_of(state: &State) -> Vec<ObservedService> {
    state.observed.lock().map(|o| o.clone()).unwrap_or_default()
}

async fn metrics_of(state: &State) -> Result<String> {
    let services = state.reconciler.lock().await.status();
    let (counters, _) = kernel(state)?;
    *state
        .scraped
        .lock()
        .map_err(|_| anyhow::anyhow!("metrics lock poisoned"))? = Scraped {
        services,
        counters,
        refused_peers: state.peers.refused(),
        observed: observed_of(state),
    };
    let registry = state
        .registry
        .lock()
        .map_err(|_| anyhow::anyhow!("registry lock poisoned"))?;
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)?;
    Ok(out)
}

#[derive(Debug, Default)]
struct Scraped {
    services: Vec<ServiceStatus>,
    counters: Counters,
    refused_peers: u64,
    observed: Vec<ObservedService>,
}

/// Exposes the balancers' and the kernel's own counters at scrape time, so there is one source
/// of truth and nothing to keep in sync. Labels are bounded by Services x backends.
#[derive(Debug)]
struct AgentCollector(Arc<Mutex<Scraped>>);

type Labels = Vec<(&'static str, String)>;

/// Encodes one metric family from (labels, value) rows.
fn family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: impl IntoIterator<Item = (Labels, M)>,
) -> Result<(), std::fmt::Error> {
    let mut m = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in rows {
        value.encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

fn count(n: usize) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
}

impl Collector for AgentCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(s) = self.0.lock() else { return Ok(()) };
        let c = s.counters;
        let kernel = [
            (
                "connect_seen",
                "connect() calls (IPv4 and IPv6) seen by the hooks in attached pod cgroups.",
                c.connect4_seen + c.connect6_seen,
            ),
            (
                "connect_redirected",
                "connect() calls rewritten to a node balancer listener (IPv4 and IPv6).",
                c.connect4_redirected + c.connect6_redirected + c.connect6_native_redirected,
            ),
            (
                "balancer_refused",
                "Connections to a balancer closed at once because the peer is not one of this node's pods.",
                s.refused_peers,
            ),
            (
                "stale_heartbeat",
                "connect() calls to a redirected Service sent direct because the agent's heartbeat was stale (fail open).",
                c.stale_heartbeat,
            ),
            (
                "origdst_update_failed",
                "Redirected sockets whose original destination could not be recorded for getpeername.",
                c.origdst_update_failed,
            ),
            (
                "observed_connections",
                "Pod TCP connections recorded by the sock_ops hook (IPv4 and IPv6).",
                c.conn_established,
            ),
            (
                "observed_record_failed",
                "Pod TCP connections the hooks could not record or keep current (map update or callback setup failed); they go unobserved, never blocked.",
                c.conn_update_failed + c.conn_cb_flags_failed,
            ),
        ];
        for (name, help, v) in kernel {
            // No labels: encoded directly, so the line reads `name_total 3`, not `name_total{} 3`.
            let m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(v).encode(m)?;
        }

        let svc = |x: &ServiceStatus| vec![("service", x.service.clone()), ("vip", x.vip.clone())];
        let backends = || {
            s.services.iter().flat_map(move |x| {
                x.endpoints.iter().map(move |e| {
                    let mut l = svc(x);
                    l.push(("backend", e.name.clone()));
                    (l, e)
                })
            })
        };
        family(
            &mut encoder,
            "backend_requests",
            "Requests the balancer sent to a backend (probes included).",
            MetricType::Counter,
            backends().map(|(l, e)| (l, ConstCounter::new(e.requests))),
        )?;
        family(
            &mut encoder,
            "backend_failures",
            "Requests that failed on a backend.",
            MetricType::Counter,
            backends().map(|(l, e)| (l, ConstCounter::new(e.failures))),
        )?;
        family(
            &mut encoder,
            "backend_share",
            "A backend's fraction of the requests its Service port's balancer sent (0..1).",
            MetricType::Gauge,
            backends().map(|(l, e)| (l, ConstGauge::new(e.share))),
        )?;
        family(
            &mut encoder,
            "service_ready_backends",
            "Ready backends of a redirected Service port, from the model.",
            MetricType::Gauge,
            s.services
                .iter()
                .map(|x| (svc(x), count(x.ready_endpoints))),
        )?;

        let obs =
            |o: &ObservedService| vec![("service", o.service.clone()), ("vip", o.vip.clone())];
        let observed_backends = || {
            s.observed.iter().flat_map(move |o| {
                o.backends.iter().map(move |b| {
                    let mut l = obs(o);
                    l.push(("backend", b.backend.clone()));
                    (l, b)
                })
            })
        };
        family(
            &mut encoder,
            "observed_skew",
            "Largest backend share / fair share of an observed Service's pod connections (1 = even; the number of ready backends = all on one).",
            MetricType::Gauge,
            s.observed.iter().map(|o| (obs(o), ConstGauge::new(o.skew))),
        )?;
        family(
            &mut encoder,
            "observed_backends_receiving",
            "Backends of an observed Service that this node's pods send traffic to.",
            MetricType::Gauge,
            s.observed
                .iter()
                .map(|o| (obs(o), count(o.backends_receiving))),
        )?;
        family(
            &mut encoder,
            "observed_backend_share",
            "A backend's share of an observed Service's traffic from this node's pods (bytes, or open connections when idle).",
            MetricType::Gauge,
            observed_backends().map(|(l, b)| (l, ConstGauge::new(b.share))),
        )?;
        family(
            &mut encoder,
            "observed_backend_connections",
            "Open connections from this node's pods pinned to a backend of an observed Service.",
            MetricType::Gauge,
            observed_backends().map(|(l, b)| (l, count(b.open_connections))),
        )
    }
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_owned())));
    *r.status_mut() = status;
    r
}

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The agent's admin address.
    #[arg(long, default_value = "127.0.0.1:9990", env = "SKEWLESS_ADMIN_ADDR")]
    admin_addr: SocketAddr,
    /// Print the raw JSON.
    #[arg(long)]
    json: bool,
}

pub async fn status(args: StatusArgs) -> Result<()> {
    let StatusArgs { admin_addr, json } = args;
    let body = get(admin_addr, "/status").await?;
    if json {
        println!("{}", String::from_utf8_lossy(&body));
        return Ok(());
    }
    let s: Status = serde_json::from_slice(&body).context("decoding /status")?;
    println!(
        "node {}: {} connect()s seen, {} redirected",
        s.node, s.connect_seen, s.connect_redirected
    );
    println!("{:<24} {:<24}", "REDIRECT", "TO");
    for r in &s.redirects {
        println!("{:<24} {:<24}", r.service, r.target);
    }
    for o in &s.observed {
        println!(
            "\nservice {} ({}) {}: {} ready, {} receiving traffic from this node's pods, largest share {:.2}, skew {:.2}{}",
            o.service,
            o.mode,
            o.vip,
            o.ready_backends,
            o.backends_receiving,
            o.largest_share,
            o.skew,
            if o.unresolved > 0 {
                format!(", {} unresolved", o.unresolved)
            } else {
                String::new()
            }
        );
        println!(
            "  {:<22} {:>6} {:>7} {:>12} {:>12}",
            "BACKEND", "CONNS", "SHARE", "SENT B/s", "RECV B/s"
        );
        for b in &o.backends {
            println!(
                "  {:<22} {:>6} {:>7.3} {:>12.0} {:>12.0}",
                b.backend, b.open_connections, b.share, b.sent_per_sec, b.received_per_sec
            );
        }
    }
    for svc in &s.services {
        let receiving = svc.endpoints.iter().filter(|e| e.requests > 0).count();
        let largest = svc.endpoints.iter().map(|e| e.share).fold(0.0, f64::max);
        println!(
            "\nservice {} ({}) {} -> {}: {} ready, {} receiving traffic, largest share {:.2}",
            svc.service, svc.mode, svc.vip, svc.listener, svc.ready_endpoints, receiving, largest
        );
        println!(
            "  {:<12} {:<22} {:<10} {:>9} {:>8} {:>7} {:>10}",
            "BACKEND", "ADDRESS", "STATE", "REQUESTS", "FAILED", "SHARE", "EWMA ms"
        );
        for e in &svc.endpoints {
            let latency = e
                .latency_ms
                .map_or_else(|| "-".to_owned(), |l| format!("{l:.1}"));
            println!(
                "  {:<12} {:<22} {:<10} {:>9} {:>8} {:>7.3} {:>10}",
                e.name, e.addr, e.state, e.requests, e.failures, e.share, latency
            );
        }
    }
    Ok(())
}

async fn get(addr: SocketAddr, path: &str) -> Result<Bytes> {
    let stream = TcpStream::connect(addr).await.with_context(|| {
        format!("connecting to the agent's admin API at {addr} (is `skewless agent` running?)")
    })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let req = Request::get(path)
        .header("host", addr.to_string())
        .body(Full::new(Bytes::new()))?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    anyhow::ensure!(
        status.is_success(),
        "{path}: {status}: {}",
        String::from_utf8_lossy(&body)
    );
    Ok(body)
}
