//! The real kube-rs client and watchers against the fake API server: each test changes objects
//! on the server and asserts the published model state and the Events posted.

mod support;

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use k8s_openapi::{
    api::{
        core::v1::{Node, NodeSpec, Service, ServicePort, ServiceSpec},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};
use skewless_k8s::{Config, Discovery};
use skewless_model::{Metrics, Mode, NodeInfo, ServiceKey, Snapshot, annotations};
use support::{FakeApi, Kind, eventually, wait_for};
use tokio::{sync::watch, task::JoinHandle};

/// Upper bound for any single expectation. Recovery paths wait out kube's default backoff
/// (800 ms doubling, with jitter) once or twice, so this is well above the happy path.
const WAIT: Duration = Duration::from_secs(10);
const NODE: &str = "node-a";

fn mk_service(name: &str, annots: &[(&str, &str)]) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            annotations: Some(
                annots
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some("10.96.0.10".into()),
            cluster_ips: Some(vec!["10.96.0.10".into()]),
            ports: Some(vec![ServicePort {
                name: Some("grpc".into()),
                port: 80,
                protocol: Some("TCP".into()),
                target_port: Some(IntOrString::String("grpc".into())),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

fn mk_slice(name: &str, service: &str, n: usize) -> EndpointSlice {
    support::ready_slice(name, service, n, "10.0.0.", 8080)
}

fn mk_node(name: &str, zone: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([(
                "topology.kubernetes.io/zone".to_owned(),
                zone.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec {
            pod_cidrs: Some(vec!["10.0.0.0/24".into()]),
            ..NodeSpec::default()
        }),
        ..Node::default()
    }
}

struct Agent {
    snapshots: watch::Receiver<Snapshot>,
    synced: watch::Receiver<bool>,
    node: watch::Receiver<Option<NodeInfo>>,
    metrics: Metrics,
    task: JoinHandle<()>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn start_agent(api: &FakeApi) -> Agent {
    let metrics = Metrics::default();
    let d = Discovery::new(
        api.client(),
        Config {
            node_name: NODE.into(),
        },
        metrics.clone(),
    );
    Agent {
        snapshots: d.snapshots(),
        synced: d.synced(),
        node: d.node(),
        metrics,
        task: tokio::spawn(d.run()),
    }
}

/// [`start_agent`], once its initial lists are done.
async fn start_synced_agent(api: &FakeApi) -> Agent {
    let mut agent = start_agent(api);
    wait_for(&mut agent.synced, WAIT, "initial lists done", |s| {
        s.then_some(())
    })
    .await;
    agent
}

/// Waits until the agent has a watch open on Services and on EndpointSlices, so that a
/// `drop_watches` hits both.
async fn watches_open(api: &FakeApi) {
    eventually(WAIT, "watches open", || {
        api.watch_requests("/api/v1/services") >= 1
            && api.watch_requests("/apis/discovery.k8s.io/v1/endpointslices") >= 1
    })
    .await;
}

fn key(name: &str) -> ServiceKey {
    ServiceKey::new("ns", name)
}

/// Ready endpoints of `ns/name` port 80, or `None` if the Service is not published.
fn ready(snap: &Snapshot, name: &str) -> Option<usize> {
    Some(snap.get(&key(name))?.port(80)?.ready().count())
}

fn mode(snap: &Snapshot, name: &str) -> Option<Mode> {
    Some(snap.get(&key(name))?.mode)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opt_in_publishes_vip_and_ready_endpoints() {
    let api = FakeApi::start().await;
    api.apply(&mk_slice("web-a", "web", 2));
    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    api.apply(&mk_service("other", &[]));
    let mut agent = start_synced_agent(&api).await;
    assert_eq!(
        ready(&agent.snapshots.borrow(), "web"),
        Some(2),
        "once synced, the Service is published with its endpoints"
    );
    let state = wait_for(&mut agent.snapshots, WAIT, "web published", |s| {
        s.get(&key("web")).cloned()
    })
    .await;
    assert_eq!(state.mode, Mode::Request);
    let addrs: Vec<SocketAddr> = state.port(80).unwrap().ready().map(|e| e.addr).collect();
    assert_eq!(
        addrs,
        vec![
            "10.0.0.1:8080".parse::<SocketAddr>().unwrap(),
            "10.0.0.2:8080".parse().unwrap()
        ],
        "named targetPort resolves through the slice port"
    );
    assert_eq!(
        state.port(80).unwrap().endpoints[0].target_name.as_deref(),
        Some("web-1")
    );
    let snap = agent.snapshots.borrow().clone();
    assert_eq!(
        snap.len(),
        1,
        "a Service without skewless.io/mode is not published"
    );
    assert_eq!(snap.vips()[0].addr, "10.96.0.10:80".parse().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mode_change_then_opt_out_update_the_published_state() {
    let api = FakeApi::start().await;
    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    let mut agent = start_agent(&api);
    wait_for(&mut agent.snapshots, WAIT, "request mode", |s| {
        (mode(s, "web") == Some(Mode::Request)).then_some(())
    })
    .await;
    api.apply(&mk_service("web", &[(annotations::MODE, "connection")]));
    wait_for(&mut agent.snapshots, WAIT, "connection mode", |s| {
        (mode(s, "web") == Some(Mode::Connection)).then_some(())
    })
    .await;
    api.apply(&mk_service("web", &[]));
    wait_for(&mut agent.snapshots, WAIT, "opted out", |s| {
        s.get(&key("web")).is_none().then_some(())
    })
    .await;
    assert!(api.events().is_empty(), "valid changes post no Event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_two_ten_three_is_reflected_in_ready_endpoints() {
    let api = FakeApi::start().await;
    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    api.apply(&mk_slice("web-a", "web", 2));
    let mut agent = start_agent(&api);
    for n in [2, 10, 3] {
        api.apply(&mk_slice("web-a", "web", n));
        wait_for(&mut agent.snapshots, WAIT, &format!("{n} endpoints"), |s| {
            (ready(s, "web") == Some(n)).then_some(())
        })
        .await;
    }
    api.delete(&mk_slice("web-a", "web", 3));
    wait_for(&mut agent.snapshots, WAIT, "slice deleted", |s| {
        (ready(s, "web") == Some(0)).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_annotation_keeps_last_good_config_and_posts_one_warning_event() {
    let api = FakeApi::start().await;
    api.apply(&mk_service("web", &[(annotations::MODE, "connection")]));
    api.apply(&mk_slice("web-a", "web", 2));
    let mut agent = start_agent(&api);
    wait_for(&mut agent.snapshots, WAIT, "web published", |s| {
        ready(s, "web").filter(|n| *n == 2)
    })
    .await;

    let bad = mk_service(
        "web",
        &[
            (annotations::MODE, "connection"),
            (annotations::HOLD_TIME, "soon"),
        ],
    );
    api.apply(&bad);
    // Applying it again (any resync) must not post a second Event.
    api.apply(&bad);
    eventually(WAIT, "one warning event posted", || {
        !api.events().is_empty()
    })
    .await;
    // Endpoint changes keep flowing under the last good config.
    api.apply(&mk_slice("web-a", "web", 3));
    wait_for(&mut agent.snapshots, WAIT, "3 endpoints", |s| {
        ready(s, "web").filter(|n| *n == 3)
    })
    .await;
    assert_eq!(
        mode(&agent.snapshots.borrow(), "web"),
        Some(Mode::Connection)
    );

    let events = api.events();
    assert_eq!(events.len(), 1, "exactly one Event: {events:#?}");
    let ev = &events[0];
    assert_eq!(ev["type"], "Warning");
    assert_eq!(ev["reason"], "InvalidDuration");
    assert_eq!(ev["regarding"]["kind"], "Service");
    assert_eq!(ev["regarding"]["name"], "web");
    assert_eq!(ev["reportingInstance"], NODE);
    assert!(
        ev["note"]
            .as_str()
            .unwrap()
            .contains("skewless.io/hold-time"),
        "the note names the annotation: {}",
        ev["note"]
    );
    assert_eq!(agent.metrics.rejected_total("InvalidDuration"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_service_is_not_published_and_gets_an_event() {
    let api = FakeApi::start().await;
    let mut headless = mk_service("headless", &[(annotations::MODE, "request")]);
    headless.spec.as_mut().unwrap().cluster_ip = Some("None".into());
    headless.spec.as_mut().unwrap().cluster_ips = Some(vec!["None".into()]);
    api.apply(&headless);
    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    let mut agent = start_agent(&api);
    wait_for(&mut agent.snapshots, WAIT, "web published", |s| {
        s.get(&key("web")).cloned()
    })
    .await;
    eventually(WAIT, "headless event", || !api.events().is_empty()).await;
    assert!(agent.snapshots.borrow().get(&key("headless")).is_none());
    assert_eq!(api.events()[0]["reason"], "Headless");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_restart_catches_up_with_changes_made_while_down() {
    let mut api = FakeApi::start().await;
    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    api.apply(&mk_slice("web-a", "web", 2));
    let mut agent = start_agent(&api);
    wait_for(&mut agent.snapshots, WAIT, "2 endpoints", |s| {
        ready(s, "web").filter(|n| *n == 2)
    })
    .await;
    let watches = api.watch_requests("/api/v1/services");
    api.restart(Duration::from_millis(300), |api| {
        api.apply(&mk_slice("web-a", "web", 5));
        api.apply(&mk_service("web", &[(annotations::MODE, "observe")]));
    })
    .await;
    wait_for(&mut agent.snapshots, WAIT, "changes made while down", |s| {
        (ready(s, "web") == Some(5) && mode(s, "web") == Some(Mode::Observe)).then_some(())
    })
    .await;
    assert!(
        api.watch_requests("/api/v1/services") > watches,
        "the agent reconnected after the restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_watch_resumes_from_its_resource_version_without_relist() {
    let api = FakeApi::start().await;
    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    api.apply(&mk_slice("web-a", "web", 2));
    let mut agent = start_agent(&api);
    wait_for(&mut agent.snapshots, WAIT, "2 endpoints", |s| {
        ready(s, "web").filter(|n| *n == 2)
    })
    .await;
    watches_open(&api).await;
    let lists = api.full_lists("/apis/discovery.k8s.io/v1/endpointslices");
    let watches = api.watch_requests("/apis/discovery.k8s.io/v1/endpointslices");
    api.drop_watches();
    api.apply(&mk_slice("web-a", "web", 4));
    wait_for(&mut agent.snapshots, WAIT, "4 endpoints after drop", |s| {
        ready(s, "web").filter(|n| *n == 4)
    })
    .await;
    assert_eq!(
        api.full_lists("/apis/discovery.k8s.io/v1/endpointslices"),
        lists,
        "a dropped watch with a valid resourceVersion must resume, not relist"
    );
    assert!(
        api.watch_requests("/apis/discovery.k8s.io/v1/endpointslices") > watches,
        "the watch was dropped and re-established"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_410_forces_a_relist_that_removes_missed_deletions() {
    let api = FakeApi::start().await;
    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    api.apply(&mk_service("old", &[(annotations::MODE, "request")]));
    api.apply(&mk_slice("web-a", "web", 2));
    let mut agent = start_agent(&api);
    wait_for(&mut agent.snapshots, WAIT, "both published", |s| {
        (s.len() == 2 && ready(s, "web") == Some(2)).then_some(())
    })
    .await;
    watches_open(&api).await;
    let lists = api.full_lists("/api/v1/services");
    // The deletion happens while the agent is not watching, and history is compacted, so the
    // DELETED event is lost: only the relist can notice.
    api.change_behind_watches(|c| {
        c.delete(&mk_service("old", &[]));
        c.apply(&mk_slice("web-a", "web", 6));
    });
    wait_for(&mut agent.snapshots, WAIT, "relist applied", |s| {
        (s.get(&key("old")).is_none() && ready(s, "web") == Some(6)).then_some(())
    })
    .await;
    assert!(
        api.full_lists("/api/v1/services") > lists,
        "410 Gone must make the watcher list again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_watch_timeouts_and_bookmarks_do_not_cause_relists() {
    let api = FakeApi::start().await;
    api.set_max_watch(Duration::from_millis(300));
    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    let mut agent = start_agent(&api);
    wait_for(&mut agent.snapshots, WAIT, "web published", |s| {
        s.get(&key("web")).cloned()
    })
    .await;
    for n in 1..=3 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        api.apply(&mk_slice("web-a", "web", n));
        wait_for(&mut agent.snapshots, WAIT, &format!("{n} endpoints"), |s| {
            ready(s, "web").filter(|r| *r == n)
        })
        .await;
    }
    assert_eq!(
        api.full_lists("/api/v1/services"),
        1,
        "watches that end on timeout are resumed from the last bookmark"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_node_is_published() {
    let api = FakeApi::start().await;
    api.apply(&mk_node("node-b", "zone-2"));
    api.apply(&mk_node(NODE, "zone-1"));
    let mut agent = start_agent(&api);
    let node = wait_for(&mut agent.node, WAIT, "node seen", Clone::clone).await;
    assert_eq!(node.name, NODE, "only our own Node is watched");
    assert_eq!(node.zone.as_deref(), Some("zone-1"));
    assert_eq!(node.pod_cidrs, vec!["10.0.0.0/24".to_owned()]);
}

/// EndpointSlice change on the API server -> new state published by the index. Prints the
/// distribution; the target is <= 100 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpointslice_change_is_published_within_100ms() {
    let api = FakeApi::start().await;
    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    api.apply(&mk_slice("web-a", "web", 1));
    let mut agent = start_agent(&api);
    wait_for(&mut agent.snapshots, WAIT, "1 endpoint", |s| {
        ready(s, "web").filter(|n| *n == 1)
    })
    .await;
    let mut samples = Vec::new();
    for i in 0..50 {
        let n = 2 + i % 9;
        let t0 = tokio::time::Instant::now();
        api.apply(&mk_slice("web-a", "web", n));
        wait_for(&mut agent.snapshots, WAIT, &format!("{n} endpoints"), |s| {
            ready(s, "web").filter(|r| *r == n)
        })
        .await;
        samples.push(t0.elapsed());
    }
    samples.sort();
    let p50 = samples[samples.len() / 2];
    let p99 = samples[samples.len() * 99 / 100];
    let max = samples[samples.len() - 1];
    println!(
        "endpointslice -> published state latency over 50 changes: p50={p50:?} p99={p99:?} max={max:?}"
    );
    assert!(
        p50 <= Duration::from_millis(100),
        "p50 {p50:?} over the 100 ms target"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opt_in_fetches_the_services_slices_and_opt_out_drops_them() {
    let api = FakeApi::start().await;
    api.apply(&mk_service("web", &[]));
    api.apply(&mk_slice("web-a", "web", 2));
    api.apply(&mk_slice("other-a", "other", 3));
    let mut agent = start_synced_agent(&api).await;
    assert!(agent.snapshots.borrow().is_empty());

    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    wait_for(
        &mut agent.snapshots,
        WAIT,
        "web published with its slice",
        |s| ready(s, "web").filter(|n| *n == 2),
    )
    .await;
    let fetches: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.path.contains("/namespaces/"))
        .collect();
    assert_eq!(
        fetches.iter().map(|r| r.path.as_str()).collect::<Vec<_>>(),
        ["/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices/web-a"],
        "the opt-in gets the Service's one slice by name, nothing of `other`"
    );
    assert!(
        fetches.iter().all(|r| r.is_get() && !r.is_quorum_read()),
        "from the watch cache: {fetches:?}"
    );

    // Changes after the fetch arrive through the watch.
    api.apply(&mk_slice("web-a", "web", 5));
    wait_for(&mut agent.snapshots, WAIT, "5 endpoints", |s| {
        ready(s, "web").filter(|n| *n == 5)
    })
    .await;
    api.apply(&mk_service("web", &[]));
    wait_for(&mut agent.snapshots, WAIT, "opted out", |s| {
        s.is_empty().then_some(())
    })
    .await;
    // Opting in again fetches again: the slices were dropped with the opt-out.
    api.apply(&mk_slice("web-a", "web", 4));
    api.apply(&mk_service("web", &[(annotations::MODE, "observe")]));
    wait_for(
        &mut agent.snapshots,
        WAIT,
        "web back with 4 endpoints",
        |s| ready(s, "web").filter(|n| *n == 4),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_opt_in_leaves_out_a_slice_gone_before_its_get_and_does_not_retry() {
    let api = FakeApi::start().await;
    api.apply(&mk_service("web", &[]));
    api.apply(&mk_slice("web-a", "web", 2));
    api.apply(&mk_slice("web-b", "web", 3));
    let mut agent = start_synced_agent(&api).await;
    // The watch showed web-b; its deletion has not reached the agent when web opts in.
    api.change(|c| c.delete_unannounced(Kind::EndpointSlice, "ns", "web-b"));
    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    let first = wait_for(&mut agent.snapshots, WAIT, "web published", |s| {
        ready(s, "web")
    })
    .await;
    assert_eq!(first, 2, "web-a only: web-b was not found");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let gets = |name: &str| {
        let path = format!("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices/{name}");
        api.requests().iter().filter(|r| r.path == path).count()
    };
    assert_eq!(
        (gets("web-a"), gets("web-b")),
        (1, 1),
        "each slice got once: not found is an answer, not a failure"
    );
    assert_eq!(ready(&agent.snapshots.borrow(), "web"), Some(2));
}

/// A cluster of 600 slices (more than a page) and an opted-in `web`; returns the agent once
/// `web` is published, after a relist and an opt-in's fetch.
async fn list_relist_and_fetch(api: &FakeApi) -> Agent {
    api.apply(&mk_node(NODE, "zone-1"));
    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    api.change(|c| {
        for i in 0..600 {
            c.apply(&mk_slice(&format!("s-{i}"), &format!("svc-{i}"), 1));
        }
        c.apply(&mk_slice("web-a", "web", 2));
    });
    let mut agent = start_agent(api);
    wait_for(&mut agent.snapshots, WAIT, "web published", |s| {
        ready(s, "web").filter(|n| *n == 2)
    })
    .await;
    watches_open(api).await;
    // A relist: history compacted behind the watches, which then get 410 Gone.
    let lists = api.full_lists("/api/v1/services");
    api.change_behind_watches(|c| c.apply(&mk_slice("web-a", "web", 3)));
    wait_for(&mut agent.snapshots, WAIT, "relisted", |s| {
        ready(s, "web").filter(|n| *n == 3)
    })
    .await;
    eventually(WAIT, "services relisted", || {
        api.full_lists("/api/v1/services") > lists
    })
    .await;
    // An opt-in's fetch.
    api.apply(&mk_service("svc-7", &[(annotations::MODE, "request")]));
    wait_for(&mut agent.snapshots, WAIT, "svc-7 published", |s| {
        ready(s, "svc-7").filter(|n| *n == 1)
    })
    .await;
    agent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_lists_relists_and_fetches_are_not_quorum_reads() {
    let api = FakeApi::start().await;
    let _agent = list_relist_and_fetch(&api).await;
    let requests = api.requests();
    let quorum: Vec<_> = requests.iter().filter(|r| r.is_quorum_read()).collect();
    assert!(
        quorum.is_empty(),
        "no list may need a quorum read: {quorum:#?}"
    );
    let streamed: Vec<_> = requests
        .iter()
        .filter(|r| r.is_watch() && r.query.contains_key("sendInitialEvents"))
        .collect();
    for path in [
        "/api/v1/services",
        "/apis/discovery.k8s.io/v1/endpointslices",
        "/api/v1/nodes",
    ] {
        assert!(
            streamed.iter().filter(|r| r.path == path).count() >= 1,
            "{path} is listed by a streaming list: {requests:#?}"
        );
    }
    assert!(
        streamed
            .iter()
            .filter(|r| r.path == "/api/v1/services")
            .count()
            >= 2,
        "the relist is a streaming list too: {requests:#?}"
    );
    let lists: Vec<_> = requests.iter().filter(|r| r.is_list()).collect();
    assert!(
        lists.is_empty(),
        "every list is a streaming one: {lists:#?}"
    );
    let gets: Vec<_> = requests.iter().filter(|r| r.is_get()).collect();
    assert!(
        !gets.is_empty()
            && gets.iter().all(|r| r
                .query
                .get("resourceVersion")
                .is_some_and(|v| v.parse::<u64>().is_ok_and(|v| v > 0))),
        "an opt-in's gets are not older than the watch: {gets:#?}"
    );
    assert!(
        requests.iter().filter(|r| r.is_watch()).all(|r| r
            .query
            .get("allowWatchBookmarks")
            .map(String::as_str)
            == Some("true")),
        "every watch asks for bookmarks"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_without_streaming_lists_gets_paged_lists() {
    let api = FakeApi::start().await;
    api.set_watch_list(false);
    let _agent = list_relist_and_fetch(&api).await;
    let requests = api.requests();
    let lists: Vec<_> = requests
        .iter()
        .filter(|r| r.is_list() && !r.path.contains("/namespaces/"))
        .collect();
    assert!(
        lists.iter().any(|r| r.query.contains_key("continue")),
        "the slice list is paged: {lists:#?}"
    );
    assert!(
        lists.iter().all(|r| r.query.contains_key("continue")
            || r.query.get("limit").map(String::as_str) == Some("500")),
        "every list is paged: {lists:#?}"
    );
    assert!(
        requests
            .iter()
            .filter(|r| r.is_watch() && r.query.contains_key("sendInitialEvents"))
            .count()
            <= 3,
        "refused once per resource, then never asked again: {requests:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_made_while_an_opt_ins_fetch_is_in_flight_is_not_lost() {
    let api = FakeApi::start().await;
    api.apply(&mk_service("web", &[]));
    api.apply(&mk_slice("web-a", "web", 2));
    let mut agent = start_synced_agent(&api).await;
    // The fetch's answer is older than the change below, which the watch delivers first.
    api.set_list_delay(Duration::from_millis(500));
    api.apply(&mk_service("web", &[(annotations::MODE, "request")]));
    let fetches = || {
        api.requests()
            .iter()
            .filter(|r| r.path == "/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices/web-a")
            .count()
    };
    eventually(WAIT, "the fetch is asked", || fetches() == 1).await;
    api.apply(&mk_slice("web-a", "web", 5));
    let first = wait_for(&mut agent.snapshots, WAIT, "web published", |s| {
        ready(s, "web")
    })
    .await;
    assert_eq!(
        first, 5,
        "published once, with the change made during the fetch on top of what it got"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ready(&agent.snapshots.borrow(), "web"), Some(5));
}
