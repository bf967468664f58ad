//! Kubernetes discovery for skewless: watches Services, EndpointSlices and the agent's own Node
//! with kube-rs watchers (exponential backoff, relist on `410 Gone`), feeds the
//! [`skewless_model::Index`], and posts a Warning Event on every Service whose skewless config
//! is rejected.
//!
//! Pays only for opted-in Services: objects are decoded into slim types that keep only what the
//! model reads, the index keeps only the slices of Services with `skewless.io/mode`, and of
//! every other slice only its name and Service. A Service that opts in is held back (nothing
//! redirected) until its slices are fetched by name, at least as fresh as the watch. Lists
//! never buffer the collection: they are streaming lists from the API server's watch cache
//! (paged lists where the server refuses them), applied object by object. Nothing is
//! published as synced before both collections are listed.
//!
//! One task owns the index, so updates need no locks and an EndpointSlice change reaches the
//! published [`Snapshot`] as soon as the watch event is decoded. Events are posted by a second
//! task, so a slow or failing API server never delays endpoint updates.
//!
//! Owns every call to the API server. Writes nothing but Events: the agent's permissions are
//! exactly [`RBAC_RULES`] (deploy/rbac.yaml is checked against them). Must not decide what a
//! Service's config means: converting objects to [`skewless_model::ServiceInput`] is this
//! crate's, validating them is the model's.

#![forbid(unsafe_code)]

mod convert;
mod events;
mod owners;

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use futures::{StreamExt, stream::BoxStream};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client,
    api::GetParams,
    runtime::{WatchStreamExt, watcher},
};
use skewless_model::{
    Index, Metrics, NodeInfo, Rejection, ServiceKey, SliceInput, SliceKey, Snapshot,
};
use tokio::sync::{mpsc, watch};
use tracing::{Instrument, debug, info, info_span, warn};

pub use convert::{
    SERVICE_NAME_LABEL, ServiceObject, SliceObject, node_info, service_input, service_key,
    slice_input, slice_key, slice_owner,
};
pub use events::{ACTION, REPORTING_CONTROLLER};

/// One RBAC rule the agent needs: API group, resource, verbs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule {
    pub api_group: &'static str,
    pub resource: &'static str,
    pub verbs: &'static [&'static str],
}

/// Exactly the API access this crate uses; `deploy/` grants exactly this (a test checks it).
/// Watchers need `list` + `watch`, and an opt-in `get`s its slices; the Node watcher also
/// lists (with a field selector on our own name), which RBAC cannot restrict per node for a
/// DaemonSet. Events are only created (deterministic names; see `events.rs`), never patched.
pub const RBAC_RULES: &[Rule] = &[
    Rule {
        api_group: "",
        resource: "services",
        verbs: &["list", "watch"],
    },
    Rule {
        api_group: "discovery.k8s.io",
        resource: "endpointslices",
        verbs: &["get", "list", "watch"],
    },
    Rule {
        api_group: "",
        resource: "nodes",
        verbs: &["list", "watch"],
    },
    Rule {
        api_group: "events.k8s.io",
        resource: "events",
        verbs: &["create"],
    },
];

/// Settings of [`Discovery`].
#[derive(Clone, Debug)]
pub struct Config {
    /// This node's name (`--node-name`, from the downward API): whose Node to watch, and the
    /// `reportingInstance` of Events.
    pub node_name: String,
}

/// Kubernetes discovery. Build it, take the receivers, then spawn [`Discovery::run`].
pub struct Discovery {
    client: Client,
    config: Config,
    index: Index,
    node_tx: watch::Sender<Option<NodeInfo>>,
    synced_tx: watch::Sender<bool>,
}

/// Boxed: the three object types differ a lot in size, and every update is moved through the
/// merged stream.
enum Update {
    Service(Box<watcher::Event<ServiceObject>>),
    Slice(Box<watcher::Event<SliceObject>>),
    Node(Box<watcher::Event<Node>>),
}

/// Page size of the Service and EndpointSlice lists when the API server refuses streaming
/// lists (client-go's default).
const PAGE: u32 = 500;

/// A watch whose initial list (and every relist) is a streaming list: the API server sends
/// the objects from its watch cache as watch events, one at a time, then a bookmark
/// (`sendInitialEvents=true`, `resourceVersion=0`, `resourceVersionMatch=NotOlderThan`), so
/// neither side holds a page, let alone a copy of the collection, and etcd is not read. An API
/// server that refuses it (the `WatchList` feature off: 422) gets paged consistent lists
/// instead, from then on. See docs/cluster-scale.md for why "any" (possibly stale) initial
/// state is safe here.
fn list_watch<K>(
    api: Api<K>,
    wc: watcher::Config,
) -> BoxStream<'static, watcher::Result<watcher::Event<K>>>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    struct Watch<K: kube::Resource> {
        stream: BoxStream<'static, watcher::Result<watcher::Event<K>>>,
        streaming: bool,
        api: Api<K>,
        wc: watcher::Config,
    }
    let start = Watch {
        stream: watcher(api.clone(), wc.clone().streaming_lists()).boxed(),
        streaming: true,
        api,
        wc,
    };
    futures::stream::unfold(start, |mut w| async move {
        loop {
            let item = w.stream.next().await?;
            if w.streaming
                && let Err(watcher::Error::WatchStartFailed(kube::Error::Api(status))) = &item
                && matches!(status.code, 400 | 422)
            {
                warn!(kind = %K::kind(&()), code = status.code, message = %status.message, "streaming list refused; using paged lists");
                w.streaming = false;
                w.stream = watcher(w.api.clone(), w.wc.clone().page_size(PAGE)).boxed();
                continue;
            }
            return Some((item, w));
        }
    })
    .boxed()
}

impl Discovery {
    #[must_use]
    pub fn new(client: Client, config: Config, metrics: Metrics) -> Self {
        Self {
            client,
            config,
            index: Index::new(metrics),
            node_tx: watch::Sender::new(None),
            synced_tx: watch::Sender::new(false),
        }
    }

    /// Becomes `true` once Services and EndpointSlices have both been listed (and the slices of
    /// every Service that opted in meanwhile fetched): before that a snapshot may hold a
    /// Service without its endpoints. Gate readiness (and redirects) on it.
    #[must_use]
    pub fn synced(&self) -> watch::Receiver<bool> {
        self.synced_tx.subscribe()
    }

    /// Per-Service state: what the datapath reconciler and the balancer read.
    #[must_use]
    pub fn snapshots(&self) -> watch::Receiver<Snapshot> {
        self.index.subscribe()
    }

    /// This node's Node, once seen.
    #[must_use]
    pub fn node(&self) -> watch::Receiver<Option<NodeInfo>> {
        self.node_tx.subscribe()
    }

    /// Runs the watchers forever. Watch failures are logged and retried with backoff; the last
    /// published state stays in effect meanwhile (fail static).
    pub async fn run(self) {
        let Discovery {
            client,
            config,
            mut index,
            node_tx,
            synced_tx,
        } = self;
        let (report_tx, report_rx) = events::Queue::new(events::QUEUE, index.metrics().clone());
        let poster = events::EventPoster::new(client.clone(), config.node_name.clone());
        tokio::spawn(post_events(poster, report_rx).instrument(info_span!("events")));

        let services: BoxStream<'static, _> = list_watch(
            Api::<ServiceObject>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .map(|r| r.map(|e| Update::Service(Box::new(e))))
        .boxed();
        let node = list_watch(
            Api::<Node>::all(client.clone()),
            watcher::Config::default().fields(&format!("metadata.name={}", config.node_name)),
        )
        .default_backoff()
        .map(|r| r.map(|e| Update::Node(Box::new(e))))
        .boxed();

        let (fetched_tx, mut fetched_rx) = mpsc::channel(16);
        let mut state = State {
            index: &mut index,
            node_tx: &node_tx,
            synced_tx: &synced_tx,
            client: client.clone(),
            services_listed: false,
            slices_watched: false,
            slices_listed: false,
            reports: report_tx,
            fetching: HashMap::new(),
            fetched_tx,
            next_token: 0,
            fetched_at: HashMap::new(),
            owners: owners::Owners::default(),
            max_slice_rv: 0,
        };
        let mut updates = futures::stream::select_all([services, node]);
        info!(node = %config.node_name, "watching services, endpointslices and node");
        loop {
            let update = tokio::select! {
                update = updates.next() => match update {
                    Some(u) => u,
                    None => return,
                },
                Some(fetched) = fetched_rx.recv() => {
                    state.fetched(fetched);
                    continue;
                }
            };
            match update {
                Ok(u) => {
                    state.handle(u);
                    if state.services_listed && !state.slices_watched {
                        // Slices are watched once every opted-in Service is known, so the first
                        // slice list keeps theirs and drops the rest; a Service that opts in
                        // later gets its slices fetched.
                        state.slices_watched = true;
                        state.index.fetch_on_opt_in();
                        updates.push(
                            list_watch(
                                Api::<SliceObject>::all(client.clone()),
                                watcher::Config::default().labels(SERVICE_NAME_LABEL),
                            )
                            .default_backoff()
                            .map(|r| r.map(|e| Update::Slice(Box::new(e))))
                            .boxed(),
                        );
                    }
                }
                Err(error) => {
                    state.index.metrics().source_error("kubernetes");
                    warn!(%error, "watch failed; retrying with backoff");
                }
            }
        }
    }
}

/// A change to one slice, with its resourceVersion if numeric.
enum SliceChange {
    Apply(Box<SliceObject>, Option<u64>),
    Delete(SliceKey, Option<u64>),
}

/// An opted-in Service whose slices are being fetched: the slice watch's changes to them are
/// held back until the fetch is in.
struct Fetching {
    token: u64,
    held: Vec<SliceChange>,
    task: tokio::task::JoinHandle<()>,
}

/// A fetch's result.
struct Fetched {
    service: ServiceKey,
    token: u64,
    /// The resourceVersion the gets asked to be at least as fresh as.
    asked: u64,
    /// Each slice asked for by name, and what the API server had (none: not found).
    slices: Vec<(String, Option<SliceObject>)>,
}

/// The loop's state: the index, the fetches of opted-in Services' slices, readiness.
struct State<'a> {
    index: &'a mut Index,
    node_tx: &'a watch::Sender<Option<NodeInfo>>,
    synced_tx: &'a watch::Sender<bool>,
    client: Client,
    services_listed: bool,
    slices_watched: bool,
    slices_listed: bool,
    reports: events::Queue,
    fetching: HashMap<ServiceKey, Fetching>,
    fetched_tx: mpsc::Sender<Fetched>,
    next_token: u64,
    /// Each fetched slice, with its Service and the resourceVersion the fetch saw it at:
    /// changes to it at or below that are already in the fetch and are not applied again (the
    /// watch may deliver them later).
    fetched_at: HashMap<SliceKey, (ServiceKey, u64)>,
    /// Every labelled slice's Service, by name: what an opt-in fetches.
    owners: owners::Owners,
    /// The newest slice resourceVersion seen: a fetch must be at least this fresh, so it holds
    /// every change the watch delivered before the opt-in (and that was dropped then).
    max_slice_rv: u64,
}

/// A resourceVersion as a number. The API server's are etcd revisions; one that is not a
/// number is never compared (its change is applied in order).
fn rv_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<u64> {
    meta.resource_version.as_deref()?.parse().ok()
}

/// Whether a change at `change` is newer than a list at `list`.
fn newer(change: Option<u64>, list: Option<u64>) -> bool {
    match (change, list) {
        (Some(c), Some(l)) => c > l,
        _ => true,
    }
}

impl State<'_> {
    fn handle(&mut self, update: Update) {
        match update {
            Update::Service(ev) => match *ev {
                watcher::Event::Apply(svc) | watcher::Event::InitApply(svc) => {
                    let r = self.index.apply_service(&service_input(&svc));
                    self.report(r, &svc);
                    self.follow_opt_ins();
                }
                watcher::Event::Delete(svc) => {
                    self.index.delete_service(&service_key(&svc));
                    self.follow_opt_ins();
                }
                watcher::Event::Init => self.index.begin_services_relist(),
                watcher::Event::InitDone => {
                    self.index.end_services_relist();
                    debug!("services relisted");
                    self.follow_opt_ins();
                    self.services_listed = true;
                    self.update_synced();
                }
            },
            Update::Slice(ev) => match *ev {
                watcher::Event::Apply(s) | watcher::Event::InitApply(s) => {
                    let (rv, owner) = (rv_of(&s.metadata), slice_owner(&s));
                    self.slice_change(SliceChange::Apply(Box::new(s), rv), owner);
                }
                watcher::Event::Delete(s) => {
                    let (rv, owner) = (rv_of(&s.metadata), slice_owner(&s));
                    self.slice_change(SliceChange::Delete(slice_key(&s), rv), owner);
                }
                watcher::Event::Init => {
                    // The relist replaces what fetches brought too.
                    self.fetched_at.clear();
                    self.owners.begin_relist();
                    self.index.begin_slices_relist();
                }
                watcher::Event::InitDone => {
                    self.owners.end_relist();
                    self.index.end_slices_relist();
                    debug!(
                        kept = self.index.slice_count(),
                        known = self.owners.len(),
                        "endpointslices relisted"
                    );
                    self.slices_listed = true;
                    self.update_synced();
                }
            },
            Update::Node(ev) => match *ev {
                watcher::Event::Apply(n) | watcher::Event::InitApply(n) => {
                    let info = node_info(&n);
                    self.node_tx.send_if_modified(|cur| {
                        let changed = cur.as_ref() != Some(&info);
                        *cur = Some(info);
                        changed
                    });
                }
                watcher::Event::Delete(_) => {
                    self.node_tx.send_replace(None);
                }
                watcher::Event::Init | watcher::Event::InitDone => {}
            },
        }
    }

    /// Starts a fetch for every new opt-in, and forgets the fetches and marks of Services no
    /// longer wanted.
    fn follow_opt_ins(&mut self) {
        for service in self.index.take_fetches() {
            self.fetch(service);
        }
        let index = &*self.index;
        self.fetching.retain(|k, f| {
            let keep = index.awaits_slices(k);
            if !keep {
                f.task.abort();
            }
            keep
        });
        self.fetched_at
            .retain(|_, (owner, _)| index.wants_slices(owner));
    }

    /// Gets the slices of one Service by name (the names the slice watch has shown for it),
    /// from the API server's watch cache but at least as fresh as the watch
    /// (`resourceVersion=N`, not older than N); retried with backoff until it succeeds or the
    /// Service opts out. A get by name costs the API server a lookup where a list by label
    /// scans every slice of the cluster.
    fn fetch(&mut self, service: ServiceKey) {
        self.next_token += 1;
        let token = self.next_token;
        let api: Api<SliceObject> = Api::namespaced(self.client.clone(), &service.namespace);
        let names = self.owners.slices_of(&service);
        let asked = self.max_slice_rv;
        let gp = GetParams::at(&asked.to_string());
        let tx = self.fetched_tx.clone();
        let metrics = self.index.metrics().clone();
        let key = service.clone();
        let task = tokio::spawn(
            async move {
                let mut delay = FETCH_RETRY_MIN;
                loop {
                    let gets = names.iter().map(|name| async {
                        match api.get_with(name, &gp).await {
                            Ok(slice) => Ok((name.clone(), Some(slice))),
                            Err(kube::Error::Api(status)) if status.code == 404 => {
                                Ok((name.clone(), None))
                            }
                            Err(error) => Err(error),
                        }
                    });
                    match futures::future::try_join_all(gets).await {
                        Ok(slices) => {
                            let _ = tx
                                .send(Fetched {
                                    service: key,
                                    token,
                                    asked,
                                    slices,
                                })
                                .await;
                            return;
                        }
                        Err(error) => {
                            metrics.source_error("kubernetes");
                            warn!(%error, ?delay, "fetching a service's endpointslices failed; retrying");
                            tokio::time::sleep(delay).await;
                            delay = (delay * 2).min(FETCH_RETRY_MAX);
                        }
                    }
                }
            }
            .instrument(info_span!("fetch", service = %service)),
        );
        debug!(service = %service, "service opted in: fetching its endpointslices");
        self.fetching.insert(
            service,
            Fetching {
                token,
                held: Vec::new(),
                task,
            },
        );
    }

    /// A fetch is in: the Service's slices are the fetch's, then every held change newer than
    /// what the fetch saw of its slice, published at once.
    fn fetched(&mut self, fetched: Fetched) {
        let Fetched {
            service,
            token,
            asked,
            slices,
        } = fetched;
        match self.fetching.get(&service) {
            Some(f) if f.token == token => {}
            // Opted out (and maybe in again) since: a newer fetch or none is due.
            _ => return,
        }
        let Some(f) = self.fetching.remove(&service) else {
            return;
        };
        // What the fetch saw of each slice: the slice at its resourceVersion, or its absence
        // at the freshness asked for.
        let mut seen: HashMap<String, Option<u64>> = HashMap::new();
        let mut set: BTreeMap<String, SliceInput> = BTreeMap::new();
        for (name, slice) in slices {
            let Some(slice) = slice else {
                seen.insert(name, Some(asked));
                continue;
            };
            seen.insert(name, rv_of(&slice.metadata));
            let input = slice_input(slice);
            // Relabelled since the watch showed it: another Service's now.
            if input.owner().as_ref() == Some(&service) {
                set.insert(input.key.name.clone(), input);
            }
        }
        let fetched_rv = |name: &str| seen.get(name).copied().flatten();
        for change in f.held {
            match change {
                SliceChange::Apply(s, at) => {
                    let input = slice_input(*s);
                    if !newer(at, fetched_rv(&input.key.name)) {
                        continue;
                    }
                    if input.owner().as_ref() == Some(&service) {
                        set.insert(input.key.name.clone(), input);
                    } else {
                        set.remove(&input.key.name);
                    }
                }
                SliceChange::Delete(key, at) => {
                    if newer(at, fetched_rv(&key.name)) {
                        set.remove(&key.name);
                    }
                }
            }
        }
        debug!(service = %service, slices = set.len(), "endpointslices fetched");
        self.index.reset_service_slices(&service, set.values());
        for (name, rv) in seen {
            if let Some(rv) = rv {
                let key = SliceKey {
                    namespace: service.namespace.clone(),
                    name,
                };
                self.fetched_at.insert(key, (service.clone(), rv));
            }
        }
        self.update_synced();
    }

    /// One change from the slice watch: held for a Service being fetched, dropped if already
    /// in its fetch, otherwise applied (the index keeps only wanted Services' slices).
    fn slice_change(&mut self, change: SliceChange, owner: Option<ServiceKey>) {
        let (key, rv) = match &change {
            SliceChange::Apply(s, rv) => (slice_key(s), *rv),
            SliceChange::Delete(key, rv) => (key.clone(), *rv),
        };
        if let Some(rv) = rv {
            self.max_slice_rv = self.max_slice_rv.max(rv);
        }
        match &change {
            SliceChange::Apply(..) => self.owners.set(key.clone(), owner.as_ref()),
            SliceChange::Delete(..) => self.owners.remove(&key),
        }
        if !self.fetching.is_empty() {
            // A slice that leaves a Service being fetched (relabelled) must leave its fetch.
            for (service, f) in &mut self.fetching {
                if service.namespace == key.namespace && owner.as_ref() != Some(service) {
                    f.held.push(SliceChange::Delete(key.clone(), rv));
                }
            }
            if let Some(f) = owner.as_ref().and_then(|o| self.fetching.get_mut(o)) {
                f.held.push(change);
                return;
            }
        }
        match change {
            SliceChange::Apply(s, rv) => {
                if let Some((_, at)) = self.fetched_at.get(&key)
                    && !newer(rv, Some(*at))
                {
                    return;
                }
                let wanted = owner.as_ref().is_some_and(|o| self.index.wants_slices(o));
                if !wanted && !self.index.holds_slice(&key) {
                    // Not wanted and nothing to move away from: skip the conversion.
                    return;
                }
                self.index.apply_slice(&slice_input(*s));
            }
            SliceChange::Delete(key, _) => self.index.delete_slice(&key),
        }
    }

    fn update_synced(&self) {
        if self.services_listed && self.slices_listed && self.fetching.is_empty() {
            self.synced_tx
                .send_if_modified(|s| !std::mem::replace(s, true));
        }
    }

    fn report(&self, rejection: Option<Rejection>, svc: &ServiceObject) {
        let Some(rejection) = rejection else { return };
        self.reports.push(events::Report {
            rejection,
            regarding: events::service_ref(svc),
        });
    }
}

/// Backoff of a failed fetch.
const FETCH_RETRY_MIN: Duration = Duration::from_millis(200);
const FETCH_RETRY_MAX: Duration = Duration::from_secs(30);

async fn post_events(poster: events::EventPoster, mut reports: mpsc::Receiver<events::Report>) {
    while let Some(report) = reports.recv().await {
        poster.post(&report).await;
    }
}
