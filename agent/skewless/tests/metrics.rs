//! Privileged: the real agent's metrics against what its clients saw, and scraped by a real
//! Prometheus (Debian's, started in the testbed node on its loopback) that runs every
//! dashboard query and rule expression. Run with `cargo xtask test` (as root).

mod testbed_agent;

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
};

use skewless_testbed::{Place, Testbed, grpc, scripts};
use testbed_agent::{
    ADMIN, ECHO_PODS, TempPath, echo_bed, services_in_status, spawn_file_agent, status_json,
    wait_until, write_services,
};

/// The agent's `/metrics` text, read inside the node.
fn scrape(tb: &Testbed) -> String {
    get(tb, &format!("http://{ADMIN}/metrics"))
}

fn get(tb: &Testbed, url: &str) -> String {
    let out = tb
        .run(Place::Node(0), &["python3", scripts::HTTP_GET, url])
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    String::from_utf8(out.stdout).expect("utf-8")
}

/// `(labels, value)` of every sample of `name` (exact name, labelled or not).
fn samples(text: &str, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = if let Some(r) = rest.strip_prefix('{') {
                let end = r.find('}')?;
                (&r[..end], r[end + 1..].trim())
            } else if rest.starts_with(' ') {
                ("", rest.trim())
            } else {
                return None;
            };
            let labels = labels
                .split("\",")
                .filter(|kv| !kv.is_empty())
                .filter_map(|kv| {
                    let (k, v) = kv.split_once("=\"")?;
                    Some((k.to_owned(), v.trim_end_matches('"').to_owned()))
                })
                .collect();
            Some((labels, value.split(' ').next()?.parse().ok()?))
        })
        .collect()
}

/// The value of `name` for `backend` (the one sample with that label).
fn backend_value(text: &str, name: &str, backend: &str) -> f64 {
    let rows: Vec<f64> = samples(text, name)
        .into_iter()
        .filter(|(l, _)| l.get("backend").map(String::as_str) == Some(backend))
        .map(|(_, v)| v)
        .collect();
    assert_eq!(rows.len(), 1, "one {name} for {backend}: {rows:?}");
    rows[0]
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn per_backend_counters_and_histograms_equal_the_clients_own_tallies() {
    const CALLS: u32 = 400;
    let vip = SocketAddrV4::new(Ipv4Addr::new(198, 19, 0, 40), 50051);
    let (mut tb, gen_dir) = echo_bed(vip, &ECHO_PODS);
    let services = TempPath::new(format!("skewless-test-services-{}.yaml", tb.id()));
    write_services(&services, &tb, vip, "request", &ECHO_PODS);
    spawn_file_agent(&mut tb, &services);
    wait_until("the agent redirects the Service", || {
        services_in_status(&tb) == 1
    });

    // A pick_first grpcio client: one connection, its calls balanced per request; it tallies
    // which pod answered each call from the replies.
    let report = grpc::run_client(
        &tb,
        &gen_dir,
        Place::Pod("client"),
        &vip.to_string(),
        CALLS,
        4,
    )
    .unwrap();
    assert_eq!(
        report.ok,
        u64::from(CALLS),
        "every call succeeds: {report:?}"
    );
    assert!(report.pods.len() > 1, "the calls were balanced: {report:?}");

    // Quiesced: nothing in flight, and the Service's histogram has counted every call (the
    // last response's end is recorded just after the client has it).
    let mut status = serde_json::Value::Null;
    wait_until("the agent has counted every call", || {
        status = status_json(&tb);
        let svc = &status["services"][0];
        let counted: u64 = svc["latency"]["counts"]
            .as_array()
            .map_or(0, |c| c.iter().filter_map(serde_json::Value::as_u64).sum());
        let idle = svc["endpoints"]
            .as_array()
            .is_some_and(|e| e.iter().all(|e| e["in_flight"] == 0));
        idle && counted == u64::from(CALLS)
    });
    let text = scrape(&tb);
    for pod in ECHO_PODS {
        let served = report.pods.get(pod).copied().unwrap_or(0);
        let requests = backend_value(&text, "skewless_backend_requests_total", pod);
        assert_eq!(
            requests, served as f64,
            "{pod}: the agent's request counter equals the client's tally"
        );
        assert_eq!(
            backend_value(&text, "skewless_backend_failures_total", pod),
            0.0,
            "{pod}: no failure"
        );
        let endpoint = status["services"][0]["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == pod)
            .unwrap_or_else(|| panic!("{pod} in /status"));
        let histogram: u64 = endpoint["latency"]["counts"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(serde_json::Value::as_u64)
            .sum();
        assert_eq!(
            histogram, served,
            "{pod}: its latency histogram counts the client's tally"
        );
    }
    let count = samples(&text, "skewless_request_duration_seconds_count");
    assert_eq!(count.len(), 1, "one Service port: {count:?}");
    assert_eq!(
        count[0].1,
        f64::from(CALLS),
        "the Service's histogram counts every call"
    );
    let inf: Vec<f64> = samples(&text, "skewless_request_duration_seconds_bucket")
        .into_iter()
        .filter(|(l, _)| l.get("le").map(String::as_str) == Some("+Inf"))
        .map(|(_, v)| v)
        .collect();
    assert_eq!(inf, [f64::from(CALLS)], "+Inf bucket = count");
    let failed: f64 = samples(&text, "skewless_request_failures_total")
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert_eq!(failed, 0.0, "no call failed");
    // The client's one connection is still open (pick_first keeps it) or closed; either way
    // the gauge and the lifetime histogram together account for it.
    let open = samples(&text, "skewless_client_connections")[0].1;
    let closed = samples(&text, "skewless_client_connection_duration_seconds_count")[0].1;
    assert!(
        open + closed >= 1.0,
        "the client connection is counted: {open} open, {closed} closed"
    );
}
