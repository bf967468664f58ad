//! The dashboard lint: every dashboard in deploy/monitoring/ (cluster overview, node,
//! Service: [`monitoring::DASHBOARDS`]) follows the conventions of good Grafana dashboards and
//! references only what the agent exports. (Their queries are run against a real Prometheus
//! scraping a real agent in the skewless crate's end-to-end test.)

use std::{
    collections::BTreeSet,
    process::{Command, Stdio},
};

use serde_json::Value;
use skewless_admin::{
    monitoring::{self, Dashboard},
    names, promql,
};

fn dashboard() -> Value {
    load(monitoring::DASHBOARD_FILE)
}

fn load(file: &str) -> Value {
    let path = monitoring::dir().join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every panel, rows' nested panels included (rows themselves left out).
fn panels(d: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        if p["type"] == "row" {
            out.extend(p["panels"].as_array().cloned().unwrap_or_default());
        } else {
            out.push(p.clone());
        }
    }
    out
}

fn exprs(d: &Value) -> Vec<(String, String)> {
    panels(d)
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_owned();
            p["targets"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |t| {
                    (
                        title.clone(),
                        t["expr"].as_str().unwrap_or_default().to_owned(),
                    )
                })
        })
        .collect()
}

/// `(name, text before it)` for every `skewless_...` or `process_...` metric name (and `up`)
/// outside label matchers.
fn metric_uses(expr: &str) -> Vec<(String, String)> {
    promql::identifiers(expr)
        .into_iter()
        .filter(|i| i.is_series() && !i.name.contains(':'))
        .map(|i| (i.name.to_owned(), expr[..i.start].to_owned()))
        .collect()
}

#[test]
fn fixed_uid_and_the_datasource_cluster_node_service_variables() {
    let d = dashboard();
    assert_eq!(
        d["uid"], "skewless-service",
        "a fixed uid, so links survive re-imports"
    );
    let vars = d["templating"]["list"].as_array().expect("variables");
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("variable {name}"))
    };
    let ds = var("datasource");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    assert_eq!(ds["label"], "Data source");
    for name in ["cluster", "node", "service"] {
        let v = var(name);
        assert_eq!(v["type"], "query", "{name} is a query variable");
        assert_eq!(
            v["datasource"]["uid"], "${datasource}",
            "{name} uses $datasource"
        );
    }
}

#[test]
fn every_panel_has_targets_a_unit_a_description_and_the_datasource_variable() {
    assert!(
        panels(&dashboard()).len() >= 10,
        "the Service dashboard's panels"
    );
    for Dashboard { file, .. } in monitoring::DASHBOARDS {
        every_panel_is_complete(&load(file));
    }
}

fn every_panel_is_complete(d: &Value) {
    let all = panels(d);
    assert!(all.len() >= 8, "a dashboard of some substance");
    for p in &all {
        let title = p["title"].as_str().unwrap_or_default();
        assert!(!title.is_empty(), "every panel has a title");
        let targets = p["targets"].as_array().map_or(0, Vec::len);
        assert!(targets > 0, "{title}: no targets");
        assert!(
            p["fieldConfig"]["defaults"]["unit"]
                .as_str()
                .is_some_and(|u| !u.is_empty()),
            "{title}: no unit"
        );
        assert!(
            p["description"].as_str().is_some_and(|s| s.len() > 20),
            "{title}: no description"
        );
        assert_eq!(
            p["datasource"]["uid"], "${datasource}",
            "{title}: datasource"
        );
        for t in p["targets"].as_array().unwrap() {
            assert_eq!(
                t["datasource"]["uid"], "${datasource}",
                "{title}: target datasource"
            );
        }
    }
}

#[test]
fn rates_use_rate_interval_and_counters_appear_only_inside_rate_or_increase() {
    for Dashboard { file, .. } in monitoring::DASHBOARDS {
        rates_are_right(&load(file));
    }
}

fn rates_are_right(d: &Value) {
    for (title, expr) in exprs(d) {
        for window in expr.match_indices('[') {
            assert!(
                expr[window.0..].starts_with("[$__rate_interval]"),
                "{title}: ranges are $__rate_interval: {expr}"
            );
        }
        for (name, before) in metric_uses(&expr) {
            let counter = ["_total", "_bucket", "_count", "_sum"]
                .iter()
                .any(|s| name.ends_with(s));
            if counter {
                let before = before.trim_end();
                assert!(
                    before.ends_with("rate(") || before.ends_with("increase("),
                    "{title}: counter {name} outside rate/increase: {expr}"
                );
            }
        }
    }
}

#[test]
fn every_query_filters_by_the_variables_and_names_an_exported_metric() {
    let mut all_used = BTreeSet::new();
    for dashboard in monitoring::DASHBOARDS {
        let used = queries_are_filtered_and_exported(dashboard);
        assert!(
            used.len() >= 8,
            "{}: shows a good part of what is exported: {used:?}",
            dashboard.file
        );
        all_used.extend(used);
    }
    let service = dashboard();
    let service_uses: BTreeSet<String> = exprs(&service)
        .iter()
        .flat_map(|(_, e)| metric_uses(e).into_iter().map(|(n, _)| n))
        .collect();
    assert!(
        service_uses.len() >= 12,
        "the Service dashboard shows most of what is exported: {service_uses:?}"
    );
    for family in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "skewless_worker_busy_seconds_total",
        "skewless_worker_cpu_wait_seconds_total",
        "skewless_worker_stalls_total",
        "skewless_container_cpu_cores",
        "skewless_container_memory_bytes",
        "skewless_service_info",
        "skewless_map_entries",
        "skewless_stale_heartbeat_total",
        "skewless_unrotatable_connections",
        "skewless_service_config_rejected_total",
    ] {
        assert!(all_used.contains(family), "a dashboard shows {family}");
    }
}

/// The metrics `dashboard`'s queries use; panics on a query that misses a variable or names
/// something the agent does not export.
fn queries_are_filtered_and_exported(dashboard: &Dashboard) -> BTreeSet<String> {
    let d = load(dashboard.file);
    let exported: BTreeSet<String> = names::all_series().into_iter().collect();
    let mut used = BTreeSet::new();
    for (title, expr) in exprs(&d) {
        let uses = metric_uses(&expr);
        assert!(!uses.is_empty(), "{title}: no skewless metric in {expr}");
        for (name, _) in uses {
            assert!(
                exported.contains(&name) || name == "up",
                "{title}: {name} is not exported by the agent (names::ALL)"
            );
            if name.starts_with("process_") || name == "up" {
                assert!(
                    expr.contains(&format!("{name}{{job=\"skewless\", ")),
                    "{title}: {name} is every exporter's: select the agent's job: {expr}"
                );
            }
            used.insert(name);
        }
        let selectors = expr.matches('{').count();
        for var in dashboard.filters {
            assert_eq!(
                expr.matches(var).count(),
                selectors,
                "{title}: every selector filters by {var}: {expr}"
            );
        }
    }
    // The variables' own queries name exported metrics too.
    for v in d["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"]["query"].as_str() {
            for (name, _) in metric_uses(q) {
                assert!(exported.contains(&name), "variable {}: {name}", v["name"]);
            }
        }
    }
    used
}

/// Dashboard links and data links point at the dashboards' fixed uids.
#[test]
fn links_point_at_the_other_dashboards() {
    let uids: BTreeSet<&str> = monitoring::DASHBOARDS.iter().map(|d| d.uid).collect();
    let mut links = 0;
    for dashboard in monitoring::DASHBOARDS {
        let d = load(dashboard.file);
        assert_eq!(d["uid"], dashboard.uid, "{}: its fixed uid", dashboard.file);
        let text = serde_json::to_string(&d).unwrap();
        for (i, _) in text.match_indices("\"url\":\"/d/") {
            let uid = text[i + 10..].split('/').next().unwrap();
            assert!(uids.contains(uid), "{}: a link to {uid}", dashboard.file);
            links += 1;
        }
    }
    assert!(
        links >= 4,
        "the node and cluster dashboards link on: {links}"
    );
}

#[test]
fn metric_uses_skip_label_values() {
    let uses = metric_uses(r#"rate(skewless_a_total{x="skewless_b"}[$__rate_interval])"#);
    assert_eq!(uses.len(), 1);
    assert_eq!(uses[0].0, "skewless_a_total");
    assert_eq!(uses[0].1, "rate(");
}

/// kustomize ships each dashboard as a ConfigMap Grafana's sidecar loads, byte for byte.
#[test]
fn kustomize_ships_the_dashboard_in_a_configmap() {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(monitoring::dir())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("kubectl must be installed to render deploy/monitoring (run `cargo xtask setup`)");
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/monitoring: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let maps: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|doc| <serde_yaml::Value as serde::Deserialize>::deserialize(doc).expect("YAML"))
        .filter(|o| o["kind"] == "ConfigMap")
        .collect();
    for dashboard in monitoring::DASHBOARDS {
        let cm = maps
            .iter()
            .find(|m| !m["data"][dashboard.configmap_key].is_null())
            .unwrap_or_else(|| panic!("a ConfigMap with {}", dashboard.configmap_key));
        assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
        let shipped = cm["data"][dashboard.configmap_key].as_str().unwrap();
        let path = monitoring::dir().join(dashboard.file);
        assert_eq!(shipped, std::fs::read_to_string(path).unwrap());
    }
}
