//! The monitoring artifacts in `deploy/monitoring/`: where they are, and the PrometheusRule
//! generated from the plain Prometheus rules file (the source; `cargo xtask monitoring`
//! writes the PrometheusRule, and a test keeps the two identical).

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use crate::names;

/// `deploy/monitoring/` of this checkout.
#[must_use]
pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/monitoring")
}

/// The rules file, the source of the PrometheusRule.
pub const RULES_FILE: &str = "skewless.rules.yaml";
/// The generated PrometheusRule.
pub const PROMETHEUS_RULE_FILE: &str = "prometheusrule.yaml";
/// The Grafana dashboard of one Service.
pub const DASHBOARD_FILE: &str = "dashboard.json";
/// The Grafana dashboard of one node's agent.
pub const NODE_DASHBOARD_FILE: &str = "node.json";
/// The Grafana dashboard of the whole cluster.
pub const CLUSTER_DASHBOARD_FILE: &str = "cluster.json";

/// One Grafana dashboard: its file, its fixed uid, the ConfigMap key kustomize ships it
/// under, and the label matchers every selector of its queries carries (its variables).
#[derive(Clone, Copy, Debug)]
pub struct Dashboard {
    pub file: &'static str,
    pub uid: &'static str,
    pub configmap_key: &'static str,
    pub filters: &'static [&'static str],
}

/// Every dashboard: the cluster overview, the node, the Service.
pub const DASHBOARDS: &[Dashboard] = &[
    Dashboard {
        file: CLUSTER_DASHBOARD_FILE,
        uid: "skewless-cluster",
        configmap_key: "skewless-cluster.json",
        filters: &[r#"cluster=~"$cluster""#],
    },
    Dashboard {
        file: NODE_DASHBOARD_FILE,
        uid: "skewless-node",
        configmap_key: "skewless-node.json",
        filters: &[r#"cluster=~"$cluster""#, r#"node=~"$node""#],
    },
    Dashboard {
        file: DASHBOARD_FILE,
        uid: "skewless-service",
        configmap_key: "skewless.json",
        filters: &[
            r#"cluster=~"$cluster""#,
            r#"node=~"$node""#,
            r#"service="$service""#,
        ],
    },
];
/// The rules' promtool unit tests.
pub const RULES_TESTS_FILE: &str = "tests/rules.test.yaml";

/// The PrometheusRule object for the rules file's text: its groups under `spec`, as they are
/// (comments after the header included), so a reader of either file sees the same rules.
#[must_use]
pub fn prometheus_rule(rules: &str) -> String {
    let mut out = String::from(
        "# Generated from skewless.rules.yaml by `cargo xtask monitoring`: edit that file, not this\n\
         # one (a test fails while the two differ). Needs the Prometheus Operator's CRDs.\n\
         apiVersion: monitoring.coreos.com/v1\n\
         kind: PrometheusRule\n\
         metadata:\n  \
           name: skewless\n  \
           namespace: skewless-system\n  \
           labels:\n    \
             app.kubernetes.io/name: skewless\n\
         spec:\n",
    );
    // The header comment describes the source file; the rules start at `groups:`.
    let body = rules
        .lines()
        .skip_while(|l| l.starts_with('#') || l.trim().is_empty());
    for line in body {
        if !line.is_empty() {
            out.push_str("  ");
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// What `promtool check metrics` (Prometheus' linter of the naming guide) reports about an
/// exposition, one problem a line, minus its known misreading of OpenMetrics counters as
/// lacking help text (promtool 2.42 parses the classic text format). For the tests: it runs
/// Debian's promtool.
///
/// # Errors
/// If promtool cannot be run.
pub fn promtool_check_metrics(text: &str) -> std::io::Result<Vec<String>> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(text.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    let misread: Vec<String> = names::ALL
        .iter()
        .filter(|f| f.kind == names::Kind::Counter)
        .map(|f| format!("{}_total no help text", f.full_name()))
        .collect();
    let report = [out.stdout, out.stderr].concat();
    Ok(String::from_utf8_lossy(&report)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !misread.iter().any(|m| l == m))
        .map(str::to_owned)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rules_go_under_spec_indented() {
        let rule = prometheus_rule("# header\n\ngroups:\n  - name: g\n    rules: []\n");
        assert!(
            rule.ends_with("spec:\n  groups:\n    - name: g\n      rules: []\n"),
            "{rule}"
        );
    }
}
