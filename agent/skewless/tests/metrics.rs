//! Privileged: the real agent's metrics against what its clients saw, and scraped by a real
//! Prometheus (Debian's, started in the testbed node on its loopback) that runs every
//! dashboard query and rule expression. Run with `cargo xtask test` (as root).

mod testbed_agent;

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use skewless_testbed::{Place, Testbed, grpc};
use testbed_agent::{
    ADMIN, ECHO_PODS, TempPath, ThreeModes, echo_bed, services_in_status, spawn_file_agent,
    status_json, wait_until, write_services,
};

/// The agent's `/metrics` text, read inside the node.
fn scrape(tb: &Testbed) -> String {
    get(tb, &format!("http://{ADMIN}/metrics"))
}

fn get(tb: &Testbed, url: &str) -> String {
    testbed_agent::node_get(tb, url)
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

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A real Prometheus (Debian's) in the node's network namespace, on its loopback, scraping
/// the agent every second and evaluating the rules file every second.
struct Prometheus {
    dir: TempPath,
    addr: SocketAddrV4,
}

impl Prometheus {
    fn start(tb: &mut Testbed) -> Self {
        let dir = TempPath::new(format!("skewless-test-prometheus-{}", tb.id()));
        std::fs::create_dir_all(&*dir).unwrap();
        let rules = skewless_admin::monitoring::dir()
            .join(skewless_admin::monitoring::RULES_FILE)
            .canonicalize()
            .unwrap();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files: [\"{}\"]\n\
             scrape_configs:\n  - job_name: skewless\n    static_configs:\n      - targets: [\"{ADMIN}\"]\n        labels: {{node: node0}}\n",
            rules.display()
        );
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        let addr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9091);
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let mut cmd = tb
            .command(
                Place::Node(0),
                &[
                    "prometheus",
                    &format!("--config.file={}", dir.join("prometheus.yml").display()),
                    &format!("--storage.tsdb.path={}", dir.join("data").display()),
                    &format!("--web.listen-address={addr}"),
                ],
            )
            .unwrap();
        cmd.stdout(log.try_clone().unwrap()).stderr(log);
        tb.spawn_command(&mut cmd)
            .expect("prometheus must be installed (`cargo xtask setup`)");
        tb.wait_for_tcp(Place::Node(0), addr, Duration::from_secs(20))
            .expect("prometheus listens");
        Self { dir, addr }
    }

    fn api(&self, tb: &Testbed, path: &str) -> serde_json::Value {
        let body = get(tb, &format!("http://{}/api/v1/{path}", self.addr));
        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON from Prometheus");
        assert_eq!(v["status"], "success", "{path}: {v}");
        v["data"].clone()
    }

    /// The instant vector `expr` evaluates to now.
    fn query(&self, tb: &Testbed, expr: &str) -> Vec<serde_json::Value> {
        self.api(tb, &format!("query?query={}", encode(expr)))["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&*self.dir);
    }
}

/// The names `expr` references: identifiers outside label matchers and strings that name a
/// skewless metric, a recorded series, or `up`.
fn metric_names(expr: &str) -> Vec<String> {
    skewless_admin::promql::identifiers(expr)
        .into_iter()
        .filter(skewless_admin::promql::Identifier::is_series)
        .map(|i| i.name.to_owned())
        .collect()
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn a_real_prometheus_scrapes_the_agent_and_every_dashboard_query_and_rule_returns_data() {
    use skewless_admin::monitoring;
    let ThreeModes {
        mut tb,
        gen_dir,
        services,
        balanced,
        observed,
        relayed,
        traffic_from,
    } = ThreeModes::start();
    let prometheus = Prometheus::start(&mut tb);

    // Pinned pick_first clients: one to each Service (one connection each, calls until the
    // test ends). The request-mode one's calls are spread per request; the observed one's all
    // go to the pod its connection was DNATed to; the connection-mode one's to the pod its
    // connection was placed on (one connection cannot be spread: as even as possible).
    for vip in [balanced, observed, relayed] {
        testbed_agent::spawn_long_client(&mut tb, &gen_dir, vip, 2, &[]);
    }
    // A broken services file for a moment: the agent keeps its last good state and counts the
    // source error (the discovery alert's series).
    let good = std::fs::read_to_string(&*services).unwrap();
    std::fs::write(&*services, "services: [unclosed\n").unwrap();
    wait_until("the agent counts the broken file", || {
        !samples(&scrape(&tb), "skewless_source_errors_total").is_empty()
    });
    std::fs::write(&*services, good).unwrap();

    // Enough scrapes for rates over the dashboard's interval, and the observer's reports.
    let interval = "10s";
    let started = std::time::Instant::now();
    loop {
        let pinned = prometheus.query(
            &tb,
            r#"skewless_observed_backends_receiving{service="default/obs"} == 1"#,
        );
        let balancing = prometheus.query(
            &tb,
            r#"count(rate(skewless_backend_requests_total{service="default/echo"}[10s]) > 0) > 1"#,
        );
        let relaying = prometheus.query(
            &tb,
            r#"rate(skewless_request_duration_seconds_count{service="default/conn"}[10s]) > 0"#,
        );
        if !pinned.is_empty()
            && !balancing.is_empty()
            && !relaying.is_empty()
            && started.elapsed() > Duration::from_secs(15)
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "Prometheus must see the three Services within 90 s; its log: {}",
            prometheus.log()
        );
        std::thread::sleep(Duration::from_secs(1));
    }

    // The exposition follows the naming guide as promtool checks it.
    let text = scrape(&tb);
    let problems =
        monitoring::promtool_check_metrics(&text).expect("promtool (`cargo xtask setup`)");
    assert!(problems.is_empty(), "promtool check metrics: {problems:#?}");

    // The scrape itself: up, no error.
    let targets = prometheus.api(&tb, "targets");
    let active = targets["activeTargets"].as_array().expect("targets");
    assert_eq!(active.len(), 1, "{targets}");
    assert_eq!(active[0]["health"], "up", "{targets}");
    assert_eq!(active[0]["lastError"], "", "{targets}");

    // Connection mode as a scrape shows it: its one relayed connection on one backend, its
    // calls timed, the policy's skew (all on one of four) and state, nothing unrotatable.
    let conn = |name: &str| -> Vec<f64> {
        samples(&text, name)
            .into_iter()
            .filter(|(l, _)| l.get("service").map(String::as_str) == Some("default/conn"))
            .map(|(_, v)| v)
            .collect()
    };
    assert_eq!(
        conn("skewless_backend_upstream_connections")
            .iter()
            .sum::<f64>(),
        1.0,
        "one relayed connection: {text}"
    );
    assert!(
        conn("skewless_request_duration_seconds_count")[0] > 0.0,
        "connection mode's calls are timed: {text}"
    );
    let skew = conn("skewless_balancer_skew");
    assert!(
        skew.len() == 1 && (skew[0] - 4.0).abs() < 0.01,
        "all calls on one of four backends, as the policy sees it: {skew:?}"
    );
    assert_eq!(conn("skewless_rotation_state"), [1.0], "one state: {text}");
    assert_eq!(
        conn("skewless_unrotatable_connections"),
        [0.0],
        "grpcio rotates"
    );

    // Every dashboard query, with the variables substituted, returns data for one of the three
    // Services (request-mode panels for the balanced ones, observed ones for the other), and
    // every query of a number connection mode reports returns data for `conn`.
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(monitoring::dir().join(monitoring::DASHBOARD_FILE)).unwrap(),
    )
    .unwrap();
    let substitute = |expr: &str, service: &str| {
        expr.replace("$__rate_interval", interval)
            .replace("$cluster", ".*")
            .replace("$node", ".*")
            .replace("$service", service)
    };
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let answered: Vec<&str> = ["default/echo", "default/obs", "default/conn"]
                .into_iter()
                .filter(|svc| !prometheus.query(&tb, &substitute(expr, svc)).is_empty())
                .collect();
            assert!(
                !answered.is_empty(),
                "panel {:?}: no data for {expr}",
                panel["title"]
            );
            let connection_mode = [
                "skewless_backend_requests_total",
                "skewless_backend_upstream_connections",
                "skewless_request_duration_seconds",
                "skewless_balancer_skew",
                "skewless_client_connections",
                "skewless_rotation_state",
                "skewless_unrotatable_connections",
            ];
            if connection_mode.iter().any(|m| expr.contains(m)) {
                assert!(
                    answered.contains(&"default/conn"),
                    "panel {:?}: no data for the connection-mode Service: {expr}",
                    panel["title"]
                );
            }
            queries += 1;
        }
    }
    // The cluster overview and node dashboards: every query returns data with all three
    // Services running, and so do their variables' queries.
    let mut overview_queries = 0;
    for file in [
        monitoring::CLUSTER_DASHBOARD_FILE,
        monitoring::NODE_DASHBOARD_FILE,
    ] {
        let d: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(monitoring::dir().join(file)).unwrap())
                .unwrap();
        for panel in d["panels"].as_array().unwrap() {
            for target in panel["targets"].as_array().unwrap() {
                let expr = substitute(target["expr"].as_str().unwrap(), "");
                assert!(
                    !prometheus.query(&tb, &expr).is_empty(),
                    "{file}: panel {:?}: no data for {expr}",
                    panel["title"]
                );
                overview_queries += 1;
            }
        }
        for var in d["templating"]["list"].as_array().unwrap() {
            let Some(q) = var["query"]["query"].as_str() else {
                continue;
            };
            let (metric, label) = q
                .strip_prefix("label_values(")
                .and_then(|q| q.strip_suffix(')'))
                .and_then(|q| q.rsplit_once(", "))
                .unwrap_or_else(|| panic!("{file}: variable {}: {q}", var["name"]));
            let expr = format!("count by ({label}) ({})", substitute(metric, ""));
            assert!(
                !prometheus.query(&tb, &expr).is_empty(),
                "{file}: variable {}: no data for {expr}",
                var["name"]
            );
        }
    }
    assert!(
        overview_queries >= 40,
        "the overview dashboards' queries ran: {overview_queries}"
    );

    // The variables' label_values(metric, label) queries.
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        let Some(q) = var["query"]["query"].as_str() else {
            continue;
        };
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable {}: {q}", var["name"]));
        let (metric, label) = inner.rsplit_once(", ").unwrap();
        let expr = format!(
            "count by ({label}) ({})",
            substitute(metric, "default/echo")
        );
        assert!(
            !prometheus.query(&tb, &expr).is_empty(),
            "variable {}: no data for {expr}",
            var["name"]
        );
    }
    assert!(queries >= 20, "the dashboard's queries ran: {queries}");

    // Every rule loaded and evaluated without error; every recording rule has data, and every
    // series an alert reads exists.
    let rules = prometheus.api(&tb, "rules");
    let mut alerts = 0;
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            assert_eq!(rule["health"], "ok", "{rule}");
            let expr = rule["query"].as_str().unwrap();
            match rule["type"].as_str() {
                Some("recording") => assert!(
                    !prometheus.query(&tb, expr).is_empty(),
                    "recording rule {}: no data for {expr}",
                    rule["name"]
                ),
                _ => {
                    alerts += 1;
                    for name in metric_names(expr) {
                        assert!(
                            !prometheus.query(&tb, &name).is_empty(),
                            "alert {}: {name} has no data",
                            rule["name"]
                        );
                    }
                }
            }
        }
    }
    assert!(alerts >= 13, "the alerts were checked: {alerts}");

    // The pinning alert's expression is true for the pinned Service, false for the balanced.
    let pinning = rules["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter())
        .find(|r| r["name"] == "SkewlessConnectionsPinned")
        .expect("the pinning alert")["query"]
        .as_str()
        .unwrap()
        .to_owned();
    let firing: Vec<String> = prometheus
        .query(&tb, &pinning)
        .iter()
        .map(|r| {
            r["metric"]["service"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert!(
        firing.iter().any(|s| s == "default/obs"),
        "the pinned Service is flagged: {firing:?}"
    );
    assert!(
        !firing
            .iter()
            .any(|s| s == "default/echo" || s == "default/conn"),
        "the balanced Services are not: {firing:?}"
    );
    // Connection mode's alerts are false for a Service that is as even as one connection can
    // be and has nothing unrotatable (promtool's tests make them fire).
    for alert in [
        "SkewlessRotationBudgetExhausted",
        "SkewlessConnectionsUnrotatable",
    ] {
        let expr = rules["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap().iter())
            .find(|r| r["name"] == alert)
            .unwrap_or_else(|| panic!("{alert}"))["query"]
            .as_str()
            .unwrap()
            .to_owned();
        let firing = prometheus.query(&tb, &expr);
        assert!(firing.is_empty(), "{alert}: {firing:?}");
    }

    // With SKEWLESS_PANEL_DATA=DIR, run on for two minutes and keep the dashboard's time
    // series of this run for docs/metrics.md's pictures (`panel_charts` draws them).
    if let Some(dir) = std::env::var_os("SKEWLESS_PANEL_DATA") {
        std::thread::sleep(Duration::from_secs(120));
        dump_panels(
            &tb,
            &prometheus,
            &dashboard,
            traffic_from,
            std::path::Path::new(&dir),
        );
        for file in [
            monitoring::CLUSTER_DASHBOARD_FILE,
            monitoring::NODE_DASHBOARD_FILE,
        ] {
            let d: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(monitoring::dir().join(file)).unwrap(),
            )
            .unwrap();
            dump_overview_panels(
                &tb,
                &prometheus,
                &d,
                file.trim_end_matches(".json"),
                traffic_from,
                std::path::Path::new(&dir),
            );
        }
    }
}

/// Writes every time-series panel's query_range data for both Services into `dir`, one JSON
/// file per panel and Service: `{title, unit, service, series: [{name, points: [[t, v]]}]}`.
fn dump_panels(
    tb: &Testbed,
    prometheus: &Prometheus,
    dashboard: &serde_json::Value,
    from: std::time::SystemTime,
    dir: &std::path::Path,
) {
    for panel in dashboard["panels"].as_array().unwrap() {
        if panel["type"] != "timeseries" {
            continue;
        }
        for service in ["default/echo", "default/obs"] {
            let name = slug(service.trim_start_matches("default/"));
            dump_panel(tb, prometheus, panel, service, &name, from, dir);
        }
    }
}

/// The same for a dashboard without a Service variable (`node`, `cluster`): one file per
/// time-series panel, named after the panel and `which`.
fn dump_overview_panels(
    tb: &Testbed,
    prometheus: &Prometheus,
    dashboard: &serde_json::Value,
    which: &str,
    from: std::time::SystemTime,
    dir: &std::path::Path,
) {
    for panel in dashboard["panels"].as_array().unwrap() {
        if panel["type"] == "timeseries" {
            dump_panel(tb, prometheus, panel, "", which, from, dir);
        }
    }
}

/// One panel's query_range data, `$service` set to `service`, into `dir/<title>--<name>.json`.
fn dump_panel(
    tb: &Testbed,
    prometheus: &Prometheus,
    panel: &serde_json::Value,
    service: &str,
    name: &str,
    from: std::time::SystemTime,
    dir: &std::path::Path,
) {
    std::fs::create_dir_all(dir).unwrap();
    let secs =
        |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let (start, end) = (secs(from), secs(std::time::SystemTime::now()));
    let title = panel["title"].as_str().unwrap();
    let mut series = Vec::new();
    for target in panel["targets"].as_array().unwrap() {
        let expr = target["expr"]
            .as_str()
            .unwrap()
            .replace("$__rate_interval", "10s")
            .replace("$cluster", ".*")
            .replace("$node", ".*")
            .replace("$service", service);
        let data = prometheus.api(
            tb,
            &format!(
                "query_range?query={}&start={start}&end={end}&step=2",
                encode(&expr)
            ),
        );
        for r in data["result"].as_array().unwrap() {
            let mut legend = target["legendFormat"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            for (k, v) in r["metric"].as_object().unwrap() {
                legend = legend.replace(&format!("{{{{{k}}}}}"), v.as_str().unwrap_or_default());
            }
            let points: Vec<(f64, f64)> = r["values"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|p| {
                    let t = p[0].as_f64()? - start as f64;
                    Some((t, p[1].as_str()?.parse().ok()?))
                })
                .collect();
            series.push(serde_json::json!({"name": legend, "points": points}));
        }
    }
    let file = format!("{}--{name}.json", slug(title));
    let doc = serde_json::json!({
        "title": title,
        "unit": panel["fieldConfig"]["defaults"]["unit"],
        "service": if service.is_empty() { name } else { service },
        "series": series,
    });
    std::fs::write(dir.join(file), serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
}

fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect::<String>()
        .split('-')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}
