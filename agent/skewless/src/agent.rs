//! `skewless agent`: flags, start-up and shutdown.
//!
//! A source (the Kubernetes API with `--kubernetes`, or a services file) feeds the model;
//! `--redirect` flags add raw redirects beside it. The [`Reconciler`] turns each snapshot into
//! balancers and eBPF redirects, the observer reports where unbalanced connections are
//! pinned, a heartbeat task keeps the hooks redirecting only while every data-plane worker
//! runs, and the admin API serves `/live`, `/ready`, `/status` and `/metrics`. On SIGTERM the
//! redirects go first, then the balancers drain.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4},
    path::{Path, PathBuf},
    str::FromStr,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context as _, Result};
use skewless_balancer::{DataPath, Workers};
use skewless_datapath::Datapath;
use tokio::signal::unix::{SignalKind, signal};
use tracing::{Instrument as _, info, info_span};

use crate::{
    admin,
    node::BalancerAddresses,
    observer,
    peers::{Cidr, PeerFilter},
    reconcile::{Reconciler, Redirector},
    stall::StallCounts,
};

/// The node-local address the balancers listen on: a /32 on the node's `lo`, reachable from
/// the node's pods through their default route.
pub const DEFAULT_BALANCER_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 77, 1);

/// The local admin API's address (`skewless status` asks it by default).
pub const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:9991";

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Pod cgroup (cgroup v2 directory) to attach the socket hooks to. Repeatable. Never the
    /// root of the hierarchy: that would redirect every process on the machine.
    #[arg(long = "cgroup", value_name = "DIR")]
    cgroups: Vec<PathBuf>,
    /// Host cgroup v2 hierarchy (the DaemonSet mounts it at /run/skewless/cgroup): the hooks
    /// attach to the kubelet's pod parent cgroup found below it (`kubepods.slice` with the
    /// systemd driver, `kubepods` with cgroupfs, kind's `kubelet.slice/kubelet-kubepods.slice`,
    /// or the same under a custom kubelet cgroup root, up to 3 levels down), which covers
    /// every pod on the node, present and future. Never the hierarchy root. Elsewhere: name
    /// the pod parent with `--cgroup`.
    #[arg(long, value_name = "DIR")]
    pod_cgroup_root: Option<PathBuf>,
    /// Services and endpoints from a YAML file (see agent/services-file/examples/services.yaml),
    /// re-read when it changes. Services in `request` mode get a balancer and a redirect.
    #[arg(long, value_name = "FILE", env = "SKEWLESS_SERVICES_FILE")]
    services_file: Option<PathBuf>,
    /// Read Services and EndpointSlices from the Kubernetes API (in-cluster config, or the
    /// kubeconfig), with watches. `/ready` answers 503 until the first full list is in.
    #[arg(long, conflicts_with = "services_file")]
    kubernetes: bool,
    /// Node-local IPv4 address the balancers listen on. Added to `lo` (label `lo:skewless`)
    /// when no interface has it, and removed at exit by the last agent using it.
    #[arg(long, default_value_t = DEFAULT_BALANCER_IP, env = "SKEWLESS_BALANCER_IP")]
    balancer_ip: Ipv4Addr,
    /// Node-local IPv6 address for the balancers of IPv6 ClusterIPs, added to `lo` when no
    /// interface has it. Without it, IPv6 ClusterIPs are not redirected.
    #[arg(long, env = "SKEWLESS_BALANCER_IP6")]
    balancer_ip6: Option<std::net::Ipv6Addr>,
    /// Network whose peers may use the balancers: this node's pod CIDR(s). Repeatable. With
    /// `--kubernetes` the Node's `spec.podCIDRs` are added. Other peers are refused and
    /// counted; with no network known at all, every peer is admitted (and the agent warns).
    #[arg(long = "pod-cidr", value_name = "CIDR")]
    pod_cidrs: Vec<Cidr>,
    /// Raw redirect of a Service address to a listener, `VIP:PORT=ADDR:PORT`, bypassing the
    /// model. Repeatable. For tests and debugging.
    #[arg(long = "redirect", value_name = "VIP:PORT=ADDR:PORT")]
    redirects: Vec<Redirect>,
    /// Data-plane worker threads. Each runs a single-threaded runtime with its own balancer
    /// per Service (own picker, own upstream connections) on a shared `SO_REUSEPORT`
    /// listener, so the kernel spreads client connections over them. One worker carries tens
    /// of thousands of calls per second (docs/benchmarks.md); add workers when a node's
    /// balanced traffic needs more than one core.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64), env = "SKEWLESS_BALANCER_THREADS")]
    balancer_threads: u16,
    /// Request mode's data path: `h2` (the default), or `codec`, the EXPERIMENTAL one on the
    /// project's own HTTP/2 frame codec (docs/configuration.md: what it has and lacks).
    #[arg(long, default_value_t = DataPath::H2, env = "SKEWLESS_DATA_PATH")]
    data_path: DataPath,
    /// Address of the whole admin API (/status, /metrics, /live, /ready), `skewless status`
    /// asks it. Local by default: /status lists every Service, VIP and backend of the node,
    /// so keep it on loopback; other hosts get metrics and probes from `--metrics-addr`.
    #[arg(long, default_value = DEFAULT_ADMIN_ADDR, env = "SKEWLESS_ADMIN_ADDR")]
    admin_addr: SocketAddr,
    /// Address for other hosts: /metrics, /live and /ready only (the DaemonSet serves
    /// Prometheus and the kubelet's probes on 0.0.0.0:9990). Unset: no such listener.
    #[arg(long, env = "SKEWLESS_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// This node's name (from the downward API in the DaemonSet).
    #[arg(long, env = "NODE_NAME", default_value = "local")]
    node_name: String,
    /// The agent container's CPU request, in millicores (the DaemonSet passes it from the
    /// downward API), exported so its cost can be alerted on against it.
    #[arg(long, env = "SKEWLESS_CPU_REQUEST_MILLICORES")]
    cpu_request_millicores: Option<u64>,
    /// Its CPU limit, in millicores.
    #[arg(long, env = "SKEWLESS_CPU_LIMIT_MILLICORES")]
    cpu_limit_millicores: Option<u64>,
    /// Its memory request, in bytes.
    #[arg(long, env = "SKEWLESS_MEMORY_REQUEST_BYTES")]
    memory_request_bytes: Option<u64>,
    /// Its memory limit, in bytes.
    #[arg(long, env = "SKEWLESS_MEMORY_LIMIT_BYTES")]
    memory_limit_bytes: Option<u64>,
    /// For tests of the programs' failure paths: make the kernel refuse their record inserts
    /// (connects still go through; getpeername shows the balancer, connections go
    /// unobserved), so the failures are counted and logged.
    #[arg(long, hide = true)]
    provoke_map_update_failures: bool,
}

#[derive(Clone, Copy, Debug)]
pub struct Redirect {
    service: SocketAddrV4,
    target: SocketAddrV4,
}

/// Why a `--redirect` value is not `VIP:PORT=ADDR:PORT`.
#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    #[error("expected VIP:PORT=ADDR:PORT, got {input:?}")]
    NoTarget { input: String },
    #[error("{part:?} is not an IPv4 address:port")]
    Addr {
        part: String,
        #[source]
        source: std::net::AddrParseError,
    },
}

impl FromStr for Redirect {
    type Err = RedirectError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (service, target) = s.split_once('=').ok_or_else(|| RedirectError::NoTarget {
            input: s.to_owned(),
        })?;
        let parse = |part: &str| {
            part.parse::<SocketAddrV4>()
                .map_err(|source| RedirectError::Addr {
                    part: part.to_owned(),
                    source,
                })
        };
        Ok(Self {
            service: parse(service)?,
            target: parse(target)?,
        })
    }
}

pub async fn run(args: Args) -> Result<()> {
    let Args {
        cgroups,
        pod_cgroup_root,
        services_file,
        kubernetes,
        balancer_ip,
        balancer_ip6,
        pod_cidrs,
        redirects,
        admin_addr,
        metrics_addr,
        node_name,
        balancer_threads,
        data_path,
        cpu_request_millicores,
        cpu_limit_millicores,
        memory_request_bytes,
        memory_limit_bytes,
        provoke_map_update_failures,
    } = args;
    if data_path == DataPath::Codec {
        tracing::warn!(
            "request mode runs on the EXPERIMENTAL frame codec data path (--data-path codec)"
        );
    }
    let resources = skewless_admin::json::Resources {
        cpu_request_cores: cpu_request_millicores.map(|m| m as f64 / 1000.0),
        cpu_limit_cores: cpu_limit_millicores.map(|m| m as f64 / 1000.0),
        memory_request_bytes,
        memory_limit_bytes,
    };
    let cgroups = attach_points(cgroups, pod_cgroup_root.as_deref())?;
    let mut datapath = load_datapath(&cgroups, &redirects)?;
    if provoke_map_update_failures {
        tracing::warn!("provoking the programs' map update failures (a test flag)");
        datapath.provoke_insert_failures()?;
    }
    // The programs' lines about their rare failures, into this log.
    if let Some(logs) = datapath.take_logs() {
        logs.forward()
            .context("starting the thread that forwards the programs' log lines")?;
    }
    let datapath = Arc::new(Mutex::new(datapath));
    let addresses = Arc::new(BalancerAddresses::new(
        std::iter::once(IpAddr::V4(balancer_ip))
            .chain(balancer_ip6.map(IpAddr::V6))
            .collect(),
    ));
    addresses.ensure().await;
    let (workers, stalls) = start_workers(balancer_threads, &datapath)?;
    let model_metrics = skewless_model::Metrics::default();
    let metrics =
        skewless_admin::collector::Metrics::new(&model_metrics, env!("CARGO_PKG_VERSION"));
    if pod_cidrs.is_empty() && !kubernetes {
        tracing::warn!(
            "no --pod-cidr: the balancers admit connections from any peer that reaches them"
        );
    }
    let peers = Arc::new(PeerFilter::new(pod_cidrs.clone()));
    // The reconciler sees the datapath as a `Redirector` only.
    let redirector: Arc<Mutex<dyn Redirector>> = datapath.clone();
    let reconciler = Arc::new(tokio::sync::Mutex::new(Reconciler::new(
        redirector,
        Arc::clone(&workers),
        balancer_ip,
        balancer_ip6,
        Arc::clone(&peers),
        data_path,
    )));
    let source = if let Some(path) = services_file {
        Some(file_source(path, model_metrics))
    } else if kubernetes {
        Some(kubernetes_source(node_name.clone(), pod_cidrs, &peers, model_metrics).await?)
    } else {
        None
    };
    let observed = Arc::new(observer::Published::default());
    let model = source.map(|Source { snapshots, model }| {
        tokio::spawn(
            observer::run(
                Arc::clone(&datapath),
                snapshots.clone(),
                Arc::clone(&observed),
            )
            .instrument(info_span!("observer")),
        );
        tokio::spawn(
            reconcile(
                Arc::clone(&reconciler),
                Arc::clone(&addresses),
                snapshots,
                model.synced.clone(),
            )
            .instrument(info_span!("reconcile")),
        );
        model
    });

    info!(node = %node_name, cgroups = cgroups.len(), redirects = redirects.len(), "agent ready");
    let state = Arc::new(admin::State::new(admin::Sources {
        peers: Arc::clone(&peers),
        node: node_name,
        datapath: Arc::clone(&datapath),
        reconciler: Arc::clone(&reconciler),
        metrics,
        model,
        observed,
        workers: admin::WorkerFigures { workers, stalls },
        resources,
    }));
    tokio::spawn(
        Arc::clone(&state)
            .follow_window()
            .instrument(info_span!("window")),
    );
    let mut servers = serve_admin(admin_addr, metrics_addr, &state).await?;
    until_told_to_stop(&mut servers).await?;
    // Free the admin addresses first: a successor agent (a rolling update) binds them while
    // this one drains.
    servers.abort_all();
    reconciler.lock().await.shutdown().await;
    // Drained: the address goes unless a successor claims it.
    addresses.release().await;
    // Returning drops the datapath, which closes every bpf_link: pods connect directly again.
    // A SIGKILL has the same effect, because the kernel closes the links with the process.
    Ok(())
}

/// The cgroups the hooks attach to: the `--cgroup` flags, and the kubelet's pod parent under
/// `--pod-cgroup-root`; each checked to be a cgroup v2 directory below the hierarchy root.
fn attach_points(
    mut cgroups: Vec<PathBuf>,
    pod_cgroup_root: Option<&Path>,
) -> Result<Vec<PathBuf>> {
    if let Some(root) = pod_cgroup_root {
        cgroups.push(crate::node::pods_parent(root)?);
    }
    for cg in &cgroups {
        // Before anything is loaded; `attach` checks it again.
        skewless_datapath::ensure_child_cgroup(cg)?;
    }
    Ok(cgroups)
}

/// Loads the eBPF programs, writes the raw `--redirect` entries, excludes the agent's own
/// cgroup, attaches to `cgroups` and beats once, so the hooks redirect from the first connect.
fn load_datapath(cgroups: &[PathBuf], redirects: &[Redirect]) -> Result<Datapath> {
    let mut datapath = Datapath::load().map_err(|error| {
        let context = crate::privileges::load_failure_context(
            crate::privileges::is_eperm(&error),
            crate::privileges::Privileges::of_this_process(),
        );
        anyhow::Error::new(error).context(context)
    })?;
    for Redirect { service, target } in redirects {
        datapath.set_redirect(*service, *target)?;
    }
    // The hooks cover every pod, this agent's own included: its own connects (its Kubernetes
    // client to the `kubernetes` VIP) must never be redirected to its own balancers.
    match skewless_datapath::own_cgroup()
        .and_then(|cg| datapath.exclude_cgroup(&cg).map(|id| (cg, id)))
    {
        Ok((cg, id)) => info!(cgroup = %cg.display(), id, "own cgroup excluded from redirects"),
        Err(error) => tracing::warn!(
            error = %error,
            "own cgroup not excluded: an opted-in Service this agent itself uses would be redirected"
        ),
    }
    for cg in cgroups {
        // Attachments stay for the agent's lifetime; they end with the process.
        let _attachment = datapath.attach(cg)?;
    }
    datapath.beat().context("first heartbeat")?;
    Ok(datapath)
}

/// Starts the data-plane worker threads and the heartbeat that keeps the hooks redirecting
/// only while they all run.
fn start_workers(
    threads: u16,
    datapath: &Arc<Mutex<Datapath>>,
) -> Result<(Arc<Workers>, Arc<StallCounts>)> {
    let workers = Arc::new(
        Workers::start(usize::from(threads), "skewless-dp")
            .context("starting the data-plane worker threads")?,
    );
    let stalls = Arc::new(StallCounts::new(workers.len()));
    tokio::spawn(
        heartbeat(
            Arc::clone(datapath),
            Arc::clone(&workers),
            Arc::clone(&stalls),
        )
        .instrument(info_span!("heartbeat")),
    );
    Ok((workers, stalls))
}

/// A model source: its snapshots, and whether it has delivered a complete model yet.
struct Source {
    snapshots: tokio::sync::watch::Receiver<skewless_model::Snapshot>,
    model: admin::Readiness,
}

/// Services and endpoints from a file, re-read when it changes.
fn file_source(path: PathBuf, model_metrics: skewless_model::Metrics) -> Source {
    let source = skewless_services_file::FileSource::new(
        path.clone(),
        Duration::from_secs(1),
        model_metrics,
    );
    let model = admin::Readiness {
        synced: source.synced(),
        waiting_for: format!("waiting for a valid services file at {}", path.display()),
    };
    let snapshots = source.snapshots();
    tokio::spawn(source.run().instrument(info_span!("services_file")));
    Source { snapshots, model }
}

/// Services and EndpointSlices from the Kubernetes API; the own Node's pod CIDRs join the
/// `--pod-cidr` flags in `peers` whenever the Node changes.
async fn kubernetes_source(
    node_name: String,
    pod_cidrs: Vec<Cidr>,
    peers: &Arc<PeerFilter>,
    model_metrics: skewless_model::Metrics,
) -> Result<Source> {
    let client = kube::Client::try_default()
        .await
        .context("building the Kubernetes client (in-cluster config or kubeconfig)")?;
    let config = skewless_k8s::Config { node_name };
    let discovery = skewless_k8s::Discovery::new(client, config, model_metrics);
    let model = admin::Readiness {
        synced: discovery.synced(),
        waiting_for: "waiting for the first full list of Services and EndpointSlices from \
                      the Kubernetes API"
            .to_owned(),
    };
    let mut node = discovery.node();
    let peers = Arc::clone(peers);
    tokio::spawn(async move {
        loop {
            let mut cidrs = pod_cidrs.clone();
            if let Some(info) = node.borrow_and_update().as_ref() {
                cidrs.extend(info.pod_cidrs.iter().filter_map(|c| c.parse::<Cidr>().ok()));
            }
            peers.set(cidrs);
            if node.changed().await.is_err() {
                return;
            }
        }
    });
    let snapshots = discovery.snapshots();
    tokio::spawn(discovery.run().instrument(info_span!("discovery")));
    Ok(Source { snapshots, model })
}

/// Applies every snapshot to the reconciler, once the source has delivered a complete model,
/// and again every 5 s so a balancer that died is restarted even if the Services do not change.
async fn reconcile(
    reconciler: Arc<tokio::sync::Mutex<Reconciler>>,
    addresses: Arc<BalancerAddresses>,
    mut snapshots: tokio::sync::watch::Receiver<skewless_model::Snapshot>,
    mut synced: tokio::sync::watch::Receiver<bool>,
) {
    // Fail open until the source has delivered a complete model: an unreadable file, an
    // unreachable API server, or a Service listed before its EndpointSlices must never
    // redirect anything (a balancer without endpoints would fail every call).
    if !*synced.borrow_and_update() {
        info!("no model yet: nothing is redirected until the source delivers one");
    }
    while !*synced.borrow_and_update() {
        if synced.changed().await.is_err() {
            return;
        }
    }
    info!("model complete: reconciling");
    loop {
        let snapshot = snapshots.borrow_and_update().clone();
        // The listeners need the balancer address: claimed late, or added back if removed.
        addresses.ensure().await;
        reconciler.lock().await.apply(&snapshot).await;
        tokio::select! {
            changed = snapshots.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
    }
}

/// Binds the local admin listener and, with `--metrics-addr`, the public one, and serves them.
async fn serve_admin(
    admin_addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    state: &Arc<admin::State>,
) -> Result<tokio::task::JoinSet<Result<()>>> {
    if !admin_addr.ip().is_loopback() {
        tracing::warn!(
            %admin_addr,
            "the admin API is not on loopback: /status (every Service, VIP and backend of this \
             node) answers whoever reaches it"
        );
    }
    let mut servers = tokio::task::JoinSet::new();
    for (addr, scope) in std::iter::once((admin_addr, admin::Scope::Local))
        .chain(metrics_addr.map(|a| (a, admin::Scope::Public)))
    {
        let listener = admin::bind(addr, scope).await?;
        info!(%addr, ?scope, "admin API listening");
        servers.spawn(
            admin::serve(listener, scope, Arc::clone(state))
                .instrument(info_span!("admin", ?scope)),
        );
    }
    Ok(servers)
}

/// Waits for SIGTERM or Ctrl-C; an admin server that stops on its own is an error.
async fn until_told_to_stop(servers: &mut tokio::task::JoinSet<Result<()>>) -> Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: removing redirects, draining balancers"),
        _ = tokio::signal::ctrl_c() => info!("interrupted: removing redirects, draining balancers"),
        Some(res) = servers.join_next() => res.context("admin server task")?.context("admin server")?,
    }
    Ok(())
}

/// Tells the hooks the agent is alive, every 200 ms, while every data-plane worker runs its
/// tasks: if a worker hangs, the control runtime hangs, or the process is stopped, the
/// heartbeat goes stale and new connections go straight to the Service within a second.
async fn heartbeat(
    datapath: Arc<Mutex<Datapath>>,
    workers: Arc<Workers>,
    stalls: Arc<StallCounts>,
) {
    const EVERY: Duration = Duration::from_millis(200);
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watch = crate::stall::StallWatch::new(stalls);
    let mut last = tokio::time::Instant::now();
    loop {
        tick.tick().await;
        // The control runtime itself late (starved or busy): the hooks' 750 ms limit may have
        // passed whatever the workers did.
        let gap = last.elapsed();
        last = tokio::time::Instant::now();
        if gap > 3 * EVERY {
            tracing::warn!(
                gap_ms = gap.as_millis(),
                "heartbeat ran late: redirects may have failed open"
            );
        }
        // Workers tick every 100 ms; 400 ms without one leaves the hooks' 750 ms staleness
        // limit enough room to fail open within a second.
        let max = Duration::from_millis(400);
        if workers.stalled(max) {
            watch.stalled(&workers.liveness(), max);
            continue;
        }
        watch.running(&workers.liveness());
        let result = datapath
            .lock()
            .map_err(|_| None)
            .and_then(|mut d| d.beat().map_err(Some));
        match result {
            Ok(()) => {}
            Err(Some(error)) => tracing::warn!(%error, "heartbeat"),
            Err(None) => {
                tracing::error!("datapath lock poisoned; heartbeat stops, redirects fail open");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirect_flag_parses_and_rejects_garbage() {
        let r: Redirect = "198.19.0.10:8080=169.254.77.1:15001".parse().unwrap();
        assert_eq!(r.service, "198.19.0.10:8080".parse().unwrap());
        assert_eq!(r.target, "169.254.77.1:15001".parse().unwrap());
        assert!(
            matches!(
                "198.19.0.10:8080".parse::<Redirect>(),
                Err(RedirectError::NoTarget { .. })
            ),
            "missing target must fail"
        );
        assert!(
            matches!("a=b".parse::<Redirect>(), Err(RedirectError::Addr { part, .. }) if part == "a"),
            "non-addresses must fail, naming the part"
        );
    }
}
