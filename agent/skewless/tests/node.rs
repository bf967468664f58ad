//! Privileged: the agent on a node, as the real `skewless agent` binary in a testbed node:
//! the balancer address it adds and removes, the pod cgroup layouts it finds, what its admin
//! listeners expose to other hosts, and how it shows a Service it cannot serve. Run with
//! `cargo xtask test` (as root).

mod testbed_agent;

use std::{net::SocketAddrV4, time::Duration};

use skewless_testbed::Place;
use testbed_agent::{
    ADMIN, ECHO_PODS, TempPath, balancer_address_line, dual_stack_bed, echo_bed, echo_bed_with,
    services_in_status, spawn_file_agent, spawn_file_agent_at, start_dual_stack_agent, status_json,
    status_json_at, status_text, wait_until, write_services, write_services_ips,
};

/// `GET url` with the testbed's HTTP client from `place`: the body, or the client's stderr
/// (an HTTP error status or a refused connection, as Python's urllib words it).
fn http_get(tb: &skewless_testbed::Testbed, place: Place<'_>, url: &str) -> Got {
    let mut cmd = tb
        .command(
            place,
            &["python3", skewless_testbed::scripts::HTTP_GET, url],
        )
        .expect("the HTTP client's command");
    let out = cmd.output().expect("the HTTP client runs");
    if out.status.success() {
        Got::Body(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Got::Failed(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// What [`http_get`] got.
#[derive(Debug)]
enum Got {
    Body(String),
    /// The HTTP client's error: a status (`HTTP Error 404`) or a connection error.
    Failed(String),
}

impl Got {
    fn failed_with(&self, what: &str) -> bool {
        matches!(self, Got::Failed(e) if e.contains(what))
    }
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn status_is_local_by_default_while_metrics_and_probes_answer_other_hosts() {
    let vip = SocketAddrV4::new(std::net::Ipv4Addr::new(198, 19, 0, 34), 50051);
    let (mut tb, _gen_dir) = echo_bed(vip, &ECHO_PODS[..1]);
    let services = TempPath::new(format!("skewless-test-services-{}.yaml", tb.id()));
    write_services(&services, &tb, vip, "request", &ECHO_PODS[..1]);
    let file = services.display().to_string();
    // As the DaemonSet runs it: the public listener on every address, the local one left at
    // its default.
    let argv = [
        env!("CARGO_BIN_EXE_skewless"),
        "agent",
        "--services-file",
        &file,
        "--metrics-addr",
        "0.0.0.0:9990",
    ];
    tb.spawn(Place::Node(0), &argv).unwrap();
    let local: SocketAddrV4 = "127.0.0.1:9991".parse().unwrap();
    tb.wait_for_tcp(Place::Node(0), local, Duration::from_secs(10))
        .expect("agent serves its local admin API");
    let node = tb.node(0).fabric_ip;
    wait_until("the Service is redirected", || {
        status_json_at(&tb, "127.0.0.1:9991")["services"]
            .as_array()
            .is_some_and(|s| s.len() == 1)
    });

    // Another host's view: the client pod's network namespace, reaching the node's address.
    let other = Place::Pod("client");
    for path in ["/metrics", "/live", "/ready"] {
        let got = http_get(&tb, other, &format!("http://{node}:9990{path}"));
        assert!(
            matches!(&got, Got::Body(b) if path != "/metrics" || b.contains("skewless_")),
            "{path} must answer other hosts: {got:?}"
        );
    }
    let status = http_get(&tb, other, &format!("http://{node}:9990/status"));
    assert!(
        status.failed_with("404"),
        "/status must not be served on the public listener: {status:?}"
    );
    let local_from_outside = http_get(&tb, other, &format!("http://{node}:9991/status"));
    assert!(
        local_from_outside.failed_with("refused"),
        "the local admin listener must not be reachable from another namespace: \
         {local_from_outside:?}"
    );
    // On the node itself, `skewless status` (its default address) works.
    let text = tb
        .run(Place::Node(0), &[env!("CARGO_BIN_EXE_skewless"), "status"])
        .expect("skewless status runs with its default address");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(&vip.to_string()),
        "skewless status on the node lists the Service: {text}"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn agent_adds_a_missing_balancer_address_and_the_last_agent_to_exit_removes_it() {
    use skewless_testbed::grpc;
    let vip = SocketAddrV4::new(std::net::Ipv4Addr::new(198, 19, 0, 35), 50051);
    let (mut tb, gen_dir) = echo_bed_with(
        vip,
        &ECHO_PODS,
        skewless_testbed::Builder::without_balancer_address,
    );
    assert_eq!(
        balancer_address_line(&tb),
        None,
        "the node starts without the address"
    );
    let services = TempPath::new(format!("skewless-test-services-{}.yaml", tb.id()));
    write_services(&services, &tb, vip, "request", &ECHO_PODS);
    let first = spawn_file_agent(&mut tb, &services);
    wait_until("the agent redirects the Service", || {
        services_in_status(&tb) == 1
    });
    let line = balancer_address_line(&tb).expect("the agent adds its balancer address");
    assert!(
        line.contains("lo:skewless"),
        "labelled as the agent's own: {line}"
    );
    let target = vip.to_string();
    let balanced = grpc::run_client(&tb, &gen_dir, Place::Pod("client"), &target, 200, 4).unwrap();
    assert_eq!(balanced.ok, 200, "every call succeeds: {balanced:?}");
    assert_eq!(
        balanced.pods.len(),
        4,
        "the pick_first client reaches every pod through the balancer: {balanced:?}"
    );

    // A rolling update: a second agent starts, then the first exits. The address stays,
    // because the second one uses it.
    let second_admin = "127.0.0.1:9992";
    let second = spawn_file_agent_at(&mut tb, &services, second_admin, &[]);
    wait_until("the second agent redirects the Service", || {
        status_json_at(&tb, second_admin)["services"]
            .as_array()
            .is_some_and(|s| s.len() == 1)
    });
    assert!(
        tb.terminate(first, Duration::from_secs(20)),
        "the first agent exits on SIGTERM"
    );
    assert!(
        balancer_address_line(&tb).is_some(),
        "the first agent must leave the address its successor uses"
    );
    let after = grpc::run_client(&tb, &gen_dir, Place::Pod("client"), &target, 100, 4).unwrap();
    assert_eq!(after.ok, 100, "the successor serves: {after:?}");
    assert_eq!(after.pods.len(), 4, "and balances: {after:?}");

    // The last agent removes what an agent made.
    assert!(
        tb.terminate(second, Duration::from_secs(20)),
        "the second agent exits on SIGTERM"
    );
    assert_eq!(
        balancer_address_line(&tb),
        None,
        "the last agent to exit removes the address"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn agent_finds_kinds_pod_cgroup_layout_under_the_cgroup_root_and_balances() {
    use skewless_testbed::grpc;
    let vip = SocketAddrV4::new(std::net::Ipv4Addr::new(198, 19, 0, 36), 50051);
    // kind's kubelet: pods below kubelet.slice/kubelet-kubepods.slice, beside other slices.
    let (mut tb, gen_dir) = echo_bed_with(vip, &ECHO_PODS, |b| {
        b.pod_cgroup_parent("kubelet.slice/kubelet-kubepods.slice")
    });
    std::fs::create_dir(tb.cgroup_root().join("system.slice")).expect("a sibling slice");
    let services = TempPath::new(format!("skewless-test-services-{}.yaml", tb.id()));
    write_services(&services, &tb, vip, "request", &ECHO_PODS);
    let root = tb.cgroup_root().display().to_string();
    let file = services.display().to_string();
    tb.spawn(
        Place::Node(0),
        &[
            env!("CARGO_BIN_EXE_skewless"),
            "agent",
            "--services-file",
            &file,
            "--pod-cgroup-root",
            &root,
            "--admin-addr",
            ADMIN,
        ],
    )
    .unwrap();
    tb.wait_for_tcp(
        Place::Node(0),
        ADMIN.parse::<SocketAddrV4>().unwrap(),
        Duration::from_secs(10),
    )
    .expect("the agent starts: it found the pod parent cgroup");
    wait_until("the agent redirects the Service", || {
        services_in_status(&tb) == 1
    });
    let balanced = grpc::run_client(
        &tb,
        &gen_dir,
        Place::Pod("client"),
        &vip.to_string(),
        200,
        4,
    )
    .unwrap();
    assert_eq!(balanced.ok, 200, "{balanced:?}");
    assert_eq!(
        balanced.pods.len(),
        4,
        "the hooks attached at kind's pod parent must balance the pod's client: {balanced:?}"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn a_service_the_agent_cannot_serve_shows_in_status_metrics_and_readiness_until_it_can() {
    let mut d = dual_stack_bed(37);
    write_services_ips(
        &d.services,
        &d.tb,
        &d.ips,
        d.vip.port(),
        "request",
        &ECHO_PODS,
    );
    // IPv6 off on the node's lo: the IPv6 balancer address is gone and cannot be added, so
    // the IPv6 ClusterIP's listener cannot bind.
    let lo_ipv6 = |tb: &skewless_testbed::Testbed, on: bool| {
        tb.run(
            Place::Node(0),
            &[
                "sysctl",
                "-qw",
                &format!("net.ipv6.conf.lo.disable_ipv6={}", u8::from(!on)),
            ],
        )
        .expect("sysctl in the node");
    };
    lo_ipv6(&d.tb, false);
    start_dual_stack_agent(&mut d, &[]);
    let ip6 = skewless_testbed::BALANCER_IP6.to_string();
    let vip6 = d.vip6.to_string();
    wait_until("the IPv6 port is reported not served", || {
        status_json(&d.tb)["unserved"]
            .as_array()
            .is_some_and(|u| u.iter().any(|u| u["vip"] == vip6.as_str()))
    });
    let status = status_json(&d.tb);
    assert_eq!(
        status["services"].as_array().map(Vec::len),
        Some(1),
        "the IPv4 port is served: {status}"
    );
    let error = status["unserved"][0]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&ip6) && error.contains("address of this node"),
        "the error says what failed: {error}"
    );
    let text = status_text(&d.tb);
    assert!(
        text.contains("NOT SERVED") && text.contains(&vip6),
        "skewless status shows it: {text}"
    );
    let metrics = http_get(&d.tb, Place::Node(0), &format!("http://{ADMIN}/metrics"));
    let line = format!("skewless_service_unserved{{service=\"default/echo\",vip=\"{vip6}\"}} 1");
    assert!(
        matches!(&metrics, Got::Body(m) if m.contains(&line)),
        "{line} in /metrics: {metrics:?}"
    );
    let ready = http_get(&d.tb, Place::Node(0), &format!("http://{ADMIN}/ready"));
    assert!(ready.failed_with("503"), "not ready meanwhile: {ready:?}");

    // IPv6 back: the agent adds its address on a later pass, and the port is served.
    lo_ipv6(&d.tb, true);
    wait_until("both families are served", || {
        let s = status_json(&d.tb);
        s["services"].as_array().map(Vec::len) == Some(2)
            && s["unserved"].as_array().is_some_and(Vec::is_empty)
    });
    let ready = http_get(&d.tb, Place::Node(0), &format!("http://{ADMIN}/ready"));
    assert!(matches!(ready, Got::Body(_)), "ready again: {ready:?}");
}
