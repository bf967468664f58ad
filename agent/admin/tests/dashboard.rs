//! The dashboard lint: deploy/monitoring/dashboard.json follows the conventions of good
//! Grafana dashboards and references only what the agent exports. (Its queries are run
//! against a real Prometheus scraping a real agent in the skewless crate's end-to-end test.)

use std::{
    collections::BTreeSet,
    process::{Command, Stdio},
};

use serde_json::Value;
use skewless_admin::{monitoring, names, promql};

fn dashboard() -> Value {
    let path = monitoring::dir().join(monitoring::DASHBOARD_FILE);
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

/// `(name, text before it)` for every `skewless_...` metric name outside label matchers.
fn metric_uses(expr: &str) -> Vec<(String, String)> {
    promql::identifiers(expr)
        .into_iter()
        .filter(|i| i.name.starts_with("skewless_"))
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
    let d = dashboard();
    let all = panels(&d);
    assert!(all.len() >= 10, "the panels issue 10 lists");
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
    let d = dashboard();
    for (title, expr) in exprs(&d) {
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
    let d = dashboard();
    let exported: BTreeSet<String> = names::all_series().into_iter().collect();
    let mut used = BTreeSet::new();
    for (title, expr) in exprs(&d) {
        let uses = metric_uses(&expr);
        assert!(!uses.is_empty(), "{title}: no skewless metric in {expr}");
        for (name, _) in uses {
            assert!(
                exported.contains(&name),
                "{title}: {name} is not exported by the agent (names::ALL)"
            );
            used.insert(name);
        }
        let selectors = expr.matches('{').count();
        for var in [
            r#"cluster=~"$cluster""#,
            r#"node=~"$node""#,
            r#"service="$service""#,
        ] {
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
    assert!(
        used.len() >= 12,
        "the dashboard shows most of what is exported: {used:?}"
    );
}

#[test]
fn metric_uses_skip_label_values() {
    let uses = metric_uses(r#"rate(skewless_a_total{x="skewless_b"}[$__rate_interval])"#);
    assert_eq!(uses.len(), 1);
    assert_eq!(uses[0].0, "skewless_a_total");
    assert_eq!(uses[0].1, "rate(");
}

/// kustomize ships the dashboard as the ConfigMap Grafana's sidecar loads, byte for byte.
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
    let cm = serde_yaml::Deserializer::from_str(&text)
        .map(|doc| <serde_yaml::Value as serde::Deserialize>::deserialize(doc).expect("YAML"))
        .find(|o| o["kind"] == "ConfigMap")
        .expect("a ConfigMap");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let shipped = cm["data"]["skewless.json"].as_str().expect("skewless.json");
    let path = monitoring::dir().join(monitoring::DASHBOARD_FILE);
    assert_eq!(shipped, std::fs::read_to_string(path).unwrap());
}
