//! A fake Kubernetes API server on 127.0.0.1 that speaks the real list/watch wire protocol,
//! so tests exercise the real kube-rs `Client` and watchers.
//!
//! What it implements, as the real API server does:
//! - `GET` list of services, endpointslices and nodes: a JSON `*List` with
//!   `metadata.resourceVersion`;
//! - `?watch=true&resourceVersion=N`: a chunked stream of newline-delimited WatchEvents for
//!   changes after N; `allowWatchBookmarks` -> periodic `BOOKMARK` events; the stream ends
//!   after `timeoutSeconds` (capped by [`FakeApi::set_max_watch`]); a resourceVersion older
//!   than the last [`FakeApi::compact`] -> an `ERROR` event with a `410 Gone` Status (the
//!   client must relist);
//! - `fieldSelector=metadata.name=X` (nodes); `labelSelector` is ignored (test slices all carry
//!   the label the agent selects on);
//! - `POST .../events`: recorded; a name that exists -> `409 AlreadyExists`.
//!
//! Failure injection: [`FakeApi::drop_watches`] cuts every open watch mid-stream (the
//! connection is aborted, no terminating chunk) and [`FakeApi::restart`] takes the whole server
//! down (connections refused) and back up on the same port with the same objects.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the fake server"
)]

use std::{
    collections::BTreeMap,
    convert::Infallible,
    io,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
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
    fn from_path(path: &str) -> Option<Self> {
        match path {
            "/api/v1/services" => Some(Kind::Service),
            "/apis/discovery.k8s.io/v1/endpointslices" => Some(Kind::EndpointSlice),
            "/api/v1/nodes" => Some(Kind::Node),
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

struct Change {
    rv: u64,
    kind: Kind,
    type_: &'static str,
    object: Value,
}

struct State {
    rv: u64,
    objects: BTreeMap<ObjKey, Value>,
    log: Vec<Change>,
    /// Watches from a resourceVersion below this get `410 Gone`.
    compacted_below: u64,
    events: Vec<Value>,
    /// (method, path and query) of every request, for assertions about relists.
    requests: Vec<String>,
    max_watch: Duration,
    bookmark_every: Duration,
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
                max_watch: Duration::from_secs(290),
                bookmark_every: Duration::from_millis(200),
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

    /// How many list (not watch) requests were made for a path, e.g. `/api/v1/services`.
    pub fn list_requests(&self, path: &str) -> usize {
        self.count_requests(path, false)
    }

    /// How many watch requests were made for a path.
    pub fn watch_requests(&self, path: &str) -> usize {
        self.count_requests(path, true)
    }

    fn count_requests(&self, path: &str, watch: bool) -> usize {
        let st = self.shared.state.lock().expect("state");
        let prefix = format!("GET {path}?");
        st.requests
            .iter()
            .filter(|r| r.starts_with(&prefix) && r.contains("watch=true") == watch)
            .count()
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
        let mut v = serde_json::to_value(obj).expect("serialize object");
        let (api_version, k) = kind.object_meta();
        v["apiVersion"] = json!(api_version);
        v["kind"] = json!(k);
        let key = obj_key(kind, &v);
        let st = &mut *self.st;
        st.rv += 1;
        let rv = st.rv;
        v["metadata"]["resourceVersion"] = json!(rv.to_string());
        if v["metadata"]["uid"].is_null() {
            v["metadata"]["uid"] = json!(format!("uid-{}-{}", key.1, key.2));
        }
        let type_ = if st.objects.insert(key, v.clone()).is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        st.log.push(Change {
            rv,
            kind,
            type_,
            object: v,
        });
    }

    /// Deletes an object (no-op if absent).
    pub fn delete<K: serde::Serialize + kube::Resource<DynamicType = ()>>(&mut self, obj: &K) {
        let kind = kind_of::<K>();
        let v = serde_json::to_value(obj).expect("serialize object");
        let key = obj_key(kind, &v);
        let st = &mut *self.st;
        let Some(mut old) = st.objects.remove(&key) else {
            return;
        };
        st.rv += 1;
        let rv = st.rv;
        old["metadata"]["resourceVersion"] = json!(rv.to_string());
        st.log.push(Change {
            rv,
            kind,
            type_: "DELETED",
            object: old,
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

fn obj_key(kind: Kind, v: &Value) -> ObjKey {
    let s = |p: &str| v["metadata"][p].as_str().unwrap_or_default().to_owned();
    (kind, s("namespace"), s("name"))
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

fn full(status: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(
            Full::new(Bytes::from(v.to_string()))
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("response")
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn query(req: &Request<Incoming>) -> BTreeMap<String, String> {
    req.uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.replace("%3D", "=").replace("%2F", "/")))
        .collect()
}

fn matches(q: &BTreeMap<String, String>, kind: Kind, obj: &Value) -> bool {
    let Some(sel) = q.get("fieldSelector") else {
        return true;
    };
    let _ = kind;
    match sel.strip_prefix("metadata.name=") {
        Some(name) => obj["metadata"]["name"].as_str() == Some(name),
        None => true,
    }
}

async fn handle(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    // Subscribed before the request is visible to tests, so a `drop_watches` issued after a
    // test saw this request always reaches the watch.
    let dropped = shared.drop_gen.subscribe();
    shared.state.lock().expect("state").requests.push(format!(
        "{} {}?{}",
        req.method(),
        path,
        req.uri().query().unwrap_or_default()
    ));
    if req.method() == Method::POST && path.starts_with("/apis/events.k8s.io/v1/namespaces/") {
        return create_event(shared, req).await;
    }
    let Some(kind) = Kind::from_path(&path) else {
        return full(
            StatusCode::NOT_FOUND,
            &status(404, "NotFound", "no such path"),
        );
    };
    let q = query(&req);
    if q.get("watch").map(String::as_str) == Some("true") {
        return watch_response(shared, kind, &q, dropped);
    }
    let st = shared.state.lock().expect("state");
    let items: Vec<&Value> = st
        .objects
        .iter()
        .filter(|((k, _, _), v)| *k == kind && matches(&q, kind, v))
        .map(|(_, v)| v)
        .collect();
    let (api_version, list_kind) = kind.list_meta();
    full(
        StatusCode::OK,
        &json!({"apiVersion": api_version, "kind": list_kind,
                "metadata": {"resourceVersion": st.rv.to_string()}, "items": items}),
    )
}

async fn create_event(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
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

fn watch_response(
    shared: &Arc<Shared>,
    kind: Kind,
    q: &BTreeMap<String, String>,
    mut dropped: watch::Receiver<u64>,
) -> Response<Body> {
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bookmarks = q.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let asked = q
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(290), Duration::from_secs);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, io::Error>>(64);
    let shared = shared.clone();
    let q = q.clone();
    tokio::spawn(async move {
        let line = |v: Value| Ok(Frame::data(Bytes::from(format!("{v}\n"))));
        let (max_watch, bookmark_every, compacted_below) = {
            let st = shared.state.lock().expect("state");
            (st.max_watch, st.bookmark_every, st.compacted_below)
        };
        if from != 0 && from < compacted_below {
            let gone = status(410, "Expired", &format!("too old resource version: {from}"));
            let _ = tx
                .send(line(json!({"type": "ERROR", "object": gone})))
                .await;
            return;
        }
        let deadline = tokio::time::Instant::now() + asked.min(max_watch);
        let mut changed = shared.changed.subscribe();
        let mut sent = from;
        if from == 0 {
            // "Any" semantics: start with every current object as ADDED.
            let st = shared.state.lock().expect("state");
            for ((k, _, _), v) in &st.objects {
                if *k == kind && matches(&q, kind, v) {
                    let _ = tx.try_send(line(json!({"type": "ADDED", "object": v})));
                }
            }
            sent = st.rv;
        }
        let mut bookmark = tokio::time::interval(bookmark_every);
        loop {
            let pending: Vec<Value> = {
                let st = shared.state.lock().expect("state");
                let out = st
                    .log
                    .iter()
                    .filter(|c| c.rv > sent && c.kind == kind && matches(&q, kind, &c.object))
                    .map(|c| json!({"type": c.type_, "object": c.object}))
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
                    if tx.send(line(bm)).await.is_err() {
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
