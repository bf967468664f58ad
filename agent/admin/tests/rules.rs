//! The recording rules and alerts in deploy/monitoring/, checked with the real promtool
//! (Debian's `prometheus` package, installed by `cargo xtask setup`; a missing promtool fails
//! these tests rather than skipping them) and against what the agent exports.

use std::{
    collections::BTreeSet,
    process::{Command, Output},
};

use serde_yaml::Value;
use skewless_admin::{monitoring, names, promql};

fn read(file: &str) -> String {
    let path = monitoring::dir().join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn yaml(file: &str) -> Value {
    serde_yaml::from_str(&read(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn promtool(args: &[&str]) -> Output {
    Command::new("promtool")
        .args(args)
        .current_dir(monitoring::dir())
        .output()
        .expect("promtool must be installed (Debian's prometheus package: `cargo xtask setup`)")
}

fn assert_success(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every rule of the rules file: (group, rule).
fn rules() -> Vec<Value> {
    yaml(monitoring::RULES_FILE)["groups"]
        .as_sequence()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_sequence().expect("rules").clone())
        .collect()
}

fn names_of(key: &str) -> Vec<String> {
    rules()
        .iter()
        .filter_map(|r| r[key].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn promtool_accepts_the_rules_with_lint_fatal() {
    let out = promtool(&["check", "rules", "--lint-fatal", monitoring::RULES_FILE]);
    assert_success(&out, "promtool check rules --lint-fatal");
}

#[test]
fn promtool_rule_unit_tests_pass() {
    let out = promtool(&["test", "rules", monitoring::RULES_TESTS_FILE]);
    assert_success(&out, "promtool test rules");
}

#[test]
fn every_alert_has_a_firing_and_a_not_firing_case_and_every_record_an_expression_test() {
    let tests = yaml(monitoring::RULES_TESTS_FILE);
    let cases: Vec<&Value> = tests["tests"]
        .as_sequence()
        .expect("tests")
        .iter()
        .collect();
    let alert_cases = |alert: &str, firing: bool| {
        cases
            .iter()
            .flat_map(|c| {
                c["alert_rule_test"]
                    .as_sequence()
                    .cloned()
                    .unwrap_or_default()
            })
            .filter(|t| t["alertname"].as_str() == Some(alert))
            .filter(|t| {
                let n = t["exp_alerts"].as_sequence().map_or(0, Vec::len);
                (n > 0) == firing
            })
            .count()
    };
    for alert in names_of("alert") {
        assert!(alert_cases(&alert, true) > 0, "{alert}: no firing case");
        assert!(
            alert_cases(&alert, false) > 0,
            "{alert}: no not-firing case"
        );
    }
    let exprs: Vec<String> = cases
        .iter()
        .flat_map(|c| {
            c["promql_expr_test"]
                .as_sequence()
                .cloned()
                .unwrap_or_default()
        })
        .filter(|t| {
            t["exp_samples"]
                .as_sequence()
                .is_some_and(|s| !s.is_empty())
        })
        .map(|t| t["expr"].as_str().expect("expr").to_owned())
        .collect();
    for record in names_of("record") {
        assert!(
            exprs.iter().any(|e| metric_names(e).contains(&record)),
            "{record}: no expression test with expected samples"
        );
    }
}

#[test]
fn alerts_carry_severity_summary_description_and_a_runbook_that_exists() {
    let runbooks_path = monitoring::dir().join("../../docs/runbooks.md");
    let runbooks = std::fs::read_to_string(&runbooks_path)
        .unwrap_or_else(|e| panic!("{}: {e}", runbooks_path.display()));
    let anchors: BTreeSet<String> = runbooks
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(|h| {
            h.to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_')
                .collect()
        })
        .collect();
    for rule in rules().iter().filter(|r| r["alert"].is_string()) {
        let alert = rule["alert"].as_str().unwrap();
        let severity = rule["labels"]["severity"].as_str();
        assert!(
            matches!(severity, Some("critical" | "warning" | "info")),
            "{alert}: severity {severity:?}"
        );
        let a = &rule["annotations"];
        let summary = a["summary"].as_str().unwrap_or_default();
        assert!(
            !summary.is_empty() && !summary.contains("{{"),
            "{alert}: a static summary"
        );
        let description = a["description"].as_str().unwrap_or_default();
        assert!(
            description.contains("{{"),
            "{alert}: a templated description"
        );
        let url = a["runbook_url"].as_str().unwrap_or_default();
        let anchor = url
            .strip_prefix("https://github.com/skewless/skewless/blob/main/docs/runbooks.md#")
            .unwrap_or_else(|| panic!("{alert}: runbook_url into docs/runbooks.md: {url}"));
        assert_eq!(
            anchor,
            alert.to_lowercase(),
            "{alert}: the anchor is its name"
        );
        assert!(
            anchors.contains(anchor),
            "{alert}: docs/runbooks.md has no '## {alert}' section"
        );
    }
}

#[test]
fn recording_rules_are_named_level_metric_operations() {
    for record in names_of("record") {
        let parts: Vec<&str> = record.split(':').collect();
        assert_eq!(parts.len(), 3, "{record}: level:metric:operations");
        assert!(
            parts.iter().all(|p| !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')),
            "{record}: snake_case parts"
        );
        assert!(
            parts[1].starts_with("skewless_"),
            "{record}: the metric part names the skewless metric"
        );
    }
}

/// The series an expression references: identifiers outside label matchers and strings that
/// name a skewless metric, a recorded series or `up`, and are not a call.
fn metric_names(expr: &str) -> BTreeSet<String> {
    promql::identifiers(expr)
        .into_iter()
        .filter(promql::Identifier::is_series)
        .map(|i| i.name.to_owned())
        .collect()
}

#[test]
fn every_metric_the_rules_reference_is_exported_or_recorded() {
    let exported: BTreeSet<String> = names::all_series().into_iter().collect();
    let recorded: BTreeSet<String> = names_of("record").into_iter().collect();
    for rule in rules() {
        let expr = rule["expr"].as_str().expect("expr");
        for name in metric_names(expr) {
            assert!(
                exported.contains(&name) || recorded.contains(&name) || name == "up",
                "{name} (in {expr}) is neither exported by the agent (names::ALL) nor recorded"
            );
        }
    }
}

#[test]
fn metric_names_are_found_outside_selectors_only() {
    let names = metric_names(
        r#"sum by (le) (rate(skewless_a_total{service="skewless_not"}[5m])) / on (x) up and x:skewless_b:rate5m"#,
    );
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    assert_eq!(names, ["skewless_a_total", "up", "x:skewless_b:rate5m"]);
}

#[test]
fn prometheusrule_is_generated_from_the_rules_file() {
    let rules = read(monitoring::RULES_FILE);
    assert_eq!(
        read(monitoring::PROMETHEUS_RULE_FILE),
        monitoring::prometheus_rule(&rules),
        "deploy/monitoring/prometheusrule.yaml is stale: run `cargo xtask monitoring`"
    );
    let object = yaml(monitoring::PROMETHEUS_RULE_FILE);
    assert_eq!(object["kind"], "PrometheusRule");
    assert_eq!(
        object["spec"],
        yaml(monitoring::RULES_FILE),
        "the PrometheusRule's spec is the rules file"
    );
}

#[test]
fn the_service_monitor_gives_the_job_label_the_alerts_expect() {
    let sm = yaml("servicemonitor.yaml");
    let job_label = sm["spec"]["jobLabel"].as_str().expect("jobLabel");
    let svc = yaml("../metrics-service.yaml");
    let job = svc["metadata"]["labels"][job_label]
        .as_str()
        .expect("the metrics Service has the job label");
    let expected = format!("up{{job=\"{job}\"}}");
    for rule in rules().iter().filter(|r| r["alert"].is_string()) {
        let expr = rule["expr"].as_str().unwrap();
        if expr.contains("up{") {
            assert!(expr.contains(&expected), "{expr}: job is {job}");
        }
    }
}

/// docs/metrics.md's table of families lists exactly the exported families, with their types
/// and labels.
#[test]
fn metrics_doc_table_lists_every_family() {
    let doc = std::fs::read_to_string(monitoring::dir().join("../../docs/metrics.md")).unwrap();
    let section = doc
        .split("\n## Families\n")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("docs/metrics.md has a Families section");
    let rows: BTreeSet<(String, String, String)> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter(|l| l.starts_with("skewless_") || l.starts_with("process_"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (
                cells[0].trim_end_matches('`').to_owned(),
                cells[1].to_owned(),
                cells[2].to_owned(),
            )
        })
        .collect();
    let expected: BTreeSet<(String, String, String)> = names::ALL
        .iter()
        .map(|f| {
            let base = f.full_name();
            let (name, kind) = match f.kind {
                names::Kind::Counter => (format!("{base}_total"), "counter"),
                names::Kind::Gauge => (base, "gauge"),
                names::Kind::Histogram => (base, "histogram"),
            };
            (name, kind.to_owned(), f.labels.join(", "))
        })
        .collect();
    assert_eq!(
        rows, expected,
        "docs/metrics.md's table of families and names::ALL differ"
    );
}
