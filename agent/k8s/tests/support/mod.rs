//! A fake Kubernetes API server on 127.0.0.1 that speaks the real list/watch wire protocol,
//! so tests exercise the real kube-rs `Client` and watchers.
//!
//! What it implements, as the real API server does:
//! - `GET` of one namespaced object by name (`404` if absent), `resourceVersion` as for a get;
//! - `GET` list of services, endpointslices and nodes, cluster-wide or under
//!   `/namespaces/{ns}/`: a JSON `*List` with `metadata.resourceVersion`; `limit` pages it,
//!   with a `continue` token whose pages come from the first page's snapshot (a token that is
//!   unknown or combined with `resourceVersion` is refused, `410` and `400`);
//! - list `resourceVersion` semantics: unset or empty is a consistent (quorum) read;
//!   `0` is served from the watch cache; `N` with `resourceVersionMatch=NotOlderThan` from the
//!   cache once it has reached N (`504` if N is in the future); `Exact` only for the current
//!   version (older ones are compacted: `410`);
//! - `?watch=true&resourceVersion=N`: a chunked stream of newline-delimited WatchEvents for
//!   changes after N; `resourceVersion=0` or unset starts with every object as `ADDED`;
//!   `allowWatchBookmarks` -> periodic `BOOKMARK` events; the stream ends after
//!   `timeoutSeconds` (capped by [`FakeApi::set_max_watch`]); a resourceVersion older than the
//!   last [`FakeApi::compact`] -> an `ERROR` event with a `410 Gone` Status (the client must
//!   relist);
//! - streaming lists (`sendInitialEvents=true`, which requires
//!   `resourceVersionMatch=NotOlderThan`): every object as `ADDED`, then a `BOOKMARK` annotated
//!   `k8s.io/initial-events-end`, then the changes; [`FakeApi::set_watch_list`] turns the
//!   feature off (`422`, as Kubernetes 1.33 ships);
//! - `fieldSelector=metadata.name=X`; `labelSelector` with `k=v`, `k==v`, `k!=v`, `k` and
//!   `!k` terms, comma-separated;
//! - `POST .../events`: recorded; a name that exists -> `409 AlreadyExists`.
//!
//! Every request is logged ([`FakeApi::requests`]); [`Request::is_quorum_read`] says which
//! ones a real API server would serve by a consistent read of etcd rather than from its cache.
//!
//! Failure injection: [`FakeApi::drop_watches`] cuts every open watch mid-stream (the
//! connection is aborted, no terminating chunk) and [`FakeApi::restart`] takes the whole server
//! down (connections refused) and back up on the same port with the same objects.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the fake server"
)]

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    convert::Infallible,
    io,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use http::{Method, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody, combinators::BoxBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper_util::rt::TokioIo;
use k8s_openapi::{
    api::{
        core::v1::ObjectReference,
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde_json::{Value, json};
use skewless_k8s::SERVICE_NAME_LABEL;
use tokio::{net::TcpListener, sync::watch, task::JoinSet};

mod wire;

use self::wire::{Selector, bytes_response, error, full, query, status};

/// EndpointSlice `name` in namespace `ns` of Service `service`: `n` ready endpoints, pod
/// `<service>-<i>` at `<addr_prefix><i>` (i from 1), port `grpc` = `port`.
pub fn ready_slice(
    name: &str,
    service: &str,
    n: usize,
    addr_prefix: &str,
    port: i32,
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            labels: Some(BTreeMap::from([(
                SERVICE_NAME_LABEL.to_owned(),
                service.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        address_type: "IPv4".into(),
        ports: Some(vec![EndpointPort {
            name: Some("grpc".into()),
            port: Some(port),
            protocol: Some("TCP".into()),
            ..EndpointPort::default()
        }]),
        endpoints: (1..=n)
            .map(|i| Endpoint {
                addresses: vec![format!("{addr_prefix}{i}")],
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                target_ref: Some(ObjectReference {
                    kind: Some("Pod".into()),
                    name: Some(format!("{service}-{i}")),
                    namespace: Some("ns".into()),
                    ..ObjectReference::default()
                }),
                ..Endpoint::default()
            })
            .collect(),
    }
}

type Body = BoxBody<Bytes, io::Error>;

/// The resources the fake server serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
}

impl Kind {
    /// The kind and namespace of a collection path (cluster-wide or under `/namespaces/{ns}/`).
    fn from_path(path: &str) -> Option<(Self, Option<String>)> {
        let (prefix, rest) = if let Some(rest) = path.strip_prefix("/api/v1/") {
            ("", rest)
        } else if let Some(rest) = path.strip_prefix("/apis/discovery.k8s.io/v1/") {
            ("discovery.k8s.io", rest)
        } else {
            return None;
        };
        let (ns, plural) = match rest.strip_prefix("namespaces/") {
            Some(rest) => {
                let (ns, plural) = rest.split_once('/')?;
                (Some(ns.to_owned()), plural)
            }
            None => (None, rest),
        };
        let kind = match (prefix, plural) {
            ("", "services") => Kind::Service,
            ("discovery.k8s.io", "endpointslices") => Kind::EndpointSlice,
            ("", "nodes") if ns.is_none() => Kind::Node,
            _ => return None,
        };
        Some((kind, ns))
    }

    /// `(kind, namespace, name)` of a path to one namespaced object, e.g.
    /// `/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices/name`.
    fn from_object_path(path: &str) -> Option<(Self, String, String)> {
        let (collection, name) = path.rsplit_once('/')?;
        match Self::from_path(collection)? {
            (kind, Some(ns)) if !name.is_empty() => Some((kind, ns, name.to_owned())),
            _ => None,
        }
    }

    fn list_meta(self) -> (&'static str, &'static str) {
        match self {
            Kind::Service => ("v1", "ServiceList"),
            Kind::EndpointSlice => ("discovery.k8s.io/v1", "EndpointSliceList"),
            Kind::Node => ("v1", "NodeList"),
        }
    }

    fn object_meta(self) -> (&'static str, &'static str) {
        match self {
            Kind::Service => ("v1", "Service"),
            Kind::EndpointSlice => ("discovery.k8s.io/v1", "EndpointSlice"),
            Kind::Node => ("v1", "Node"),
        }
    }
}

type ObjKey = (Kind, String, String);

/// A stored object: its JSON, serialized once, and what selectors look at.
#[derive(Clone)]
struct Obj {
    json: Bytes,
    namespace: String,
    name: String,
    labels: BTreeMap<String, String>,
}

impl Obj {
    fn new(v: &Value) -> Self {
        let s = |p: &str| v["metadata"][p].as_str().unwrap_or_default().to_owned();
        let labels = v["metadata"]["labels"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        Self {
            json: Bytes::from(serde_json::to_vec(v).expect("serialize object")),
            namespace: s("namespace"),
            name: s("name"),
            labels,
        }
    }

    fn value(&self) -> Value {
        serde_json::from_slice(&self.json).expect("stored JSON")
    }
}

struct Change {
    rv: u64,
    kind: Kind,
    type_: &'static str,
    object: Obj,
}

/// One request the server received.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    /// Query parameters, decoded.
    pub query: BTreeMap<String, String>,
}

impl Request {
    /// A watch (`watch=true`).
    pub fn is_watch(&self) -> bool {
        self.query.get("watch").map(String::as_str) == Some("true")
    }

    /// A `GET` of one object by name.
    pub fn is_get(&self) -> bool {
        self.method == "GET" && Kind::from_object_path(&self.path).is_some()
    }

    /// A `GET` of a collection that is not a watch.
    pub fn is_list(&self) -> bool {
        self.method == "GET" && !self.is_watch() && Kind::from_path(&self.path).is_some()
    }

    /// Whether a real API server serves this list by a consistent read of etcd (a quorum
    /// read) rather than from its watch cache: a list without a `resourceVersion` (or with an
    /// empty one), or with `resourceVersionMatch=Exact`. `continue` pages follow the first
    /// page. Watches are served from the cache.
    pub fn is_quorum_read(&self) -> bool {
        if self.is_get() {
            return matches!(
                self.query.get("resourceVersion").map(String::as_str),
                None | Some("")
            );
        }
        if !self.is_list() || self.query.contains_key("continue") {
            return false;
        }
        let rv = self.query.get("resourceVersion").map(String::as_str);
        let exact = self.query.get("resourceVersionMatch").map(String::as_str) == Some("Exact");
        matches!(rv, None | Some("")) || exact
    }
}

struct State {
    rv: u64,
    objects: BTreeMap<ObjKey, Obj>,
    log: Vec<Change>,
    /// Watches from a resourceVersion below this get `410 Gone`.
    compacted_below: u64,
    events: Vec<Value>,
    requests: Vec<Request>,
    /// Open list snapshots by continue token: the rest of the items and the list's version.
    continues: HashMap<String, (u64, VecDeque<Bytes>)>,
    next_continue: u64,
    max_watch: Duration,
    bookmark_every: Duration,
    /// Whether `sendInitialEvents` is served (the `WatchList` feature); off, such a watch is
    /// refused with `422 Invalid`, as Kubernetes 1.33 does by default.
    watch_list: bool,
    /// How long each list waits between taking its snapshot and answering.
    list_delay: Duration,
}

struct Shared {
    state: Mutex<State>,
    /// Bumped on every change; open watches wait on it.
    changed: watch::Sender<u64>,
    /// Bumped by `drop_watches`; open watches abort their connection.
    drop_gen: watch::Sender<u64>,
}

/// A running fake API server. Dropping it stops it.
pub struct FakeApi {
    shared: Arc<Shared>,
    addr: SocketAddr,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl FakeApi {
    /// Starts on an ephemeral port of 127.0.0.1.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1");
        Self::start_on(listener)
    }

    /// Starts on `listener` (e.g. one bound in another network namespace).
    pub fn start_on(listener: TcpListener) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                rv: 1,
                objects: BTreeMap::new(),
                log: Vec::new(),
                compacted_below: 0,
                events: Vec::new(),
                requests: Vec::new(),
                continues: HashMap::new(),
                next_continue: 0,
                max_watch: Duration::from_secs(290),
                bookmark_every: Duration::from_millis(200),
                watch_list: true,
                list_delay: Duration::ZERO,
            }),
            changed: watch::Sender::new(1),
            drop_gen: watch::Sender::new(0),
        });
        let addr = listener.local_addr().expect("local addr");
        let server = Some(tokio::spawn(serve(listener, shared.clone())));
        Self {
            shared,
            addr,
            server,
        }
    }

    /// The server's base URL, e.g. for a kubeconfig.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig for this server (plain HTTP, no auth), for an agent process.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: \"{}\"}}}}]\nusers: [{{name: fake, user: {{}}}}]\ncontexts: [{{name: fake, context: {{cluster: fake, user: fake}}}}]\ncurrent-context: fake\n",
            self.url()
        )
    }

    /// A real kube `Client` pointed at this server (plain HTTP, no auth).
    pub fn client(&self) -> kube::Client {
        let url: http::Uri = format!("http://{}", self.addr).parse().expect("url");
        kube::Client::try_from(kube::Config::new(url)).expect("kube client")
    }

    /// Creates or replaces an object (any k8s-openapi resource), like `kubectl apply`.
    pub fn apply<K: serde::Serialize + kube::Resource<DynamicType = ()>>(&self, obj: &K) {
        self.change(|c| c.apply(obj));
    }

    /// Deletes an object.
    pub fn delete<K: serde::Serialize + kube::Resource<DynamicType = ()>>(&self, obj: &K) {
        self.change(|c| c.delete(obj));
    }

    /// Makes changes under one lock, so no watch can observe an intermediate state.
    pub fn change(&self, f: impl FnOnce(&mut Changes<'_>)) {
        let mut st = self.shared.state.lock().expect("state");
        f(&mut Changes { st: &mut st });
        let rv = st.rv;
        drop(st);
        self.shared.changed.send_replace(rv);
    }

    /// Changes the agent can only learn by relisting: cuts every watch, makes the changes and
    /// compacts history, atomically. Watches resuming from before get `410 Gone`.
    pub fn change_behind_watches(&self, f: impl FnOnce(&mut Changes<'_>)) {
        let mut st = self.shared.state.lock().expect("state");
        self.shared.drop_gen.send_modify(|g| *g += 1);
        f(&mut Changes { st: &mut st });
        st.compacted_below = st.rv + 1;
        st.log.clear();
        let rv = st.rv;
        drop(st);
        self.shared.changed.send_replace(rv);
    }

    /// Forgets the change history, as etcd compaction does: watches resuming from an older
    /// resourceVersion get `410 Gone`.
    pub fn compact(&self) {
        let mut st = self.shared.state.lock().expect("state");
        st.compacted_below = st.rv + 1;
        st.log.clear();
    }

    /// Forgets the change history up to now and keeps only what is newer from then on; call
    /// it now and then under a long stream of changes so the log stays small. Watches more
    /// than `keep` changes behind get `410 Gone`.
    pub fn trim_log(&self, keep: usize) {
        let mut st = self.shared.state.lock().expect("state");
        let n = st.log.len();
        if n > keep {
            st.log.drain(..n - keep);
            st.compacted_below = st.log.first().map_or(st.rv + 1, |c| c.rv);
        }
    }

    /// Serves streaming lists (`sendInitialEvents`) or refuses them with `422` (on by default).
    pub fn set_watch_list(&self, on: bool) {
        self.shared.state.lock().expect("state").watch_list = on;
    }

    /// Makes every list answer `d` after taking its snapshot, so changes made meanwhile are
    /// newer than the list (a slow API server).
    pub fn set_list_delay(&self, d: Duration) {
        self.shared.state.lock().expect("state").list_delay = d;
    }

    /// Aborts every open watch connection mid-stream.
    pub fn drop_watches(&self) {
        self.shared.drop_gen.send_modify(|g| *g += 1);
    }

    /// Caps how long a watch stays open (the real server's `--min-request-timeout` does this).
    pub fn set_max_watch(&self, d: Duration) {
        self.shared.state.lock().expect("state").max_watch = d;
    }

    /// Stops the server (open connections die, new ones are refused), runs `while_down`, waits
    /// `down_for`, and starts again on the same port with the same objects.
    pub async fn restart(&mut self, down_for: Duration, while_down: impl FnOnce(&Self)) {
        if let Some(server) = self.server.take() {
            server.abort();
            let _ = server.await;
        }
        while_down(self);
        tokio::time::sleep(down_for).await;
        let listener = TcpListener::bind(self.addr)
            .await
            .expect("rebind same port");
        self.server = Some(tokio::spawn(serve(listener, self.shared.clone())));
    }

    /// Events posted so far.
    pub fn events(&self) -> Vec<Value> {
        self.shared.state.lock().expect("state").events.clone()
    }

    /// Every request so far, oldest first.
    pub fn requests(&self) -> Vec<Request> {
        self.shared.state.lock().expect("state").requests.clone()
    }

    /// How many list (not watch) requests were made for a path, e.g. `/api/v1/services`.
    pub fn list_requests(&self, path: &str) -> usize {
        self.count_requests(path, false)
    }

    /// How many times a path's collection was listed in full: list requests that are not a
    /// `continue` page, plus streaming lists (watches with `sendInitialEvents`).
    pub fn full_lists(&self, path: &str) -> usize {
        let st = self.shared.state.lock().expect("state");
        st.requests
            .iter()
            .filter(|r| r.method == "GET" && r.path == path)
            .filter(|r| {
                if r.is_watch() {
                    r.query.get("sendInitialEvents").map(String::as_str) == Some("true")
                } else {
                    !r.query.contains_key("continue")
                }
            })
            .count()
    }

    /// How many watch requests were made for a path.
    pub fn watch_requests(&self, path: &str) -> usize {
        self.count_requests(path, true)
    }

    fn count_requests(&self, path: &str, watch: bool) -> usize {
        let st = self.shared.state.lock().expect("state");
        st.requests
            .iter()
            .filter(|r| r.method == "GET" && r.path == path && r.is_watch() == watch)
            .count()
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.state.lock().expect("state").rv
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.abort();
        }
    }
}

/// Mutations of the fake server's objects; see [`FakeApi::change`].
pub struct Changes<'a> {
    st: &'a mut State,
}

impl Changes<'_> {
    /// Creates or replaces an object.
    pub fn apply<K: serde::Serialize + kube::Resource<DynamicType = ()>>(&mut self, obj: &K) {
        let kind = kind_of::<K>();
        let v = serde_json::to_value(obj).expect("serialize object");
        self.apply_value(kind, v);
    }

    /// Creates or replaces an object given as JSON (`apiVersion` and `kind` are set here).
    pub fn apply_value(&mut self, kind: Kind, mut v: Value) {
        let (api_version, k) = kind.object_meta();
        v["apiVersion"] = json!(api_version);
        v["kind"] = json!(k);
        let st = &mut *self.st;
        st.rv += 1;
        let rv = st.rv;
        v["metadata"]["resourceVersion"] = json!(rv.to_string());
        if v["metadata"]["uid"].is_null() {
            let s = |p: &str| v["metadata"][p].as_str().unwrap_or_default().to_owned();
            v["metadata"]["uid"] = json!(format!("uid-{}-{}", s("namespace"), s("name")));
        }
        let obj = Obj::new(&v);
        let key = (kind, obj.namespace.clone(), obj.name.clone());
        let type_ = if st.objects.insert(key, obj.clone()).is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        st.log.push(Change {
            rv,
            kind,
            type_,
            object: obj,
        });
    }

    /// Deletes an object (no-op if absent).
    pub fn delete<K: serde::Serialize + kube::Resource<DynamicType = ()>>(&mut self, obj: &K) {
        let kind = kind_of::<K>();
        let v = serde_json::to_value(obj).expect("serialize object");
        let s = |p: &str| v["metadata"][p].as_str().unwrap_or_default().to_owned();
        self.delete_key(kind, &s("namespace"), &s("name"));
    }

    /// Deletes an object without telling the open watches, as if its `DELETED` event were
    /// still on its way: a get or list sees it gone, a watch has not heard (no-op if absent).
    pub fn delete_unannounced(&mut self, kind: Kind, namespace: &str, name: &str) {
        let st = &mut *self.st;
        if st
            .objects
            .remove(&(kind, namespace.to_owned(), name.to_owned()))
            .is_some()
        {
            st.rv += 1;
        }
    }

    /// Deletes an object by name (no-op if absent).
    pub fn delete_key(&mut self, kind: Kind, namespace: &str, name: &str) {
        let st = &mut *self.st;
        let Some(old) = st
            .objects
            .remove(&(kind, namespace.to_owned(), name.to_owned()))
        else {
            return;
        };
        st.rv += 1;
        let rv = st.rv;
        let mut v = old.value();
        v["metadata"]["resourceVersion"] = json!(rv.to_string());
        st.log.push(Change {
            rv,
            kind,
            type_: "DELETED",
            object: Obj::new(&v),
        });
    }
}

fn kind_of<K: kube::Resource<DynamicType = ()>>() -> Kind {
    match (K::group(&()).as_ref(), K::kind(&()).as_ref()) {
        ("", "Service") => Kind::Service,
        ("discovery.k8s.io", "EndpointSlice") => Kind::EndpointSlice,
        ("", "Node") => Kind::Node,
        (g, k) => panic!("fake API server does not serve {g}/{k}"),
    }
}

/// Accepts connections until aborted; aborting drops the JoinSet, which aborts every
/// connection, like a server process dying.
async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    let mut conns = JoinSet::new();
    loop {
        let Ok((io, _)) = listener.accept().await else {
            continue;
        };
        // Without it, Nagle + delayed ACK add ~40 ms to small watch events, which would be
        // measured as agent latency.
        let _ = io.set_nodelay(true);
        let shared = shared.clone();
        conns.spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(handle(&shared, req).await) }
            });
            // Errors here are aborted connections, which is the point of some tests.
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(io), svc)
                .await;
        });
        while conns.try_join_next().is_some() {}
    }
}

async fn handle(shared: &Arc<Shared>, req: http::Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    // Subscribed before the request is visible to tests, so a `drop_watches` issued after a
    // test saw this request always reaches the watch.
    let dropped = shared.drop_gen.subscribe();
    let q = query(&req);
    shared.state.lock().expect("state").requests.push(Request {
        method: req.method().to_string(),
        path: path.clone(),
        query: q.clone(),
    });
    if req.method() == Method::POST && path.starts_with("/apis/events.k8s.io/v1/namespaces/") {
        return create_event(shared, req).await;
    }
    let response = if let Some((kind, ns, name)) = Kind::from_object_path(&path) {
        get_response(shared, kind, &ns, &name, &q)
    } else {
        let Some((kind, ns)) = Kind::from_path(&path) else {
            return error(404, "NotFound", "no such path");
        };
        if q.get("watch").map(String::as_str) == Some("true") {
            return watch_response(shared, kind, ns, &q, dropped);
        }
        list_response(shared, kind, ns.as_deref(), &q)
    };
    // The answer is made first, then held back: it is as old as the delay.
    let delay = shared.state.lock().expect("state").list_delay;
    // Not even a zero sleep without a delay: tokio rounds it up to its next millisecond tick.
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    response
}

/// The refusal, if any, of a `resourceVersion` asking for a state not older than it: none
/// when the server has reached it (`0` and empty ask for nothing), `504` if it is in the
/// future, `400` if it is not a number.
fn not_older_than(rv: &str, current: u64) -> Option<Response<Body>> {
    match rv {
        "" | "0" => None,
        n => match n.parse::<u64>() {
            Ok(n) if n <= current => None,
            Ok(_) => Some(error(504, "Timeout", "Too large resource version")),
            Err(_) => Some(error(400, "BadRequest", "invalid resourceVersion")),
        },
    }
}

/// `GET` of one namespaced object. `resourceVersion` as for a get: unset or empty is a
/// consistent (quorum) read, `0` any version from the cache, `N` not older than N (`504` if N
/// is in the future).
fn get_response(
    shared: &Arc<Shared>,
    kind: Kind,
    ns: &str,
    name: &str,
    q: &BTreeMap<String, String>,
) -> Response<Body> {
    let st = shared.state.lock().expect("state");
    let rv = q.get("resourceVersion").map(String::as_str).unwrap_or("");
    if let Some(refused) = not_older_than(rv, st.rv) {
        return refused;
    }
    match st.objects.get(&(kind, ns.to_owned(), name.to_owned())) {
        Some(o) => bytes_response(StatusCode::OK, o.json.clone()),
        None => error(404, "NotFound", &format!("\"{name}\" not found")),
    }
}

fn list_response(
    shared: &Arc<Shared>,
    kind: Kind,
    ns: Option<&str>,
    q: &BTreeMap<String, String>,
) -> Response<Body> {
    let mut st = shared.state.lock().expect("state");
    let rv = q.get("resourceVersion").map(String::as_str).unwrap_or("");
    let version_match = q.get("resourceVersionMatch").map(String::as_str);
    let limit: Option<usize> = q
        .get("limit")
        .and_then(|l| l.parse().ok())
        .filter(|l| *l > 0);
    let (list_rv, items) = if let Some(token) = q.get("continue") {
        if !rv.is_empty() || version_match.is_some() {
            return error(
                400,
                "BadRequest",
                "specifying resource version is not allowed when using continue",
            );
        }
        match st.continues.remove(token) {
            Some(snapshot) => snapshot,
            None => return error(410, "Expired", "the provided continue parameter is too old"),
        }
    } else {
        match (rv, version_match) {
            (n, None | Some("NotOlderThan")) => {
                if let Some(refused) = not_older_than(n, st.rv) {
                    return refused;
                }
            }
            (n, Some("Exact")) => {
                if n.parse::<u64>().ok() != Some(st.rv) {
                    return error(410, "Expired", "too old resource version");
                }
            }
            (_, Some(other)) => {
                return error(
                    422,
                    "Invalid",
                    &format!("unsupported resourceVersionMatch {other}"),
                );
            }
        }
        let sel = Selector::parse(q);
        let items: VecDeque<Bytes> = st
            .objects
            .iter()
            .filter(|((k, _, _), o)| *k == kind && sel.matches(ns, o))
            .map(|(_, o)| o.json.clone())
            .collect();
        (st.rv, items)
    };
    let mut items = items;
    let page: Vec<Bytes> = match limit {
        Some(l) if l < items.len() => items.drain(..l).collect(),
        _ => items.drain(..).collect(),
    };
    let mut meta = json!({"resourceVersion": list_rv.to_string()});
    if !items.is_empty() {
        st.next_continue += 1;
        let token = format!("c{}", st.next_continue);
        meta["continue"] = json!(token);
        meta["remainingItemCount"] = json!(items.len());
        st.continues.insert(token, (list_rv, items));
    }
    drop(st);
    let (api_version, list_kind) = kind.list_meta();
    let head = json!({"apiVersion": api_version, "kind": list_kind, "metadata": meta});
    let head = head.to_string();
    // `{"apiVersion":..,"kind":..,"metadata":{..},"items":[...]}`, items spliced in as stored.
    let mut body = Vec::with_capacity(
        head.len() + page.iter().map(Bytes::len).sum::<usize>() + page.len() + 16,
    );
    body.extend_from_slice(&head.as_bytes()[..head.len() - 1]);
    body.extend_from_slice(b",\"items\":[");
    for (i, item) in page.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(item);
    }
    body.extend_from_slice(b"]}");
    bytes_response(StatusCode::OK, Bytes::from(body))
}

async fn create_event(shared: &Arc<Shared>, req: http::Request<Incoming>) -> Response<Body> {
    let Ok(body) = req.into_body().collect().await else {
        return full(StatusCode::BAD_REQUEST, &status(400, "BadRequest", "body"));
    };
    let Ok(ev) = serde_json::from_slice::<Value>(&body.to_bytes()) else {
        return full(StatusCode::BAD_REQUEST, &status(400, "BadRequest", "json"));
    };
    let mut st = shared.state.lock().expect("state");
    if st
        .events
        .iter()
        .any(|e| e["metadata"]["name"] == ev["metadata"]["name"])
    {
        return full(
            StatusCode::CONFLICT,
            &status(409, "AlreadyExists", "event already exists"),
        );
    }
    st.events.push(ev.clone());
    full(StatusCode::CREATED, &ev)
}

/// One watch event line, the object spliced in as stored.
fn event_line(type_: &str, object: &Bytes) -> Bytes {
    let mut line = Vec::with_capacity(object.len() + 32);
    line.extend_from_slice(b"{\"type\":\"");
    line.extend_from_slice(type_.as_bytes());
    line.extend_from_slice(b"\",\"object\":");
    line.extend_from_slice(object);
    line.extend_from_slice(b"}\n");
    Bytes::from(line)
}

fn watch_response(
    shared: &Arc<Shared>,
    kind: Kind,
    ns: Option<String>,
    q: &BTreeMap<String, String>,
    mut dropped: watch::Receiver<u64>,
) -> Response<Body> {
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bookmarks = q.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let initial_events = q.get("sendInitialEvents").map(String::as_str) == Some("true");
    if initial_events {
        let on = shared.state.lock().expect("state").watch_list;
        if !on {
            return error(
                422,
                "Invalid",
                "sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled",
            );
        }
        if q.get("resourceVersionMatch").map(String::as_str) != Some("NotOlderThan") {
            return error(
                422,
                "Invalid",
                "sendInitialEvents requires resourceVersionMatch=NotOlderThan",
            );
        }
    }
    let asked = q
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(290), Duration::from_secs);
    let sel = Selector::parse(q);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, io::Error>>(64);
    let shared = shared.clone();
    tokio::spawn(async move {
        let line = |b: Bytes| Ok(Frame::data(b));
        let (max_watch, bookmark_every, compacted_below) = {
            let st = shared.state.lock().expect("state");
            (st.max_watch, st.bookmark_every, st.compacted_below)
        };
        if from != 0 && from < compacted_below && !initial_events {
            let gone = status(410, "Expired", &format!("too old resource version: {from}"));
            let _ = tx
                .send(line(Bytes::from(
                    json!({"type": "ERROR", "object": gone}).to_string() + "\n",
                )))
                .await;
            return;
        }
        let deadline = tokio::time::Instant::now() + asked.min(max_watch);
        let mut changed = shared.changed.subscribe();
        let mut sent = from;
        if from == 0 || initial_events {
            // "Any" semantics, or a streaming list: start with every current object as ADDED.
            let initial: Vec<Bytes> = {
                let st = shared.state.lock().expect("state");
                sent = st.rv;
                st.objects
                    .iter()
                    .filter(|((k, _, _), o)| *k == kind && sel.matches(ns.as_deref(), o))
                    .map(|(_, o)| event_line("ADDED", &o.json))
                    .collect()
            };
            for l in initial {
                if tx.send(line(l)).await.is_err() {
                    return;
                }
            }
            if initial_events {
                let (api_version, k) = kind.object_meta();
                let bm = json!({"type": "BOOKMARK", "object": {"apiVersion": api_version,
                    "kind": k, "metadata": {"resourceVersion": sent.to_string(),
                    "annotations": {"k8s.io/initial-events-end": "true"}}}});
                if tx
                    .send(line(Bytes::from(bm.to_string() + "\n")))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
        let mut bookmark = tokio::time::interval(bookmark_every);
        loop {
            let pending: Vec<Bytes> = {
                let st = shared.state.lock().expect("state");
                // The log is in resourceVersion order: start after what was sent.
                let first = st.log.partition_point(|c| c.rv <= sent);
                let out = st.log[first..]
                    .iter()
                    .filter(|c| c.kind == kind && sel.matches(ns.as_deref(), &c.object))
                    .map(|c| event_line(c.type_, &c.object.json))
                    .collect();
                sent = sent.max(st.rv);
                out
            };
            for ev in pending {
                if tx.send(line(ev)).await.is_err() {
                    return;
                }
            }
            tokio::select! {
                _ = changed.changed() => {}
                _ = dropped.changed() => {
                    let _ = tx.send(Err(io::Error::other("connection dropped by test"))).await;
                    return;
                }
                _ = bookmark.tick(), if bookmarks => {
                    let (api_version, k) = kind.object_meta();
                    let bm = json!({"type": "BOOKMARK", "object": {"apiVersion": api_version,
                        "kind": k, "metadata": {"resourceVersion": sent.to_string()}}});
                    if tx.send(line(Bytes::from(bm.to_string() + "\n"))).await.is_err() {
                        return;
                    }
                }
                () = tokio::time::sleep_until(deadline) => return,
            }
        }
    });
    let body = StreamBody::new(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|f| (f, rx))
    }));
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(BodyExt::boxed(body))
        .expect("watch response")
}

/// Waits until `f` holds for the value in `rx`, or panics after `timeout`.
pub async fn wait_for<T: Clone, R>(
    rx: &mut watch::Receiver<T>,
    timeout: Duration,
    what: &str,
    mut f: impl FnMut(&T) -> Option<R>,
) -> R {
    let fut = async {
        loop {
            if let Some(r) = f(&rx.borrow_and_update().clone()) {
                return r;
            }
            rx.changed().await.expect("sender alive");
        }
    };
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out after {timeout:?} waiting for: {what}"))
}

/// Waits until `f` holds (polled every 10 ms), or panics after `timeout`.
pub async fn eventually(timeout: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
