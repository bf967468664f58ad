//! The index: applies source events (apply, delete, relists applied as they arrive) and
//! publishes the resulting per-Service state through a [`tokio::sync::watch`] channel.
//!
//! Invariants: slices are kept only for Services with `skewless.io/mode` (and dropped with
//! them); a relist never holds a second copy of what it replaces; a Service waiting for its
//! slices is not published.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
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
    /// Opted in after the source stopped sending every slice (see [`Index::fetch_on_opt_in`]):
    /// not published until [`Index::reset_service_slices`] brings its slices.
    awaits_slices: bool,
}

/// A relist in progress: what it has confirmed so far.
#[derive(Debug, Default)]
struct Relist<K> {
    seen: HashSet<K>,
    /// Slices relist only: the Services whose slices it replaces (those wanted, with their
    /// slices in, when it began). A Service that opts in meanwhile got its slices from its own
    /// fetch, which the relist must not sweep.
    sweeps: HashSet<ServiceKey>,
}

/// Owns the model and the publishing side of the snapshot channel. Not shared: one task feeds
/// it from a source (Kubernetes watchers or the local file).
///
/// Keeps only what Services with `skewless.io/mode` need: a Service without it costs nothing
/// here, and the slices of such a Service are dropped on arrival. When a Service opts out or
/// goes away, its slices go with it.
#[derive(Debug)]
pub struct Index {
    services: HashMap<ServiceKey, ServiceEntry>,
    /// Slices of wanted Services only (those in `services`), in the compact [`SliceData`] form.
    slices: HashMap<ServiceKey, BTreeMap<String, SliceData>>,
    slice_owner: HashMap<SliceKey, ServiceKey>,
    fetch_on_opt_in: bool,
    /// Opt-ins whose slices the source must fetch, oldest first.
    fetches: Vec<ServiceKey>,
    services_relist: Option<Relist<ServiceKey>>,
    slices_relist: Option<Relist<SliceKey>>,
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
            fetch_on_opt_in: false,
            fetches: Vec::new(),
            services_relist: None,
            slices_relist: None,
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

    /// From now on, a Service that opts in is not published until the source has fetched its
    /// slices and handed them over with [`Index::reset_service_slices`]: the slices the source
    /// sent before the opt-in were dropped. Its key is queued for [`Index::take_fetches`].
    /// A source whose every update carries all slices (the file) never calls this.
    pub fn fetch_on_opt_in(&mut self) {
        self.fetch_on_opt_in = true;
    }

    /// The Services that opted in since the last call and wait for their slices.
    pub fn take_fetches(&mut self) -> Vec<ServiceKey> {
        std::mem::take(&mut self.fetches)
    }

    /// Whether slices of this Service are kept (it has `skewless.io/mode`, valid or not).
    #[must_use]
    pub fn wants_slices(&self, key: &ServiceKey) -> bool {
        self.services.contains_key(key)
    }

    /// Whether this Service waits for [`Index::reset_service_slices`].
    #[must_use]
    pub fn awaits_slices(&self, key: &ServiceKey) -> bool {
        self.services.get(key).is_some_and(|e| e.awaits_slices)
    }

    /// Whether this slice is kept.
    #[must_use]
    pub fn holds_slice(&self, key: &SliceKey) -> bool {
        self.slice_owner.contains_key(key)
    }

    /// How many slices are kept (for tests and benchmarks).
    #[must_use]
    pub fn slice_count(&self) -> usize {
        self.slice_owner.len()
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
        self.forget_service(key);
        self.publish();
    }

    /// Starts a relist of Services: until [`Index::end_services_relist`], every applied
    /// Service is marked seen, and the end forgets the rest. Each Service is applied (and
    /// published) as it arrives, so a relist never holds a second copy of the cluster.
    pub fn begin_services_relist(&mut self) {
        self.services_relist = Some(Relist::default());
    }

    /// Ends a Services relist: Services it did not see are forgotten.
    pub fn end_services_relist(&mut self) {
        self.end_services_relist_inner();
        self.publish();
    }

    /// Replaces all Services (a relist in one call): Services absent from `svcs` are forgotten.
    pub fn reset_services<'a>(
        &mut self,
        svcs: impl IntoIterator<Item = &'a ServiceInput>,
    ) -> Vec<Rejection> {
        let rejections = self.relist_services(svcs);
        self.publish();
        rejections
    }

    /// A whole Services relist, unpublished.
    fn relist_services<'a>(
        &mut self,
        svcs: impl IntoIterator<Item = &'a ServiceInput>,
    ) -> Vec<Rejection> {
        self.begin_services_relist();
        let rejections = svcs
            .into_iter()
            .filter_map(|s| self.apply_service_inner(s))
            .collect();
        self.end_services_relist_inner();
        rejections
    }

    /// Applies a created or updated EndpointSlice. Kept only if its Service is wanted and not
    /// waiting for its fetch.
    pub fn apply_slice(&mut self, slice: &SliceInput) {
        self.apply_slice_inner(slice);
        self.publish();
    }

    /// Forgets a deleted EndpointSlice.
    pub fn delete_slice(&mut self, key: &SliceKey) {
        self.delete_slice_inner(key);
        self.publish();
    }

    /// Starts a relist of EndpointSlices; see [`Index::begin_services_relist`]. The end
    /// forgets the slices it did not see, of the Services wanted when it began.
    pub fn begin_slices_relist(&mut self) {
        let sweeps = self
            .services
            .iter()
            .filter(|(_, e)| !e.awaits_slices)
            .map(|(k, _)| k.clone())
            .collect();
        self.slices_relist = Some(Relist {
            seen: HashSet::new(),
            sweeps,
        });
    }

    /// Ends an EndpointSlices relist.
    pub fn end_slices_relist(&mut self) {
        let Some(relist) = self.slices_relist.take() else {
            return;
        };
        let gone: Vec<SliceKey> = self
            .slice_owner
            .iter()
            .filter(|(k, owner)| relist.sweeps.contains(*owner) && !relist.seen.contains(*k))
            .map(|(k, _)| k.clone())
            .collect();
        for key in gone {
            self.delete_slice_inner(&key);
        }
        self.publish();
    }

    /// Replaces all EndpointSlices (a relist in one call).
    pub fn reset_slices<'a>(&mut self, slices: impl IntoIterator<Item = &'a SliceInput>) {
        self.begin_slices_relist();
        for s in slices {
            self.apply_slice_inner(s);
        }
        self.end_slices_relist();
    }

    /// Replaces the slices of one wanted Service with `slices` (what the source fetched for it)
    /// and publishes it if it was waiting for them. Ignored if the Service is not wanted.
    /// Slices of other Services in `slices` are ignored.
    pub fn reset_service_slices<'a>(
        &mut self,
        key: &ServiceKey,
        slices: impl IntoIterator<Item = &'a SliceInput>,
    ) {
        let Some(entry) = self.services.get_mut(key) else {
            return;
        };
        entry.awaits_slices = false;
        self.drop_slices_of(key);
        for s in slices {
            if s.owner().as_ref() == Some(key) {
                self.apply_slice_inner(s);
            }
        }
        self.dirty.insert(key.clone());
        self.publish();
    }

    /// Replaces everything at once and publishes once (the local file source).
    pub fn reset<'a>(
        &mut self,
        svcs: impl IntoIterator<Item = &'a ServiceInput>,
        slices: impl IntoIterator<Item = &'a SliceInput>,
    ) -> Vec<Rejection> {
        // Services first: slices are kept only for the Services wanted.
        let rejections = self.relist_services(svcs);
        self.begin_slices_relist();
        for s in slices {
            self.apply_slice_inner(s);
        }
        self.end_slices_relist();
        rejections
    }

    fn end_services_relist_inner(&mut self) {
        let Some(relist) = self.services_relist.take() else {
            return;
        };
        let gone: Vec<ServiceKey> = self
            .services
            .keys()
            .filter(|k| !relist.seen.contains(*k))
            .cloned()
            .collect();
        for key in gone {
            self.forget_service(&key);
        }
    }

    /// Removes a Service and its slices.
    fn forget_service(&mut self, key: &ServiceKey) {
        if self.services.remove(key).is_some() {
            self.drop_slices_of(key);
            self.fetches.retain(|k| k != key);
            self.dirty.insert(key.clone());
        }
    }

    fn drop_slices_of(&mut self, key: &ServiceKey) {
        if let Some(slices) = self.slices.remove(key) {
            for name in slices.into_keys() {
                self.slice_owner.remove(&SliceKey {
                    namespace: key.namespace.clone(),
                    name,
                });
            }
            self.dirty.insert(key.clone());
        }
    }

    /// The entry of a Service that has `skewless.io/mode`, made if new (a new opt-in).
    fn entry(&mut self, key: &ServiceKey) -> &mut ServiceEntry {
        if !self.services.contains_key(key) {
            let awaits_slices = self.fetch_on_opt_in;
            if awaits_slices {
                self.fetches.push(key.clone());
            }
            self.services.insert(
                key.clone(),
                ServiceEntry {
                    awaits_slices,
                    ..ServiceEntry::default()
                },
            );
        }
        self.services.get_mut(key).expect("inserted above")
    }

    fn apply_service_inner(&mut self, svc: &ServiceInput) -> Option<Rejection> {
        let key = &svc.key;
        let config = svc.config();
        if let Some(relist) = &mut self.services_relist
            && (!matches!(config, Ok(None)) || self.services.contains_key(key))
        {
            relist.seen.insert(key.clone());
        }
        match config {
            Ok(None) => {
                if self.services.contains_key(key) {
                    info!(service = %key, "service opted out");
                    self.forget_service(key);
                }
                None
            }
            Ok(Some(config)) => {
                let entry = self.entry(key);
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
                let entry = self.entry(key);
                if entry.reported.as_ref() == Some(&error) {
                    return None;
                }
                let kept_last_good = entry.last_good.is_some();
                entry.reported = Some(error.clone());
                warn!(service = %key, %error, reason = error.reason(), problems = error.len(), kept_last_good, "service config rejected");
                self.metrics.rejected(error.reason());
                Some(Rejection {
                    service: key.clone(),
                    error,
                    kept_last_good,
                })
            }
        }
    }

    fn apply_slice_inner(&mut self, slice: &SliceInput) {
        // A slice whose service-name label changed moves: drop it from its old owner first.
        self.delete_slice_inner(&slice.key);
        let Some(owner) = slice.owner() else {
            return;
        };
        match self.services.get(&owner) {
            Some(entry) if !entry.awaits_slices => {}
            _ => return,
        }
        if let Some(relist) = &mut self.slices_relist {
            relist.seen.insert(slice.key.clone());
        }
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

    fn state(&self, key: &ServiceKey) -> Option<ServiceState> {
        let entry = self.services.get(key)?;
        if entry.awaits_slices {
            return None;
        }
        let config = entry.last_good.as_ref()?;
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
