//! Privileged: the agent as a platform engineer runs it. The runtime image is built from this
//! build's binary (the runtime stage of deploy/Dockerfile), podman runs it with the pod spec
//! read from deploy/daemonset.yaml (skewless-testbed's translation, field by field) in a
//! testbed node whose `lo` lacks the balancer address and whose pods sit under
//! `kubepods.slice`, and the agent watches the fake Kubernetes API (the real list/watch
//! protocol) through a kubeconfig standing in for the service account's credentials.
//!
//! Every container is named after this run and removed on drop; loads are bounded.

#[path = "../../k8s/tests/support/mod.rs"]
mod support;
mod testbed_agent;

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{
        core::v1::{Node, NodeSpec, ObjectReference, Service, ServicePort, ServiceSpec},
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use skewless_clients::{ClientKind, ClientSpec, Harness};
use skewless_testbed::{
    Place, Testbed,
    container::{self, PodSpec},
    grpc,
};
use testbed_agent::{
    ECHO_PODS, TempPath, balancer_address_line, echo_bed_with, spawn_long_client, wait_until,
};

const NODE: &str = "node-a";

/// The image, removed on drop.
struct Image(String);

impl Image {
    fn build() -> Self {
        // One tag per image: the tests of this file may run side by side in one process.
        static BUILT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = BUILT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("localhost/skewless:test-{}-{n}", std::process::id());
        container::runtime_image(
            Path::new(env!("CARGO_BIN_EXE_skewless")),
            &tag,
            &container::BaseOptions::default(),
        )
        .expect("the runtime image builds (podman, mmdebstrap: `cargo xtask setup`)");
        Self(tag)
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = container::engine_cmd()
            .args(["rmi", "-f", &self.0])
            .output();
    }
}

/// A running agent container, removed (by its own name) on drop.
struct Agent {
    name: String,
}

impl Agent {
    fn signal(&self, signal: &str) {
        let out = container::engine_cmd()
            .args(["kill", "--signal", signal, &self.name])
            .output()
            .unwrap();
        assert!(out.status.success(), "{signal} to {}: {out:?}", self.name);
    }

    fn is_running(&self) -> bool {
        container::engine_cmd()
            .args(["inspect", "--format", "{{.State.Running}}", &self.name])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "true")
    }

    /// Waits for the container to exit, at most `limit`; whether it did.
    fn exited_within(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while self.is_running() {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        true
    }

    fn logs(&self) -> String {
        let out = container::engine_cmd()
            .args(["logs", &self.name])
            .output()
            .unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// `kubectl exec POD -- ARGS`, as podman does it.
    fn exec(&self, args: &[&str]) -> std::process::Output {
        container::engine_cmd()
            .args(["exec", &self.name])
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = container::engine_cmd()
            .args(["rm", "-f", "-t", "0", &self.name])
            .output();
    }
}

/// The limits the engine gives the container: podman's defaults are above what runc may set
/// here (its init has no CAP_SYS_RESOURCE in the bounding set), so lower ones, within this
/// process's own hard limits.
fn ulimit_flags() -> Vec<String> {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let hard = |name: &str| {
        limits
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l[name.len()..].split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let mut flags = Vec::new();
    for (line, flag, most) in [
        ("Max open files", "nofile", 65_536),
        ("Max processes", "nproc", 4096),
    ] {
        if let Some(n) = hard(line).map(|n| n.min(most)) {
            flags.push(format!("--ulimit={flag}={n}:{n}"));
        }
    }
    flags
}

/// Starts the agent container `name` from `image` with the DaemonSet's pod spec.
fn run_agent(tb: &Testbed, image: &Image, daemonset: &str, kubeconfig: &Path, name: &str) -> Agent {
    let spec = pod_spec(tb, daemonset);
    let mut cmd = container::engine_cmd();
    cmd.args(["run", "--detach", "--name", name])
        .args(ulimit_flags())
        .args(&spec.flags);
    // The service account's credentials, as the kubelet would mount them, point at the fake
    // API server.
    if spec.service_account.is_some() {
        cmd.arg(format!(
            "--volume={}:/run/skewless-test/kubeconfig:ro",
            kubeconfig.display()
        ))
        .arg("--env=KUBECONFIG=/run/skewless-test/kubeconfig");
    }
    cmd.arg(&image.0).args(&spec.args);
    let out = cmd.output().unwrap();
    let agent = Agent {
        name: name.to_owned(),
    };
    assert!(
        out.status.success(),
        "podman run {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    agent
}

fn pod_spec(tb: &Testbed, daemonset: &str) -> PodSpec {
    let node = container::Node {
        netns: &tb.node(0).netns,
        name: NODE,
        // The host's cgroup hierarchy: the testbed's own cgroup directory stands for it.
        host_paths: BTreeMap::from([("/sys/fs/cgroup".to_owned(), tb.cgroup_root().to_owned())]),
    };
    PodSpec::from_daemonset(daemonset, &node).expect("deploy/daemonset.yaml translates")
}

fn daemonset() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/daemonset.yaml"
    ))
    .unwrap()
}

/// A TCP listener on 127.0.0.1 of network namespace `netns` (bound from a thread that
/// enters it; the socket stays in it).
fn listener_in(netns: &str) -> std::net::TcpListener {
    let path = format!("/run/netns/{netns}");
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).unwrap();
        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        l
    })
    .join()
    .unwrap()
}

/// The Node (its pod CIDR covers the testbed's pods), the opted-in Service and its
/// EndpointSlice of the echo pods.
fn publish(api: &support::FakeApi, tb: &Testbed, vip: SocketAddrV4, pods: &[&str]) {
    api.apply(&Node {
        metadata: ObjectMeta {
            name: Some(NODE.into()),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec {
            pod_cidrs: Some(vec!["198.18.0.0/16".into()]),
            ..NodeSpec::default()
        }),
        ..Node::default()
    });
    api.apply(&Service {
        metadata: ObjectMeta {
            name: Some("echo".into()),
            namespace: Some("ns".into()),
            uid: Some("uid-echo".into()),
            annotations: Some(BTreeMap::from([(
                "skewless.io/mode".to_owned(),
                "request".to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some(vip.ip().to_string()),
            cluster_ips: Some(vec![vip.ip().to_string()]),
            ports: Some(vec![ServicePort {
                name: Some("grpc".into()),
                port: i32::from(vip.port()),
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    });
    api.apply(&EndpointSlice {
        metadata: ObjectMeta {
            name: Some("echo-abc".into()),
            namespace: Some("ns".into()),
            labels: Some(BTreeMap::from([(
                "kubernetes.io/service-name".to_owned(),
                "echo".to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        address_type: "IPv4".into(),
        ports: Some(vec![EndpointPort {
            name: Some("grpc".into()),
            port: Some(i32::from(vip.port())),
            protocol: Some("TCP".into()),
            ..EndpointPort::default()
        }]),
        endpoints: pods
            .iter()
            .map(|p| Endpoint {
                addresses: vec![tb.pod(p).unwrap().ip.to_string()],
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                target_ref: Some(ObjectReference {
                    kind: Some("Pod".into()),
                    name: Some((*p).to_owned()),
                    namespace: Some("ns".into()),
                    ..ObjectReference::default()
                }),
                ..Endpoint::default()
            })
            .collect(),
    });
}

/// A kubeconfig for the fake API server. Like the service account's mount, it carries a
/// cluster CA (a throwaway self-signed one: the fake server speaks plain HTTP): the image has
/// no system CA store, and the in-cluster config always names the cluster's CA.
fn kubeconfig(dir: &Path, api: &support::FakeApi) -> PathBuf {
    let ca = dir.join("ca.crt");
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args([
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=fake-cluster-ca",
            "-keyout",
        ])
        .arg(dir.join("ca.key"))
        .arg("-out")
        .arg(&ca)
        .output()
        .expect("openssl");
    assert!(out.status.success(), "openssl: {out:?}");
    let pem = std::fs::read(&ca).unwrap();
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: \"{}\", certificate-authority-data: {}}}}}]\nusers: [{{name: fake, user: {{}}}}]\ncontexts: [{{name: fake, context: {{cluster: fake, user: fake}}}}]\ncurrent-context: fake\n",
            api.url(),
            base64(&pem)
        ),
    )
    .unwrap();
    path
}

fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ABC[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `GET http://ADDR:PORT/PATH` from `place` as the kubelet's HTTP prober does: success is a
/// status in 200..400; returns the status, or 0 when the connection fails.
fn http_status(tb: &Testbed, place: Place<'_>, addr: Ipv4Addr, port: u16, path: &str) -> u16 {
    let url = format!("http://{addr}:{port}{path}");
    let script = "import sys, urllib.request, urllib.error\n\
                  try:\n    print(urllib.request.urlopen(sys.argv[1], timeout=1).status)\n\
                  except urllib.error.HTTPError as e:\n    print(e.code)\n\
                  except Exception:\n    print(0)\n";
    let out = tb
        .command(place, &["python3", "-c", script, &url])
        .unwrap()
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

/// Programs attached to `cgroup` (bpftool's view of the kernel).
fn attached_programs(cgroup: &Path) -> usize {
    let out = Command::new("bpftool")
        .args(["-j", "cgroup", "show"])
        .arg(cgroup)
        .output()
        .expect("bpftool (`cargo xtask setup` installs it)");
    assert!(out.status.success(), "bpftool: {out:?}");
    serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .ok()
        .and_then(|v| v.as_array().map(Vec::len))
        .unwrap_or(0)
}

/// The calls of a `--log` client: (unix time, outcome).
fn calls(log: &Path) -> Vec<(f64, String)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter_map(|(t, r)| Some((t.parse().ok()?, r.to_owned())))
        .collect()
}

/// Calls the agent's balancers have served, from `skewless status --json` in its container.
fn served(agent: &Agent) -> u64 {
    let out = agent.exec(&["skewless", "status", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    status["services"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["endpoints"].as_array().into_iter().flatten())
        .filter_map(|e| e["requests"].as_u64())
        .sum()
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[test]
#[ignore = "privileged: needs root, podman and the real kernel; run with `cargo xtask test`"]
fn the_daemonset_in_a_container_balances_drains_hands_over_and_fails_open() {
    let image = Image::build();
    let vip = SocketAddrV4::new(Ipv4Addr::new(198, 19, 0, 60), 50051);
    let (mut tb, gen_dir) = echo_bed_with(vip, &ECHO_PODS, |b| {
        b.without_balancer_address()
            .pod_cgroup_parent("kubepods.slice")
    });
    let pods_cgroup = tb.cgroup_root().join("kubepods.slice");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _in_rt = rt.enter();
    let listener = tokio::net::TcpListener::from_std(listener_in(&tb.node(0).netns)).unwrap();
    let api = support::FakeApi::start_on(listener);
    publish(&api, &tb, vip, &ECHO_PODS);
    let dir = TempPath::new(format!("skewless-container-{}", tb.id()));
    std::fs::create_dir_all(&*dir).unwrap();
    let kubeconfig = kubeconfig(&dir, &api);
    let ds = daemonset();
    let spec = pod_spec(&tb, &ds);
    let (readiness, liveness) = (
        spec.readiness.clone().unwrap(),
        spec.liveness.clone().unwrap(),
    );
    assert_eq!(
        balancer_address_line(&tb),
        None,
        "the node starts without the address"
    );

    let first = run_agent(
        &tb,
        &image,
        &ds,
        &kubeconfig,
        &format!("skewless-{}-a", tb.id()),
    );
    // The kubelet's probes: from the host, to the host's address (host network).
    let node_ip = tb.node(0).fabric_ip;
    let ready_by = Instant::now() + Duration::from_secs(30);
    while http_status(
        &tb,
        Place::Node(0),
        node_ip,
        readiness.port,
        &readiness.path,
    ) != 200
    {
        assert!(
            Instant::now() < ready_by && first.is_running(),
            "readiness {} must pass within 30 s: {}",
            readiness.path,
            first.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        http_status(&tb, Place::Node(0), node_ip, liveness.port, &liveness.path),
        200,
        "liveness"
    );
    let line = balancer_address_line(&tb).expect("the agent adds its balancer address");
    assert!(line.contains("lo:skewless"), "{line}");
    // Other hosts (a pod's network namespace here) get metrics and probes, never /status.
    let pod = Place::Pod("client");
    assert_eq!(http_status(&tb, pod, node_ip, 9990, "/metrics"), 200);
    assert_eq!(http_status(&tb, pod, node_ip, 9990, "/status"), 404);
    assert_eq!(
        http_status(&tb, pod, node_ip, 9991, "/status"),
        0,
        "the local admin port is closed to other hosts"
    );
    // `kubectl exec ... -- skewless status`.
    wait_until("skewless status lists the Service", || {
        let out = first.exec(&["skewless", "status", "--interval", "0s"]);
        String::from_utf8_lossy(&out.stdout).contains(&vip.to_string())
    });
    let per_agent = attached_programs(&pods_cgroup);
    assert!(
        per_agent > 0,
        "the agent attaches its programs to kubepods.slice"
    );

    // Balanced: a pick_first grpcio client and a grpc-js client reach every pod.
    let target = vip.to_string();
    let grpcio = grpc::run_client(&tb, &gen_dir, Place::Pod("client"), &target, 200, 4).unwrap();
    assert_eq!(grpcio.ok, 200, "{grpcio:?}");
    assert_eq!(
        grpcio.pods.len(),
        4,
        "grpcio balanced over every pod: {grpcio:?}"
    );
    let harness = Harness::new().unwrap();
    let js = harness
        .run(
            &mut tb,
            Place::Pod("client"),
            ClientKind::GrpcJs,
            &ClientSpec::unary(&target, 200),
        )
        .unwrap();
    assert_eq!(
        (js.unary.ok, js.failed_calls()),
        (200, 0),
        "grpc-js: {js:?}"
    );
    assert_eq!(
        js.unary.pods.len(),
        4,
        "grpc-js balanced over every pod: {js:?}"
    );

    // A rolling update under load: the successor starts while the first agent runs (it waits
    // for the admin ports), the first gets SIGTERM and drains.
    let log = TempPath::new(format!("skewless-container-calls-{}.log", tb.id()));
    let log_arg = log.display().to_string();
    let client = spawn_long_client(
        &mut tb,
        &gen_dir,
        vip,
        4,
        &["--duration", "12", "--timeout", "5", "--log", &log_arg],
    );
    wait_until("the client is under load", || served(&first) > 60);
    let second = run_agent(
        &tb,
        &image,
        &ds,
        &kubeconfig,
        &format!("skewless-{}-b", tb.id()),
    );
    std::thread::sleep(Duration::from_secs(1));
    let term_at = unix_now();
    first.signal("TERM");
    assert!(
        first.exited_within(spec.grace + Duration::from_secs(2)),
        "SIGTERM: the first agent exits within the grace period: {}",
        first.logs()
    );
    assert_eq!(
        attached_programs(&pods_cgroup),
        per_agent,
        "the drained agent detached every program (the successor's remain)"
    );
    assert!(
        balancer_address_line(&tb).is_some(),
        "the successor keeps the address"
    );
    wait_until("the successor is ready", || {
        http_status(
            &tb,
            Place::Node(0),
            node_ip,
            readiness.port,
            &readiness.path,
        ) == 200
    });
    wait_until("the client finishes", || !tb.is_running(client));
    let done = calls(&log);
    let failed: Vec<_> = done.iter().filter(|(_, r)| r != "OK").collect();
    assert!(
        done.iter().filter(|(t, _)| *t > term_at + 1.0).count() > 50,
        "load went on after the SIGTERM: {} calls",
        done.len()
    );
    assert!(
        failed.is_empty(),
        "no call fails across SIGTERM and the overlapping successor: {} of {}, first {:?}",
        failed.len(),
        done.len(),
        failed.first()
    );

    // SIGKILL: nothing of the agent runs, the kernel closes its links, calls go direct. The
    // client's reconnect backoff is 100 ms (as in `agent.rs`'s SIGKILL test): a reconnect that
    // meets the dying agent waits grpcio's default first backoff, 1 s +-20 %, which would
    // measure grpcio, not skewless.
    let log2 = TempPath::new(format!("skewless-container-calls2-{}.log", tb.id()));
    let log2_arg = log2.display().to_string();
    let client = spawn_long_client(
        &mut tb,
        &gen_dir,
        vip,
        4,
        &[
            "--duration",
            "6",
            "--timeout",
            "5",
            "--reconnect-backoff-ms",
            "100",
            "--log",
            &log2_arg,
        ],
    );
    wait_until("the client is under load", || served(&second) > 60);
    second.signal("KILL");
    assert!(
        second.exited_within(Duration::from_secs(5)),
        "SIGKILL ends the agent"
    );
    // Counted from when the agent is seen gone, not from the kill command: on a loaded
    // machine podman alone can take a second to deliver the signal, and the calls started
    // meanwhile still run through the agent and fail with it.
    let kill_at = unix_now();
    assert_eq!(
        attached_programs(&pods_cgroup),
        0,
        "no program outlives a SIGKILLed agent"
    );
    wait_until("the client finishes", || !tb.is_running(client));
    let after: Vec<_> = calls(&log2)
        .into_iter()
        .filter(|(t, _)| *t > kill_at + 1.0)
        .collect();
    assert!(
        after.len() > 50,
        "load after the kill: {} calls",
        after.len()
    );
    assert!(
        after.iter().all(|(_, r)| r == "OK"),
        "a second after SIGKILL every call succeeds, direct: {:?}",
        after.iter().find(|(_, r)| r != "OK")
    );
    let direct = grpc::run_client(&tb, &gen_dir, Place::Pod("client"), &target, 100, 4).unwrap();
    assert_eq!(direct.ok, 100, "{direct:?}");
    assert_eq!(
        direct.pods.len(),
        1,
        "without the agent the client is pinned again: {direct:?}"
    );
}

#[test]
#[ignore = "privileged: needs root, podman and the real kernel; run with `cargo xtask test`"]
fn under_the_runtime_default_seccomp_profile_the_error_names_seccomp() {
    let image = Image::build();
    let tb = Testbed::builder()
        .nodes(1)
        .pod_cgroup_parent("kubepods.slice")
        .pod("client", 0)
        .build()
        .expect("testbed builds (needs root)");
    // The shipped spec with the runtime's default profile instead of the pinned one: what
    // a pod without seccompProfile gets under kubelet seccompDefault on podman or CRI-O.
    let ds = daemonset().replace("type: Unconfined", "type: RuntimeDefault");
    assert_ne!(ds, daemonset(), "the DaemonSet pins a seccomp profile");
    let dir = TempPath::new(format!("skewless-container-seccomp-{}", tb.id()));
    std::fs::create_dir_all(&*dir).unwrap();
    std::fs::write(dir.join("kubeconfig"), "").unwrap();
    let agent = run_agent(
        &tb,
        &image,
        &ds,
        &dir.join("kubeconfig"),
        &format!("skewless-{}-seccomp", tb.id()),
    );
    assert!(
        agent.exited_within(Duration::from_secs(20)),
        "the agent stops: {}",
        agent.logs()
    );
    let logs = agent.logs();
    assert!(
        logs.contains("seccomp") && logs.contains("CAP_BPF and CAP_NET_ADMIN"),
        "the error names seccomp, not the capabilities it has: {logs}"
    );
}
