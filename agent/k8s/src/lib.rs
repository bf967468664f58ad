//! Kubernetes discovery for skewless: watches Services, EndpointSlices and the agent's own Node
//! with kube-rs watchers (exponential backoff, relist on `410 Gone`), feeds the
//! [`skewless_model::Index`], and posts a Warning Event on every Service whose skewless config
//! is rejected.
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

use std::collections::HashMap;

use futures::{StreamExt, stream::BoxStream};
use k8s_openapi::api::{
    core::v1::{Node, ObjectReference, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client,
    runtime::{WatchStreamExt, watcher},
};
use skewless_model::{Index, Metrics, NodeInfo, Rejection, ServiceKey, SliceInput, Snapshot};
use tokio::sync::{mpsc, watch};
use tracing::{Instrument, debug, info, info_span, warn};

pub use convert::{SERVICE_NAME_LABEL, node_info, service_input, slice_input};
pub use events::{ACTION, REPORTING_CONTROLLER};

/// One RBAC rule the agent needs: API group, resource, verbs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule {
    pub api_group: &'static str,
    pub resource: &'static str,
    pub verbs: &'static [&'static str],
}

/// Exactly the API access this crate uses; `deploy/` grants exactly this (a test checks it).
/// Watchers need `list` + `watch`; the Node watcher also lists (with a field selector on our
/// own name), which RBAC cannot restrict per node for a DaemonSet. Events are only created
/// (deterministic names; see `events.rs`), never patched.
pub const RBAC_RULES: &[Rule] = &[
    Rule {
        api_group: "",
        resource: "services",
        verbs: &["list", "watch"],
    },
    Rule {
        api_group: "discovery.k8s.io",
        resource: "endpointslices",
        verbs: &["list", "watch"],
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
    Service(Box<watcher::Event<Service>>),
    Slice(Box<watcher::Event<EndpointSlice>>),
    Node(Box<watcher::Event<Node>>),
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

    /// Becomes `true` once Services and EndpointSlices have both been listed: before that a
    /// snapshot may hold a Service without its endpoints. Gate readiness (and redirects) on it.
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

        let wc = watcher::Config::default();
        let services: BoxStream<'static, _> =
            watcher(Api::<Service>::all(client.clone()), wc.clone())
                .default_backoff()
                .map(|r| r.map(|e| Update::Service(Box::new(e))))
                .boxed();
        let slices = watcher(
            Api::<EndpointSlice>::all(client.clone()),
            wc.clone().labels(SERVICE_NAME_LABEL),
        )
        .default_backoff()
        .map(|r| r.map(|e| Update::Slice(Box::new(e))))
        .boxed();
        let node = watcher(
            Api::<Node>::all(client),
            wc.fields(&format!("metadata.name={}", config.node_name)),
        )
        .default_backoff()
        .map(|r| r.map(|e| Update::Node(Box::new(e))))
        .boxed();

        let mut state = State {
            index: &mut index,
            node_tx: &node_tx,
            synced_tx: &synced_tx,
            services_listed: false,
            slices_listed: false,
            reports: report_tx,
            services_init: Vec::new(),
            slices_init: Vec::new(),
        };
        let mut updates = futures::stream::select_all([services, slices, node]);
        info!(node = %config.node_name, "watching services, endpointslices and node");
        while let Some(update) = updates.next().await {
            match update {
                Ok(u) => state.handle(u),
                Err(error) => {
                    state.index.metrics().source_error("kubernetes");
                    warn!(%error, "watch failed; retrying with backoff");
                }
            }
        }
    }
}

/// The loop's state: the index and the relist buffers.
struct State<'a> {
    index: &'a mut Index,
    node_tx: &'a watch::Sender<Option<NodeInfo>>,
    synced_tx: &'a watch::Sender<bool>,
    services_listed: bool,
    slices_listed: bool,
    reports: events::Queue,
    /// Services seen since the last `Init`, applied at once on `InitDone`.
    services_init: Vec<Service>,
    slices_init: Vec<SliceInput>,
}

impl State<'_> {
    fn handle(&mut self, update: Update) {
        match update {
            Update::Service(ev) => match *ev {
                watcher::Event::Apply(svc) => {
                    let r = self.index.apply_service(&service_input(&svc));
                    self.report(r, |_| Some(events::service_ref(&svc)));
                }
                watcher::Event::Delete(svc) => {
                    self.index.delete_service(&service_input(&svc).key);
                }
                watcher::Event::Init => self.services_init.clear(),
                watcher::Event::InitApply(svc) => self.services_init.push(svc),
                watcher::Event::InitDone => {
                    let svcs = std::mem::take(&mut self.services_init);
                    let inputs: Vec<_> = svcs.iter().map(service_input).collect();
                    debug!(services = inputs.len(), "services relisted");
                    let refs: HashMap<ServiceKey, ObjectReference> = inputs
                        .iter()
                        .zip(&svcs)
                        .map(|(i, s)| (i.key.clone(), events::service_ref(s)))
                        .collect();
                    for r in self.index.reset_services(&inputs) {
                        self.report(Some(r), |k| refs.get(k).cloned());
                    }
                    self.services_listed = true;
                    self.update_synced();
                }
            },
            Update::Slice(ev) => match *ev {
                watcher::Event::Apply(s) => self.index.apply_slice(&slice_input(&s)),
                watcher::Event::Delete(s) => self.index.delete_slice(&slice_input(&s).key),
                watcher::Event::Init => self.slices_init.clear(),
                watcher::Event::InitApply(s) => self.slices_init.push(slice_input(&s)),
                watcher::Event::InitDone => {
                    let slices = std::mem::take(&mut self.slices_init);
                    debug!(slices = slices.len(), "endpointslices relisted");
                    self.index.reset_slices(&slices);
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

    fn update_synced(&self) {
        if self.services_listed && self.slices_listed {
            self.synced_tx
                .send_if_modified(|s| !std::mem::replace(s, true));
        }
    }

    fn report(
        &self,
        rejection: Option<Rejection>,
        regarding: impl FnOnce(&ServiceKey) -> Option<ObjectReference>,
    ) {
        let Some(rejection) = rejection else { return };
        let Some(regarding) = regarding(&rejection.service) else {
            return;
        };
        self.reports.push(events::Report {
            rejection,
            regarding,
        });
    }
}

async fn post_events(poster: events::EventPoster, mut reports: mpsc::Receiver<events::Report>) {
    while let Some(report) = reports.recv().await {
        poster.post(&report).await;
    }
}
