//! Privileged: the real `skewless agent --kubernetes` against the fake API server (the real
//! list/watch wire protocol, shared with agent/k8s's tests), asserting what reaches the
//! balancer and the eBPF redirect map, how long an EndpointSlice change takes to reach
//! the balancer's endpoint set, and that a changed tuning annotation reconfigures the running
//! balancer under load.
//!
//! The agent runs in this process's network namespace with the balancers on 127.0.0.1 and no
//! pod cgroup attached, so the redirect entries it writes are inspected but route nothing,
//! and every endpoint is a loopback address (nothing listens there; connects are refused).

mod admin_api;
#[path = "../../k8s/tests/support/mod.rs"]
mod support;

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use admin_api::{AgentProcess, free_admin_addr, get, status};
use k8s_openapi::{
    api::{
        core::v1::{Node, Service, ServicePort, ServiceSpec},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use support::FakeApi;

const VIP: &str = "198.19.0.40";

fn mk_service(mode: Option<&str>) -> Service {
    mk_annotated_service(mode.map(|m| ("skewless.io/mode", m)).as_slice())
}

fn mk_annotated_service(annotations: &[(&str, &str)]) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some("echo".into()),
            namespace: Some("ns".into()),
            uid: Some("uid-echo".into()),
            annotations: (!annotations.is_empty()).then(|| {
                annotations
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect()
            }),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some(VIP.into()),
            cluster_ips: Some(vec![VIP.into()]),
            ports: Some(vec![ServicePort {
                name: Some("grpc".into()),
                port: 50051,
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

fn mk_slice(n: usize) -> EndpointSlice {
    mk_slice_on(n, 18080)
}

/// `n` endpoints `echo-<i>` at 127.0.1.<i>:`port`.
fn mk_slice_on(n: usize, port: i32) -> EndpointSlice {
    support::ready_slice("echo-abc", "echo", n, "127.0.1.", port)
}

fn mk_node() -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some("node-a".into()),
            ..ObjectMeta::default()
        },
        ..Node::default()
    }
}

/// Polls `/status` until `f` holds (15 s at most); returns how long that took.
async fn until(admin: &str, what: &str, f: impl Fn(&serde_json::Value) -> bool) -> Duration {
    admin_api::until(admin, what, Duration::from_secs(15), f).await
}

fn balancer_endpoints(s: &serde_json::Value) -> Option<usize> {
    s["services"].as_array()?.first()?["endpoints"]
        .as_array()
        .map(Vec::len)
}

fn redirected(s: &serde_json::Value) -> bool {
    s["redirects"]
        .as_array()
        .is_some_and(|r| r.iter().any(|r| r["service"] == format!("{VIP}:50051")))
}

/// Starts `skewless agent --kubernetes` against `api`, balancers on 127.0.0.1; returns the
/// process (killed on drop) and its admin address.
fn start_agent(api: &FakeApi, name: &str) -> (AgentProcess, String) {
    let dir =
        std::env::temp_dir().join(format!("skewless-kube-test-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig()).unwrap();
    let admin = free_admin_addr();
    let child = Command::new(env!("CARGO_BIN_EXE_skewless"))
        .args([
            "agent",
            "--kubernetes",
            "--node-name",
            "node-a",
            "--balancer-ip",
            "127.0.0.1",
            "--admin-addr",
            &admin,
        ])
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    (AgentProcess { child, dir }, admin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
async fn kubernetes_changes_reach_balancer_and_redirect_map() {
    let api = FakeApi::start().await;
    api.apply(&mk_node());
    api.apply(&mk_service(Some("request")));
    api.apply(&mk_slice(2));

    let (_agent, admin) = start_agent(&api, "changes");

    // Opt-in: a balancer with the slice's 2 endpoints, and the VIP in the redirect map.
    until(&admin, "opt-in reaches the balancer", |s| {
        balancer_endpoints(s) == Some(2) && redirected(s)
    })
    .await;

    // Scale 2 -> 10 -> 3, several times: the latency from the API change to the balancer's own
    // endpoint set (its stats list the endpoints it balances over).
    let mut latencies = Vec::new();
    for _ in 0..5 {
        for n in [10, 3] {
            api.apply(&mk_slice(n));
            latencies.push(
                until(&admin, "the scale reaches the balancer", |s| {
                    balancer_endpoints(s) == Some(n)
                })
                .await,
            );
        }
    }
    latencies.sort();
    println!(
        "EndpointSlice change -> balancer endpoint set: p50 {:?}, max {:?} over {} changes",
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1],
        latencies.len()
    );

    // The same state in /metrics (OpenMetrics text), one row per backend.
    let metrics = String::from_utf8(get(&admin, "/metrics").await.unwrap().to_vec()).unwrap();
    let ready =
        format!("skewless_service_ready_backends{{service=\"ns/echo\",vip=\"{VIP}:50051\"}} 3");
    assert!(
        metrics.contains(&ready),
        "ready backends must be exported: {metrics}"
    );
    let rows = metrics
        .lines()
        .filter(|l| l.starts_with("skewless_backend_requests_total{"))
        .count();
    assert_eq!(rows, 3, "one request counter per backend: {metrics}");
    assert!(
        metrics.contains("skewless_connect_seen_total "),
        "kernel counters must be exported: {metrics}"
    );

    // A bad annotation keeps the last good config (still redirected, still 3 endpoints) and
    // posts a Warning Event on the Service.
    api.apply(&mk_service(Some("sideways")));
    support::eventually(Duration::from_secs(10), "a Warning Event is posted", || {
        api.events()
            .iter()
            .any(|e| e["type"] == "Warning" && e["regarding"]["name"] == "echo")
    })
    .await;
    let s = status(&admin).await.unwrap();
    assert!(
        redirected(&s) && balancer_endpoints(&s) == Some(3),
        "last good config must stay: {s}"
    );

    // Opt-out: the redirect entry and the balancer go away.
    api.apply(&mk_service(None));
    until(&admin, "opt-out removes the redirect", |s| {
        !redirected(s) && balancer_endpoints(s).is_none()
    })
    .await;

    // Opt in again, then change the mode: how long until the redirect map says so (the next
    // connect() follows the map at once).
    let mut opt_in = Vec::new();
    let mut mode_change = Vec::new();
    for _ in 0..5 {
        api.apply(&mk_service(Some("request")));
        opt_in.push(until(&admin, "opt-in writes the redirect", redirected).await);
        api.apply(&mk_service(Some("observe")));
        mode_change.push(
            until(&admin, "mode observe removes the redirect", |s| {
                !redirected(s)
            })
            .await,
        );
    }
    println!(
        "opt-in -> redirect entry: max {:?}; mode change -> entry removed: max {:?} (5 each)",
        opt_in.iter().max().unwrap(),
        mode_change.iter().max().unwrap()
    );
}

fn first_service(s: &serde_json::Value) -> Option<&serde_json::Value> {
    s["services"].as_array()?.first()
}

/// The state the balancer reports for backend `name` (`Active`, `NotServing`, ...).
fn backend_state<'a>(s: &'a serde_json::Value, name: &str) -> Option<&'a str> {
    first_service(s)?["endpoints"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)?["state"]
        .as_str()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
async fn health_annotation_change_reconfigures_the_running_balancer_without_failing_calls() {
    use skewless_echo::{SpawnedEcho, pb::EchoRequest, pb::echo_client::EchoClient};
    // Three real echo pods at 127.0.1.{1,2,3}, one port; echo-3 reports NOT_SERVING all along.
    let first = tokio::net::TcpListener::bind("127.0.1.1:0").await.unwrap();
    let port = first.local_addr().unwrap().port();
    let mut pods = vec![SpawnedEcho::start_on(first, "echo-1").await.unwrap()];
    for i in 2..=3 {
        let addr = format!("127.0.1.{i}:{port}").parse().unwrap();
        pods.push(
            SpawnedEcho::start(addr, &format!("echo-{i}"))
                .await
                .unwrap(),
        );
    }
    pods[2].control.set_serving(false).await;

    let api = FakeApi::start().await;
    api.apply(&mk_node());
    api.apply(&mk_service(Some("request")));
    api.apply(&mk_slice_on(3, i32::from(port)));
    let (_agent, admin) = start_agent(&api, "tuning");
    until(&admin, "the balancer has the 3 pods", |s| {
        balancer_endpoints(s) == Some(3) && redirected(s)
    })
    .await;
    let listener = |s: &serde_json::Value| first_service(s).map(|f| f["listener"].clone());
    let listen_addr = listener(&status(&admin).await.unwrap()).unwrap();

    // Calls go straight to the balancer's listener (no pod cgroup is attached here): 4 unary
    // callers and one bidi stream, from before the first change to after the last.
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", listen_addr.as_str().unwrap()))
            .unwrap()
            .timeout(Duration::from_secs(10))
            .connect()
            .await
            .expect("client connects to the balancer");
    let client = EchoClient::new(channel);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let running = |stop: &std::sync::Arc<std::sync::atomic::AtomicBool>| {
        !stop.load(std::sync::atomic::Ordering::Relaxed)
    };
    let mut callers = Vec::new();
    for _ in 0..4 {
        let (mut c, stop) = (client.clone(), stop.clone());
        callers.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            while running(&stop) {
                let sent = Instant::now();
                let r = c
                    .echo(EchoRequest {
                        payload: b"t".to_vec(),
                        ..EchoRequest::default()
                    })
                    .await
                    .map(|r| r.into_inner().pod);
                seen.push((sent, Instant::now(), r));
            }
            seen
        }));
    }
    let stream = {
        let (mut c, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let mut replies = c
                .bidi(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await?
                .into_inner();
            let mut got = 0u32;
            while running(&stop) {
                tx.send(EchoRequest::default()).await.expect("stream open");
                replies
                    .message()
                    .await?
                    .ok_or_else(|| tonic::Status::internal("stream ended early"))?;
                got += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            drop(tx);
            while replies.message().await?.is_some() {}
            Ok::<_, tonic::Status>(got)
        })
    };

    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_millis(800)).await;
    // Health checking on: the NOT_SERVING pod leaves the rotation.
    let on = Instant::now();
    api.apply(&mk_annotated_service(&[
        ("skewless.io/mode", "request"),
        (
            "skewless.io/grpc-health-service",
            skewless_echo::SERVICE_NAME,
        ),
    ]));
    let took_on = until(&admin, "echo-3 is NotServing", |s| {
        backend_state(s, "echo-3") == Some("NotServing")
    })
    .await;
    let out_from = Instant::now();
    tokio::time::sleep(Duration::from_millis(800)).await;
    // And off again: it is back.
    let off = Instant::now();
    api.apply(&mk_service(Some("request")));
    let took_off = until(&admin, "echo-3 is Active again", |s| {
        backend_state(s, "echo-3") == Some("Active")
    })
    .await;
    let back_from = Instant::now();
    tokio::time::sleep(Duration::from_millis(800)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let end = Instant::now();

    let mut calls = Vec::new();
    for c in callers {
        calls.extend(c.await.unwrap());
    }
    let streamed = stream.await.unwrap();
    let failed: Vec<_> = calls
        .iter()
        .filter_map(|(_, _, r)| r.as_ref().err())
        .collect();
    assert!(
        failed.is_empty(),
        "no call fails across the annotation changes: {} of {}, e.g. {:?}",
        failed.len(),
        calls.len(),
        failed.first()
    );
    // It only ends (Ok) after `stop`, so it was open across both changes.
    assert!(
        streamed.as_ref().is_ok_and(|n| *n >= 5),
        "a stream open across both changes goes on: {streamed:?}"
    );
    let s = status(&admin).await.unwrap();
    assert_eq!(
        listener(&s),
        Some(listen_addr),
        "the balancer was reconfigured in place, not replaced"
    );
    // Calls sent after `from` and done before `to`, so picked between the two.
    let tally = |from: Instant, to: Instant| -> Vec<usize> {
        (1..=3)
            .map(|i| {
                calls
                    .iter()
                    .filter(|(sent, done, r)| {
                        *sent >= from
                            && *done < to
                            && r.as_ref().is_ok_and(|p| *p == format!("echo-{i}"))
                    })
                    .count()
            })
            .collect()
    };
    let (before, during, after) = (tally(t0, on), tally(out_from, off), tally(back_from, end));
    println!(
        "health annotation set -> NotServing in /status: {took_on:?}; removed -> Active: {took_off:?}; echo-1..3 calls before {before:?}, health on {during:?}, health off {after:?}"
    );
    assert!(
        before[2] > 0,
        "without health checks the NOT_SERVING pod gets calls: {before:?}"
    );
    assert!(
        during[2] == 0 && during[0] > 0 && during[1] > 0,
        "with the health annotation it gets none: {during:?}"
    );
    assert!(
        after[2] > 0,
        "annotation removed, it gets calls again: {after:?}"
    );
    for p in pods {
        p.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
async fn agent_started_while_the_api_is_down_redirects_nothing_until_it_has_listed() {
    let mut api = FakeApi::start().await;
    api.apply(&mk_node());
    api.apply(&mk_service(Some("request")));
    api.apply(&mk_slice(2));

    // The agent starts while the API server is down; what it shows meanwhile is sampled by a
    // task of its own (`restart` holds the server down for 4 s).
    let agent = std::sync::Arc::new(std::sync::Mutex::new(None));
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    api.restart(Duration::from_secs(4), |api| {
        let (process, admin) = start_agent(api, "api-down");
        *agent.lock().unwrap() = Some((process, admin.clone()));
        let seen = std::sync::Arc::clone(&seen);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            for _ in 0..5 {
                let ready = get(&admin, "/ready").await.map(|b| b.to_vec());
                let metrics = get(&admin, "/metrics").await.map(|b| b.to_vec());
                let s = status(&admin).await;
                seen.lock().unwrap().push((ready, metrics, s));
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        });
    })
    .await;
    let samples = std::mem::take(&mut *seen.lock().unwrap());
    assert!(
        samples.len() >= 3,
        "the agent must answer while the API is down"
    );
    for (ready, metrics, s) in samples {
        let ready = String::from_utf8_lossy(&ready.expect("/ready answers")).into_owned();
        assert!(
            ready.contains("no model yet") && ready.contains("Kubernetes"),
            "/ready must say the agent waits for the API: {ready:?}"
        );
        let metrics = String::from_utf8_lossy(&metrics.expect("/metrics answers")).into_owned();
        assert!(
            metrics.lines().any(|l| l == "skewless_model_ready 0"),
            "model_ready must be 0 while the API is down:\n{metrics}"
        );
        let s = s.expect("/status answers");
        assert!(
            !redirected(&s),
            "nothing may be redirected without a model: {s}"
        );
    }

    // The API is back: the first full list arrives, and only then the redirect.
    let admin = agent.lock().unwrap().as_ref().unwrap().1.clone();
    until(&admin, "the listed Service is redirected", |s| {
        redirected(s) && balancer_endpoints(s) == Some(2)
    })
    .await;
    let ready = get(&admin, "/ready").await.unwrap();
    assert_eq!(&ready[..], b"ok\n");
}
