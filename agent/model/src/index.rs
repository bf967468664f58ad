//! The index: applies source events (apply, delete, reset on relist) and publishes the
//! resulting per-Service state through a [`tokio::sync::watch`] channel.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::{
    ConfigErrors, Mode, Tuning,
    endpoints::{self, Endpoint, SliceData, SliceInput, SliceKey},
    metrics::Metrics,
    service::{ServiceConfig, ServiceInput, ServiceKey, TargetPort},
};

/// Everything the datapath and the balancer need to know about one opted-in Service.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceState {
    pub key: ServiceKey,
    pub mode: Mode,
    pub tuning: Tuning,
    /// IPv4 and IPv6 ClusterIPs (dual-stack Services have both).
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<PortState>,
}

/// One Service port and its endpoints (all conditions; filter with [`PortState::ready`]).
#[derive(Clone, Debug, PartialEq)]
pub struct PortState {
    pub name: String,
    pub port: u16,
    pub target_port: TargetPort,
    /// Sorted by address; IPv4 and IPv6 endpoints of a dual-stack Service together.
    pub endpoints: Vec<Endpoint>,
}

impl PortState {
    /// Endpoints that should receive new requests.
    pub fn ready(&self) -> impl Iterator<Item = &Endpoint> {
        self.endpoints.iter().filter(|e| e.conditions.ready)
    }
}

impl ServiceState {
    /// Every ClusterIP:port of the Service, the addresses the datapath matches on.
    pub fn vips(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.cluster_ips
            .iter()
            .flat_map(|ip| self.ports.iter().map(|p| SocketAddr::new(*ip, p.port)))
    }

    /// The port with this Service port number.
    #[must_use]
    pub fn port(&self, port: u16) -> Option<&PortState> {
        self.ports.iter().find(|p| p.port == port)
    }
}

/// The state of every opted-in Service with a good config, as published. Cheap to clone.
///
/// A Service whose state did not change keeps the same `Arc<ServiceState>` from one snapshot to
/// the next, so a per-Service consumer (a balancer) detects its own changes with
/// [`Arc::ptr_eq`] instead of comparing endpoint lists.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    services: Arc<BTreeMap<ServiceKey, Arc<ServiceState>>>,
}

/// A ClusterIP:port the datapath acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vip {
    pub addr: SocketAddr,
    pub mode: Mode,
    pub service: ServiceKey,
}

impl Snapshot {
    #[must_use]
    pub fn get(&self, key: &ServiceKey) -> Option<&Arc<ServiceState>> {
        self.services.get(key)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<ServiceState>> {
        self.services.values()
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.services.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }

    /// The datapath's view: every VIP:port with its mode, sorted by address.
    #[must_use]
    pub fn vips(&self) -> Vec<Vip> {
        let mut v: Vec<Vip> = self
            .iter()
            .flat_map(|s| {
                s.vips().map(|addr| Vip {
                    addr,
                    mode: s.mode,
                    service: s.key.clone(),
                })
            })
            .collect();
        v.sort_by_key(|v| v.addr);
        v
    }
}

/// A newly rejected Service config, returned once per distinct error so that the caller posts
/// one Kubernetes Event (the index has already logged it and counted it).
#[derive(Clone, Debug, PartialEq)]
pub struct Rejection {
    pub service: ServiceKey,
    pub error: ConfigErrors,
    /// Whether an earlier good config is still in effect (false: the Service is not served).
    pub kept_last_good: bool,
}

/// What the index knows about one Service with `skewless.io/mode`.
#[derive(Debug, Default)]
struct ServiceEntry {
    last_good: Option<Arc<ServiceConfig>>,
    /// The last error reported, so the same error is reported only once.
    reported: Option<ConfigErrors>,
}

/// Owns the model and the publishing side of the snapshot channel. Not shared: one task feeds
/// it from a source (Kubernetes watchers or the local file).
#[derive(Debug)]
pub struct Index {
    services: HashMap<ServiceKey, ServiceEntry>,
    /// Slices of every Service, opted in or not, so opting in later needs no relist. Kept in the
    /// compact [`SliceData`] form.
    slices: HashMap<ServiceKey, BTreeMap<String, SliceData>>,
    slice_owner: HashMap<SliceKey, ServiceKey>,
    dirty: BTreeSet<ServiceKey>,
    tx: watch::Sender<Snapshot>,
    metrics: Metrics,
}

impl Index {
    #[must_use]
    pub fn new(metrics: Metrics) -> Self {
        Self {
            services: HashMap::new(),
            slices: HashMap::new(),
            slice_owner: HashMap::new(),
            dirty: BTreeSet::new(),
            tx: watch::Sender::new(Snapshot::default()),
            metrics,
        }
    }

    /// The metrics this index counts into (sources count their own failures here too).
    #[must_use]
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// A receiver of published snapshots; `has_changed` flips only when some Service's state
    /// actually changed.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<Snapshot> {
        self.tx.subscribe()
    }

    /// Applies a created or updated Service. Returns a [`Rejection`] the first time a given
    /// error is seen for this Service.
    pub fn apply_service(&mut self, svc: &ServiceInput) -> Option<Rejection> {
        let r = self.apply_service_inner(svc);
        self.publish();
        r
    }

    /// Forgets a deleted Service.
    pub fn delete_service(&mut self, key: &ServiceKey) {
        if self.services.remove(key).is_some() {
            self.dirty.insert(key.clone());
        }
        self.publish();
    }

    /// Replaces all Services (a watcher relist): Services absent from `svcs` are forgotten.
    pub fn reset_services<'a>(
        &mut self,
        svcs: impl IntoIterator<Item = &'a ServiceInput>,
    ) -> Vec<Rejection> {
        let r = self.reset_services_inner(svcs);
        self.publish();
        r
    }

    /// Applies a created or updated EndpointSlice.
    pub fn apply_slice(&mut self, slice: &SliceInput) {
        self.apply_slice_inner(slice);
        self.publish();
    }

    /// Forgets a deleted EndpointSlice.
    pub fn delete_slice(&mut self, key: &SliceKey) {
        self.delete_slice_inner(key);
        self.publish();
    }

    /// Replaces all EndpointSlices (a watcher relist).
    pub fn reset_slices<'a>(&mut self, slices: impl IntoIterator<Item = &'a SliceInput>) {
        self.reset_slices_inner(slices);
        self.publish();
    }

    /// Replaces everything at once and publishes once (the local file source).
    pub fn reset<'a>(
        &mut self,
        svcs: impl IntoIterator<Item = &'a ServiceInput>,
        slices: impl IntoIterator<Item = &'a SliceInput>,
    ) -> Vec<Rejection> {
        self.reset_slices_inner(slices);
        let r = self.reset_services_inner(svcs);
        self.publish();
        r
    }

    fn apply_service_inner(&mut self, svc: &ServiceInput) -> Option<Rejection> {
        let key = &svc.key;
        match svc.config() {
            Ok(None) => {
                if self.services.remove(key).is_some() {
                    info!(service = %key, "service opted out");
                    self.dirty.insert(key.clone());
                }
                None
            }
            Ok(Some(config)) => {
                let entry = self.services.entry(key.clone()).or_default();
                if entry.reported.take().is_some() {
                    info!(service = %key, "service config valid again");
                }
                if entry.last_good.as_deref() != Some(&config) {
                    debug!(service = %key, mode = %config.mode, "service config applied");
                    entry.last_good = Some(Arc::new(config));
                    self.dirty.insert(key.clone());
                }
                None
            }
            Err(error) => {
                let entry = self.services.entry(key.clone()).or_default();
                if entry.reported.as_ref() == Some(&error) {
                    return None;
                }
                let kept_last_good = entry.last_good.is_some();
                warn!(service = %key, %error, reason = error.reason(), problems = error.len(), kept_last_good, "service config rejected");
                self.metrics.rejected(error.reason());
                entry.reported = Some(error.clone());
                Some(Rejection {
                    service: key.clone(),
                    error,
                    kept_last_good,
                })
            }
        }
    }

    fn reset_services_inner<'a>(
        &mut self,
        svcs: impl IntoIterator<Item = &'a ServiceInput>,
    ) -> Vec<Rejection> {
        let mut seen = BTreeSet::new();
        let mut rejections = Vec::new();
        for svc in svcs {
            seen.insert(svc.key.clone());
            rejections.extend(self.apply_service_inner(svc));
        }
        let gone: Vec<ServiceKey> = self
            .services
            .keys()
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect();
        for key in gone {
            self.services.remove(&key);
            self.dirty.insert(key);
        }
        rejections
    }

    fn apply_slice_inner(&mut self, slice: &SliceInput) {
        // A slice whose service-name label changed moves: drop it from its old owner first.
        self.delete_slice_inner(&slice.key);
        let Some(service) = &slice.service_name else {
            return;
        };
        let owner = ServiceKey::new(slice.key.namespace.clone(), service.clone());
        self.slices
            .entry(owner.clone())
            .or_default()
            .insert(slice.key.name.clone(), SliceData::from_input(slice));
        self.slice_owner.insert(slice.key.clone(), owner.clone());
        self.dirty.insert(owner);
    }

    fn delete_slice_inner(&mut self, key: &SliceKey) {
        let Some(owner) = self.slice_owner.remove(key) else {
            return;
        };
        if let Some(slices) = self.slices.get_mut(&owner) {
            slices.remove(&key.name);
            if slices.is_empty() {
                self.slices.remove(&owner);
            }
        }
        self.dirty.insert(owner);
    }

    fn reset_slices_inner<'a>(&mut self, slices: impl IntoIterator<Item = &'a SliceInput>) {
        self.dirty.extend(self.slices.drain().map(|(k, _)| k));
        self.slice_owner.clear();
        for s in slices {
            self.apply_slice_inner(s);
        }
    }

    fn state(&self, key: &ServiceKey) -> Option<ServiceState> {
        let config = self.services.get(key)?.last_good.as_ref()?;
        let slices = self.slices.get(key);
        let ports = config
            .ports
            .iter()
            .map(|p| PortState {
                name: p.name.clone(),
                port: p.port,
                target_port: p.target_port.clone(),
                endpoints: endpoints::merge(p, slices.into_iter().flat_map(BTreeMap::values)),
            })
            .collect();
        Some(ServiceState {
            key: key.clone(),
            mode: config.mode,
            tuning: config.tuning.clone(),
            cluster_ips: config.cluster_ips.clone(),
            ports,
        })
    }

    /// Recomputes the dirty Services and publishes a new snapshot if any of them changed.
    fn publish(&mut self) {
        let dirty = std::mem::take(&mut self.dirty);
        if dirty.is_empty() {
            return;
        }
        let states: Vec<(ServiceKey, Option<ServiceState>)> = dirty
            .into_iter()
            .map(|k| {
                let s = self.state(&k);
                (k, s)
            })
            .collect();
        self.tx.send_if_modified(|snap| {
            let mut changed = false;
            for (key, state) in states {
                let current = snap.services.get(&key).map(AsRef::as_ref);
                if current == state.as_ref() {
                    continue;
                }
                changed = true;
                let map = Arc::make_mut(&mut snap.services);
                match state {
                    Some(s) => {
                        debug!(service = %key, mode = %s.mode, "service state published");
                        map.insert(key, Arc::new(s));
                    }
                    None => {
                        debug!(service = %key, "service state removed");
                        map.remove(&key);
                    }
                }
            }
            changed
        });
    }
}
