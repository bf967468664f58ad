//! Turns the model's snapshots into running balancers and eBPF redirects.
//!
//! For every ClusterIP:port of a Service in `request` or `connection` mode: a balancer listens
//! on the node-local balancer address on every data-plane worker (one ephemeral port per
//! Service port, shared by the workers through `SO_REUSEPORT`), follows the port's ready
//! endpoints, and the datapath redirects the VIP:port to it. Request mode runs a balancer per
//! worker; connection mode one [`ConnectionBalancer`] shared by the workers (placement and skew
//! are per Service). The order matters for "never
//! redirect to a listener that is not serving": the listener is bound and its accept loop
//! running before the redirect entry is written, and the entry is removed before the balancer
//! drains.
//!
//! A changed tuning annotation reconfigures the running balancer in place
//! ([`Balancer::reconfigure`], [`ConnectionBalancer::reconfigure`]): every setting the
//! annotations carry applies live, so the listener, the redirect and the client connections
//! stay. A mode change (request <-> connection) is an opt-out and an opt-in: the old redirect
//! goes, the old balancer drains, a new one starts behind a new redirect.
//!
//! `observe` needs no redirect.

use std::{
    collections::{BTreeMap, HashSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, Mutex},
};

use skewless_admin::json::{ServiceStatus, UnservedService};
use skewless_balancer::{
    Balancer, CodecBalancer, Config, ConnectionBalancer, ConnectionConfig, DataPath, Endpoint,
    NewConnection, RequestBalancer, RotationConfig, Served, Workers,
};
use skewless_datapath::{Datapath, Error};
use skewless_model::{Mode, ServiceKey, ServiceState, Snapshot, Tuning};
use tokio::{sync::watch, task::JoinHandle};
use tracing::{info, info_span, warn};

use crate::{peers::PeerFilter, report};

struct Running {
    service: ServiceKey,
    listener: SocketAddr,
    state: Arc<ServiceState>,
    port: u16,
    endpoints: watch::Sender<Vec<Endpoint>>,
    balancers: Balancers,
    /// `true` tells every worker's balancer to drain.
    stop: watch::Sender<bool>,
    /// The workers' serve tasks.
    tasks: Vec<JoinHandle<()>>,
}

/// The balancers of one redirected Service port.
enum Balancers {
    /// One per data-plane worker, on the agent's data path.
    Request(Vec<Arc<dyn RequestBalancer>>),
    /// One for every worker.
    Connection(ConnectionBalancer),
}

impl Balancers {
    fn mode(&self) -> Mode {
        match self {
            Self::Request(_) => Mode::Request,
            Self::Connection(_) => Mode::Connection,
        }
    }

    /// Applies the Service's tuning to the running balancers.
    fn reconfigure(&self, state: &ServiceState) {
        match self {
            Self::Request(balancers) => {
                let config = config(state);
                for balancer in balancers {
                    balancer.reconfigure(config.clone());
                }
            }
            Self::Connection(balancer) => balancer.reconfigure(connection_config(state)),
        }
    }
}

/// The workers' request-mode balancers of either data path, as the reconciler keeps them.
fn request_balancers<B: NewConnection + RequestBalancer + 'static>(
    served: Served<B>,
) -> (
    SocketAddr,
    Vec<Arc<dyn RequestBalancer>>,
    Vec<JoinHandle<()>>,
) {
    let Served {
        addr,
        balancers,
        tasks,
    } = served;
    let balancers = balancers
        .into_iter()
        .map(|b| b as Arc<dyn RequestBalancer>)
        .collect();
    (addr, balancers, tasks)
}

/// Owns the balancers and the redirect entries derived from the model.
pub struct Reconciler {
    datapath: Arc<Mutex<dyn Redirector>>,
    workers: Arc<Workers>,
    balancer_ip: Ipv4Addr,
    balancer_ip6: Option<Ipv6Addr>,
    peers: Arc<PeerFilter>,
    /// Request mode's data path (`--data-path`).
    data_path: DataPath,
    running: BTreeMap<SocketAddr, Running>,
    /// Wanted Service ports whose last start failed: why, and since when.
    unserved: BTreeMap<SocketAddr, Unserved>,
    warned: HashSet<(ServiceKey, &'static str)>,
}

/// A wanted Service port that could not be started.
struct Unserved {
    service: ServiceKey,
    mode: Mode,
    error: String,
    since: tokio::time::Instant,
}

impl Reconciler {
    pub fn new(
        datapath: Arc<Mutex<dyn Redirector>>,
        workers: Arc<Workers>,
        balancer_ip: Ipv4Addr,
        balancer_ip6: Option<Ipv6Addr>,
        peers: Arc<PeerFilter>,
        data_path: DataPath,
    ) -> Self {
        Self {
            datapath,
            workers,
            balancer_ip,
            balancer_ip6,
            peers,
            data_path,
            running: BTreeMap::new(),
            unserved: BTreeMap::new(),
            warned: HashSet::new(),
        }
    }

    /// Brings balancers and redirects in line with `snapshot`.
    pub async fn apply(&mut self, snapshot: &Snapshot) {
        let mut wanted: BTreeMap<SocketAddr, (Arc<ServiceState>, u16)> = BTreeMap::new();
        for svc in snapshot.iter() {
            if !svc.mode.redirects() {
                continue;
            }
            for ip in &svc.cluster_ips {
                if ip.is_ipv6() && self.balancer_ip6.is_none() {
                    self.warn_once(
                        &svc.key,
                        "ipv6",
                        "no --balancer-ip6: IPv6 ClusterIPs are not redirected; IPv6 clients stay plain L4",
                    );
                    continue;
                }
                for port in &svc.ports {
                    wanted.insert(
                        SocketAddr::new(*ip, port.port),
                        (Arc::clone(svc), port.port),
                    );
                }
            }
        }

        let gone: Vec<SocketAddr> = self
            .running
            .iter()
            // A balancer whose accept loop died (it removed its own redirect) is restarted.
            .filter(|(vip, r)| {
                r.tasks.iter().any(JoinHandle::is_finished)
                    || wanted
                        .get(vip)
                        .is_none_or(|(s, _)| s.key != r.service || s.mode != r.balancers.mode())
            })
            .map(|(vip, _)| *vip)
            .collect();
        // A redirect that cannot be removed keeps its balancer serving (never a redirect to a
        // listener that stopped); the next apply tries again.
        let mut kept = HashSet::new();
        for vip in gone {
            if !self.remove_redirect(vip) {
                kept.insert(vip);
            } else if let Some(r) = self.running.remove(&vip) {
                // The drain runs on in the background; the handles are not needed.
                drop(drain(vip, r));
            }
        }

        // Only what is still wanted can be unserved.
        self.unserved.retain(|vip, _| wanted.contains_key(vip));
        for (vip, (state, port)) in wanted {
            if kept.contains(&vip) {
                continue;
            }
            if let Some(r) = self.running.get_mut(&vip) {
                if !Arc::ptr_eq(&r.state, &state) {
                    if r.state.tuning != state.tuning {
                        // Applied live: no new listener, no dropped connection.
                        info!(%vip, service = %r.service, "tuning changed; reconfiguring the balancer");
                        r.balancers.reconfigure(&state);
                    }
                    r.endpoints.send_replace(endpoints(&state, port));
                    r.state = state;
                }
                continue;
            }
            let (service, mode) = (state.key.clone(), state.mode);
            match self.start(vip, state, port).await {
                Ok(r) => {
                    info!(%vip, listener = %r.listener, service = %r.service, "redirecting to the balancer");
                    self.unserved.remove(&vip);
                    self.running.insert(vip, r);
                }
                Err(error) => {
                    let error = format!("{error:#}");
                    warn!(%vip, %error, "not redirected; the Service stays plain L4");
                    let since = self
                        .unserved
                        .get(&vip)
                        .map_or_else(tokio::time::Instant::now, |u| u.since);
                    self.unserved.insert(
                        vip,
                        Unserved {
                            service,
                            mode,
                            error,
                            since,
                        },
                    );
                }
            }
        }
    }

    async fn start(
        &self,
        vip: SocketAddr,
        state: Arc<ServiceState>,
        port: u16,
    ) -> anyhow::Result<Running> {
        let listen_ip = match (vip, self.balancer_ip6) {
            (SocketAddr::V4(_), _) => IpAddr::V4(self.balancer_ip),
            (SocketAddr::V6(_), Some(ip6)) => IpAddr::V6(ip6),
            (SocketAddr::V6(_), None) => anyhow::bail!("no IPv6 balancer address"),
        };
        let (tx, rx) = watch::channel(endpoints(&state, port));
        let (stop_tx, stop_rx) = watch::channel(false);
        let peers = Arc::clone(&self.peers);
        let datapath = Arc::clone(&self.datapath);
        let admit = move |p| peers.admit(p);
        let on_error = move |error| {
            // Never leave a redirect pointing at a listener nobody serves.
            warn!(%error, "balancer stopped; removing its redirect");
            if let Ok(mut dp) = datapath.lock() {
                let _ = dp.remove_redirect(vip);
            }
        };
        let listen = SocketAddr::new(listen_ip, 0);
        let (listen_addr, balancers, tasks) =
            info_span!("balancer", service = %state.key, %vip, mode = state.mode.as_str())
                .in_scope(|| -> std::io::Result<_> {
                    Ok(match state.mode {
                        Mode::Connection => {
                            // One balancer for every worker: its tasks run here, on the control
                            // plane; each worker relays its own connections.
                            let balancer =
                                ConnectionBalancer::new(connection_config(&state), rx.clone());
                            let Served { addr, tasks, .. } = self.workers.serve(
                                listen,
                                || balancer.clone(),
                                &stop_rx,
                                admit,
                                on_error,
                            )?;
                            (addr, Balancers::Connection(balancer), tasks)
                        }
                        Mode::Request | Mode::Observe => {
                            let config = config(&state);
                            let (addr, balancers, tasks) = match self.data_path {
                                DataPath::H2 => request_balancers(self.workers.serve(
                                    listen,
                                    || Balancer::new(config.clone(), rx.clone()),
                                    &stop_rx,
                                    admit,
                                    on_error,
                                )?),
                                DataPath::Codec => request_balancers(self.workers.serve(
                                    listen,
                                    || CodecBalancer::new(config.clone(), rx.clone()),
                                    &stop_rx,
                                    admit,
                                    on_error,
                                )?),
                            };
                            (addr, Balancers::Request(balancers), tasks)
                        }
                    })
                })
                .map_err(|e| {
                    anyhow::Error::new(e).context(format!(
                        "listening on {listen} (is {listen_ip} an address of this node?)"
                    ))
                })?;
        // Only now, with the listeners listening and served, may connects be sent here.
        let redirected = self
            .datapath
            .lock()
            .map_err(|_| anyhow::anyhow!("datapath lock poisoned"))
            .and_then(|mut dp| Ok(dp.set_redirect(vip, listen_addr)?));
        if let Err(error) = redirected {
            for task in &tasks {
                task.abort();
            }
            return Err(error);
        }
        Ok(Running {
            service: state.key.clone(),
            listener: listen_addr,
            state,
            port,
            endpoints: tx,
            balancers,
            stop: stop_tx,
            tasks,
        })
    }

    /// Removes the redirect of `vip`, so new connects go plain L4; whether it is gone.
    fn remove_redirect(&self, vip: SocketAddr) -> bool {
        match self.datapath.lock() {
            Ok(mut dp) => match dp.remove_redirect(vip) {
                Ok(()) => true,
                Err(error) => {
                    warn!(%vip, %error, "cannot remove the redirect; its balancer keeps serving");
                    false
                }
            },
            Err(_) => {
                warn!(%vip, "datapath lock poisoned; redirect left in place");
                false
            }
        }
    }

    /// Removes every redirect, then drains every balancer (bounded by its drain grace).
    pub async fn shutdown(&mut self) {
        let all = std::mem::take(&mut self.running);
        // A redirect that cannot be removed goes when the process exits and its links close.
        let tasks: Vec<JoinHandle<()>> = all
            .into_iter()
            .flat_map(|(vip, r)| {
                self.remove_redirect(vip);
                drain(vip, r)
            })
            .collect();
        for task in tasks {
            let _ = task.await;
        }
    }

    /// Per Service port: where it is redirected and how its endpoints are doing.
    pub fn status(&self) -> Vec<ServiceStatus> {
        self.running
            .iter()
            .map(|(vip, r)| {
                let ready_endpoints = r.state.port(r.port).map_or(0, |p| p.ready().count());
                match &r.balancers {
                    Balancers::Request(balancers) => report::service_status(report::Port {
                        service: r.service.to_string(),
                        mode: Mode::Request.as_str(),
                        vip: vip.to_string(),
                        listener: r.listener.to_string(),
                        ready_endpoints,
                        balancers,
                    }),
                    Balancers::Connection(balancer) => report::connection_status(
                        r.service.to_string(),
                        vip.to_string(),
                        r.listener.to_string(),
                        ready_endpoints,
                        balancer,
                    ),
                }
            })
            .collect()
    }

    /// The wanted Service ports that cannot be served, with the last error.
    pub fn unserved(&self) -> Vec<UnservedService> {
        self.unserved
            .iter()
            .map(|(vip, u)| UnservedService {
                service: u.service.to_string(),
                mode: u.mode.as_str().to_owned(),
                vip: vip.to_string(),
                error: u.error.clone(),
                since_seconds: u.since.elapsed().as_secs_f64(),
            })
            .collect()
    }

    fn warn_once(&mut self, key: &ServiceKey, what: &'static str, message: &str) {
        if self.warned.insert((key.clone(), what)) {
            warn!(service = %key, "{message}");
        }
    }
}

/// Lets the balancer of `vip`, whose redirect is gone, drain its client connections.
fn drain(vip: SocketAddr, r: Running) -> Vec<JoinHandle<()>> {
    info!(%vip, service = %r.service, "no longer redirected; draining the balancer");
    let _ = r.stop.send(true);
    r.tasks
}

/// The datapath as the reconciler uses it: redirect entries per Service address. The agent's
/// is the kernel's [`Datapath`]; the unit tests use a recording fake, so the reconciler's
/// orderings ("listener before redirect", "redirect removed before drain") and its failure
/// handling are tested without privileges.
pub trait Redirector: Send {
    /// Makes the next connect() to `service` go to `target` (same address family).
    ///
    /// # Errors
    /// When the entry cannot be written (full map, families differ); nothing is redirected.
    fn set_redirect(&mut self, service: SocketAddr, target: SocketAddr) -> Result<(), Error>;

    /// Stops redirecting `service`; removing one that is not redirected is not an error.
    ///
    /// # Errors
    /// When the entry cannot be removed; it stays in effect.
    fn remove_redirect(&mut self, service: SocketAddr) -> Result<(), Error>;
}

impl Redirector for Datapath {
    fn set_redirect(&mut self, service: SocketAddr, target: SocketAddr) -> Result<(), Error> {
        Datapath::set_redirect(self, service, target)
    }

    fn remove_redirect(&mut self, service: SocketAddr) -> Result<(), Error> {
        Datapath::remove_redirect(self, service)
    }
}

/// The ready endpoints of one Service port, as the balancer wants them.
fn endpoints(state: &ServiceState, port: u16) -> Vec<Endpoint> {
    state.port(port).map_or_else(Vec::new, |p| {
        p.ready()
            .map(|e| {
                Endpoint::new(
                    e.addr,
                    e.target_name.clone().unwrap_or_else(|| e.addr.to_string()),
                )
            })
            .collect()
    })
}

/// Connection-mode settings from the Service's tuning annotations.
fn connection_config(state: &ServiceState) -> ConnectionConfig {
    // Exhaustive, so a new annotation does not compile until it is handled here.
    let Tuning {
        skew_threshold,
        hold_time,
        max_rotations_per_minute,
        max_connection_age,
        grpc_health_service,
        // A relay does not see calls, so it cannot retry them: the clients' own retries stand.
        retryable_methods: _,
    } = &state.tuning;
    ConnectionConfig {
        rotation: RotationConfig {
            skew_threshold: *skew_threshold,
            hold_time: *hold_time,
            max_rotations_per_minute: *max_rotations_per_minute,
            ..RotationConfig::default()
        },
        health_service: grpc_health_service.clone(),
        max_connection_age: *max_connection_age,
        ..ConnectionConfig::default()
    }
}

/// Request-mode balancer settings from the Service's tuning annotations.
fn config(state: &ServiceState) -> Config {
    // Exhaustive, so a new annotation does not compile until it is handled here.
    let Tuning {
        // Connection mode's rotation policy; the request balancer has no use for them.
        skew_threshold: _,
        hold_time: _,
        max_rotations_per_minute: _,
        max_connection_age,
        grpc_health_service,
        retryable_methods,
    } = &state.tuning;
    Config {
        health_service: grpc_health_service.clone(),
        max_connection_age: *max_connection_age,
        retryable_methods: retryable_methods
            .iter()
            .map(|m| match &m.method {
                Some(method) => format!("/{}/{method}", m.service),
                None => format!("/{}/", m.service),
            })
            .collect(),
        ..Config::default()
    }
}

#[cfg(test)]
mod tests;
