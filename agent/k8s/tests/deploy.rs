//! `deploy/` checks: every object parses into its k8s-openapi type, the RBAC grants exactly
//! what the code uses, the DaemonSet has the properties deploy/README.md promises, and
//! `kubectl kustomize deploy/` renders the same objects.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Namespace, Service, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding},
};
use kube::api::DynamicObject;
use serde::Deserialize;
use serde_json::Value;
use skewless_k8s::RBAC_RULES;

/// The agent arguments the DaemonSet passes; the binary must accept these flags.
const AGENT_ARGS: [&str; 5] = [
    "agent",
    "--kubernetes",
    "--pod-cgroup-root=/run/skewless/cgroup",
    "--node-name=$(NODE_NAME)",
    "--metrics-addr=0.0.0.0:9990",
];

/// What the agent needs on top of its drains after SIGTERM: removing the redirects, exiting,
/// and the kubelet's own latency between the signal and the kill.
const SHUTDOWN_MARGIN: Duration = Duration::from_secs(5);

/// The longest drain of a balancer the agent runs with its defaults: on SIGTERM every balancer
/// drains at once, so the longest one bounds the agent's shutdown.
fn longest_drain() -> Duration {
    use skewless_balancer::{Config, ConnectionConfig, Lifecycle};
    let request = Config::default().drain_grace;
    let connection = Lifecycle::drain_grace(&ConnectionConfig::default());
    request.max(connection)
}

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

#[derive(Debug)]
enum Object {
    Namespace(Box<Namespace>),
    ServiceAccount(Box<ServiceAccount>),
    ClusterRole(Box<ClusterRole>),
    ClusterRoleBinding(Box<ClusterRoleBinding>),
    DaemonSet(Box<DaemonSet>),
    Service(Box<Service>),
    ServiceMonitor(Box<DynamicObject>),
    PrometheusRule(Box<DynamicObject>),
}

impl Object {
    fn id(&self) -> String {
        let (kind, meta) = match self {
            Object::Namespace(o) => ("Namespace", &o.metadata),
            Object::ServiceAccount(o) => ("ServiceAccount", &o.metadata),
            Object::ClusterRole(o) => ("ClusterRole", &o.metadata),
            Object::ClusterRoleBinding(o) => ("ClusterRoleBinding", &o.metadata),
            Object::DaemonSet(o) => ("DaemonSet", &o.metadata),
            Object::Service(o) => ("Service", &o.metadata),
            Object::ServiceMonitor(o) => ("ServiceMonitor", &o.metadata),
            Object::PrometheusRule(o) => ("PrometheusRule", &o.metadata),
        };
        format!("{kind}/{}", meta.name.as_deref().unwrap_or_default())
    }
}

#[expect(
    clippy::unnecessary_box_returns,
    reason = "every caller stores it in a boxed variant of Object"
)]
fn typed<T: serde::de::DeserializeOwned>(v: Value, what: &str) -> Box<T> {
    Box::new(serde_json::from_value(v).unwrap_or_else(|e| panic!("{what}: {e}")))
}

/// Parses every YAML document of `text` into its k8s-openapi type; unknown kinds fail.
fn parse_objects(text: &str, what: &str) -> Vec<Object> {
    serde_yaml::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{what}: YAML: {e}")))
        .filter(|v| !v.is_null())
        .map(|v| {
            let api_version = v["apiVersion"].as_str().unwrap_or_default().to_owned();
            let kind = v["kind"].as_str().unwrap_or_default().to_owned();
            let what = format!("{what}: {api_version} {kind}");
            match (api_version.as_str(), kind.as_str()) {
                ("v1", "Namespace") => Object::Namespace(typed(v, &what)),
                ("v1", "ServiceAccount") => Object::ServiceAccount(typed(v, &what)),
                ("v1", "Service") => Object::Service(typed(v, &what)),
                ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
                    Object::ClusterRole(typed(v, &what))
                }
                ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
                    Object::ClusterRoleBinding(typed(v, &what))
                }
                ("apps/v1", "DaemonSet") => Object::DaemonSet(typed(v, &what)),
                // A CRD: no k8s-openapi type; parsed as a DynamicObject, fields checked below.
                ("monitoring.coreos.com/v1", "ServiceMonitor") => {
                    Object::ServiceMonitor(typed(v, &what))
                }
                // Its rules are checked by skewless-admin's tests (promtool).
                ("monitoring.coreos.com/v1", "PrometheusRule") => {
                    Object::PrometheusRule(typed(v, &what))
                }
                _ => panic!("{what}: unexpected object in deploy/"),
            }
        })
        .collect()
}

/// The `resources:` of a kustomization, resolved relative to its directory.
fn kustomization_resources(dir: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(dir.join("kustomization.yaml")).expect("kustomization");
    let k: Value = serde_yaml::from_str(&text).expect("kustomization YAML");
    k["resources"]
        .as_array()
        .expect("resources list")
        .iter()
        .map(|r| dir.join(r.as_str().expect("resource path")))
        .collect()
}

/// Objects of a kustomization, from its resource list (our own rendering, no kubectl).
fn objects_of(dir: &Path) -> Vec<Object> {
    kustomization_resources(dir)
        .iter()
        .flat_map(|p| {
            let text =
                std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            parse_objects(&text, &p.display().to_string())
        })
        .collect()
}

fn base() -> Vec<Object> {
    objects_of(&deploy_dir())
}

#[test]
fn every_manifest_is_listed_in_a_kustomization_and_parses() {
    let dir = deploy_dir();
    let mut listed: BTreeSet<PathBuf> = kustomization_resources(&dir).into_iter().collect();
    listed.extend(kustomization_resources(&dir.join("monitoring")));
    for sub in [dir.clone(), dir.join("monitoring")] {
        for entry in std::fs::read_dir(&sub).expect("read deploy/") {
            let p = entry.expect("entry").path();
            let is_yaml = p.extension().is_some_and(|e| e == "yaml");
            let is_kustomization = p.file_name().is_some_and(|n| n == "kustomization.yaml");
            // A Prometheus rules file: the PrometheusRule's source, not a manifest.
            let is_rules = p.to_string_lossy().ends_with(".rules.yaml");
            if is_yaml && !is_kustomization && !is_rules {
                assert!(listed.contains(&p), "{p:?} is not in any kustomization");
            }
        }
    }
    let ids: Vec<String> = base().iter().map(Object::id).collect();
    assert_eq!(
        ids,
        [
            "Namespace/skewless-system",
            "ServiceAccount/skewless-agent",
            "ClusterRole/skewless-agent",
            "ClusterRoleBinding/skewless-agent",
            "DaemonSet/skewless-agent",
            "Service/skewless-agent-metrics",
        ]
    );
    let monitoring: Vec<String> = objects_of(&dir.join("monitoring"))
        .iter()
        .map(Object::id)
        .collect();
    assert_eq!(
        monitoring,
        ["ServiceMonitor/skewless-agent", "PrometheusRule/skewless"]
    );
}

#[test]
fn rbac_grants_exactly_what_the_code_uses() {
    let objects = base();
    let role = objects
        .iter()
        .find_map(|o| match o {
            Object::ClusterRole(r) => Some(r),
            _ => None,
        })
        .expect("a ClusterRole");
    let mut granted = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none());
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    granted.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    let used: BTreeSet<(String, String, String)> = RBAC_RULES
        .iter()
        .flat_map(|r| {
            r.verbs.iter().map(|v| {
                (
                    r.api_group.to_owned(),
                    r.resource.to_owned(),
                    (*v).to_owned(),
                )
            })
        })
        .collect();
    assert_eq!(granted, used, "deploy/rbac.yaml must equal RBAC_RULES");

    let binding = objects
        .iter()
        .find_map(|o| match o {
            Object::ClusterRoleBinding(b) => Some(b),
            _ => None,
        })
        .expect("a ClusterRoleBinding");
    assert_eq!(binding.role_ref.name, "skewless-agent");
    let subject = &binding.subjects.as_ref().expect("subjects")[0];
    assert_eq!(
        (subject.kind.as_str(), subject.name.as_str()),
        ("ServiceAccount", "skewless-agent")
    );
}

#[test]
fn daemonset_is_a_least_privilege_host_network_agent() {
    let objects = base();
    let ds = objects
        .iter()
        .find_map(|o| match o {
            Object::DaemonSet(d) => Some(d),
            _ => None,
        })
        .expect("a DaemonSet");
    let spec = ds.spec.as_ref().expect("spec");
    let rolling = spec
        .update_strategy
        .as_ref()
        .and_then(|u| u.rolling_update.as_ref())
        .expect("rolling update");
    assert_eq!(
        serde_json::to_value(&rolling.max_unavailable).unwrap(),
        1,
        "maxUnavailable 1"
    );
    let pod = spec.template.spec.as_ref().expect("pod spec");
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.service_account_name.as_deref(), Some("skewless-agent"));
    let grace = pod.termination_grace_period_seconds.expect("grace period");
    let needed = longest_drain() + SHUTDOWN_MARGIN;
    assert!(
        u64::try_from(grace).is_ok_and(|g| Duration::from_secs(g) >= needed),
        "terminationGracePeriodSeconds {grace} must cover the longest drain plus margin ({needed:?})"
    );
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical"),
        "a node agent is not evicted before the workloads it serves"
    );
    let c = &pod.containers[0];
    assert_eq!(c.args.as_deref().expect("args"), AGENT_ARGS);
    let node_env = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .expect("NODE_NAME env");
    assert_eq!(
        node_env
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str()),
        Some("spec.nodeName")
    );
    let sc = c.security_context.as_ref().expect("securityContext");
    assert_ne!(sc.privileged, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    let caps = sc.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    let added: BTreeSet<&str> = caps.add.iter().flatten().map(String::as_str).collect();
    assert_eq!(
        added,
        BTreeSet::from(["BPF", "NET_ADMIN", "SYS_RESOURCE"]),
        "only the capabilities documented in deploy/README.md"
    );
    let res = c.resources.as_ref().expect("resources");
    assert!(
        res.requests
            .as_ref()
            .is_some_and(|r| r.contains_key("cpu") && r.contains_key("memory"))
    );
    assert!(
        res.limits
            .as_ref()
            .is_some_and(|l| l.contains_key("memory"))
    );
    let port = c
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .expect("metrics port");
    assert_eq!(port.container_port, 9990);
    for (probe, path) in [(&c.readiness_probe, "/ready"), (&c.liveness_probe, "/live")] {
        let get = probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .expect("http probe");
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(serde_json::to_value(&get.port).unwrap(), "metrics");
    }
    let mounts: BTreeSet<&str> = c
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.as_str())
        .collect();
    assert_eq!(
        mounts,
        BTreeSet::from(["/run/skewless/cgroup", "/tmp"]),
        "only the mounts the agent uses: no bpffs (nothing is pinned)"
    );
    assert_eq!(
        sc.seccomp_profile.as_ref().map(|p| p.type_.as_str()),
        Some("Unconfined"),
        "seccomp pinned: runtimes' defaults differ on bpf(2) (deploy/README.md)"
    );
}

#[test]
fn metrics_service_and_servicemonitor_select_the_agent_metrics_port() {
    let objects = base();
    let ds_labels = objects
        .iter()
        .find_map(|o| match o {
            Object::DaemonSet(d) => d.spec.as_ref()?.template.metadata.as_ref()?.labels.clone(),
            _ => None,
        })
        .expect("pod labels");
    let svc = objects
        .iter()
        .find_map(|o| match o {
            Object::Service(s) => Some(s),
            _ => None,
        })
        .expect("metrics Service");
    let spec = svc.spec.as_ref().expect("spec");
    for (k, v) in spec.selector.as_ref().expect("selector") {
        assert_eq!(
            ds_labels.get(k),
            Some(v),
            "Service selector {k} matches the pods"
        );
    }
    let port = &spec.ports.as_ref().expect("ports")[0];
    assert_eq!((port.name.as_deref(), port.port), (Some("metrics"), 9990));

    let monitoring = objects_of(&deploy_dir().join("monitoring"));
    let Object::ServiceMonitor(sm) = &monitoring[0] else {
        panic!("monitoring/ holds the ServiceMonitor");
    };
    let svc_labels = svc.metadata.labels.clone().expect("service labels");
    let sel = &sm.data["spec"]["selector"]["matchLabels"];
    for (k, v) in sel.as_object().expect("matchLabels") {
        assert_eq!(
            svc_labels.get(k).map(String::as_str),
            v.as_str(),
            "ServiceMonitor selects the Service by {k}"
        );
    }
    assert_eq!(sm.data["spec"]["endpoints"][0]["port"], "metrics");
}

/// Renders with the real kustomize in kubectl (part of these machines' image; `cargo xtask
/// setup` checks for it). A missing kubectl fails the test rather than skipping it.
#[test]
fn kubectl_kustomize_renders_the_same_objects() {
    let rendered = kustomize_output();
    let rendered = parse_objects(&rendered, "kustomize output");
    let ids = |objs: &[Object]| objs.iter().map(Object::id).collect::<BTreeSet<_>>();
    assert_eq!(ids(&rendered), ids(&base()));
    for o in &rendered {
        if let Object::DaemonSet(ds) = o {
            let c = &ds
                .spec
                .as_ref()
                .unwrap()
                .template
                .spec
                .as_ref()
                .unwrap()
                .containers[0];
            let image = c.image.as_deref().unwrap_or_default();
            assert!(
                image.starts_with("ghcr.io/skewless/skewless:") && !image.ends_with(":latest"),
                "a versioned tag, never latest: {image}"
            );
            assert_eq!(ds.metadata.namespace.as_deref(), Some("skewless-system"));
        }
    }
}

/// The Kubernetes versions deploy/ supports, oldest and newest: what its manifests are
/// validated against (kubernetes-validate ships these API schemas; `cargo xtask setup`
/// installs it into the venv). 1.25: DaemonSet rolling updates with maxSurge are GA and every
/// field the manifests use (seccompProfile, EndpointSlice v1, events.k8s.io/v1) exists.
const KUBERNETES_VERSIONS: [&str; 2] = ["1.25.0", "1.37.0"];

/// `kubectl kustomize deploy/` validated offline against the Kubernetes API schemas of the
/// oldest and newest supported version, strictly (an unknown field fails).
#[test]
fn rendered_manifests_pass_the_kubernetes_api_schemas_of_the_oldest_and_newest_version() {
    let rendered = kustomize_output();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("deploy.yaml");
    std::fs::write(&file, &rendered).expect("write the rendered manifests");
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    let validate = home.join(".cache/skewless/venv/bin/kubernetes-validate");
    for version in KUBERNETES_VERSIONS {
        let child = Command::new(&validate)
            .args(["--strict", "--kubernetes-version", version])
            .arg(&file)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubernetes-validate must be installed (`cargo xtask setup`)");
        let out = wait_bounded(child, Duration::from_secs(120));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "deploy/ against Kubernetes {version}: {text}"
        );
        let passed = text.matches(" passed for resource ").count();
        assert_eq!(
            passed,
            base().len(),
            "every object is validated against {version}: {text}"
        );
    }
}

/// The base as `kubectl kustomize deploy/` renders it.
fn kustomize_output() -> String {
    let child = Command::new("kubectl")
        .args(["kustomize"])
        .arg(deploy_dir())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl must be installed to render deploy/ (run `cargo xtask setup`)");
    let out = wait_bounded(child, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/ failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Waits for a child process, killing it (and failing) after `limit`.
fn wait_bounded(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait kubectl").is_some() {
            return child.wait_with_output().expect("kubectl output");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("child process {} took longer than {limit:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
