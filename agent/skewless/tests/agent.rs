//! Privileged: runs the real `skewless agent` binary in a testbed node. Run with
//! `cargo xtask test` (as root).

mod testbed_agent;

use std::{net::SocketAddrV4, path::Path, time::Duration};

use skewless_testbed::{Place, fixtures::IdentBed};
use testbed_agent::{
    ADMIN, DualStack, ECHO_PODS, TempPath, dual_stack_bed, echo_bed, metric, services_in_status,
    spawn_dual_stack_agent, spawn_file_agent, spawn_long_client, status_json, status_json_at,
    status_text, wait_until, write_services, write_services_full, write_services_ips,
};

/// Starts the agent in the node with a raw redirect of the IdentBed VIP to its balancer
/// stand-in, attached to the client pod; waits for its admin API. Returns its PID. With
/// `own`, the agent runs in that cgroup (below the client pod's) instead of the node's.
fn spawn_redirect_agent(bed: &mut IdentBed, own: Option<&Path>) -> u32 {
    let cgroup = bed.tb.pod("client").unwrap().cgroup.display().to_string();
    let redirect = format!("{}={}", IdentBed::vip(), IdentBed::balancer());
    let argv = [
        env!("CARGO_BIN_EXE_skewless"),
        "agent",
        "--cgroup",
        &cgroup,
        "--redirect",
        &redirect,
        "--admin-addr",
        ADMIN,
    ];
    let mut cmd = match own {
        Some(own) => bed.tb.command_in(Place::Node(0), own, &argv),
        None => bed.tb.command(Place::Node(0), &argv),
    }
    .unwrap();
    let agent = bed.tb.spawn_command(&mut cmd).unwrap();
    bed.tb
        .wait_for_tcp(
            Place::Node(0),
            ADMIN.parse::<SocketAddrV4>().unwrap(),
            Duration::from_secs(10),
        )
        .expect("agent serves its admin API");
    agent
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn agent_redirects_reports_status_and_fails_open_when_killed() {
    let mut bed = IdentBed::new().expect("testbed builds (needs root)");
    let vip = IdentBed::vip();
    let agent = spawn_redirect_agent(&mut bed, None);

    let redirected = bed.probe("client", vip, 100).unwrap();
    assert!(
        redirected.only("balancer"),
        "the agent must redirect the listed Service: {redirected:?}"
    );

    let status = status_text(&bed.tb);
    assert!(
        status.contains(&vip.to_string()),
        "status must list the redirected Service: {status}"
    );
    assert!(
        status.contains("100 redirected"),
        "status must count redirected connects: {status}"
    );

    // SIGKILL: no cleanup code runs, yet the kernel closes the bpf_links with the process.
    // `kill` returns once the process is reaped; the probe's first connect follows at once.
    bed.tb.kill(agent);
    let after = bed.probe("client", vip, 50).unwrap();
    assert!(
        after.all_servers(),
        "after SIGKILL every connect must go direct: {after:?}"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn a_provoked_map_update_failure_is_logged_by_the_programs_rate_limited_and_connects_still_work() {
    use std::os::unix::fs::MetadataExt as _;
    const CONNECTS: usize = 40;
    let mut bed = IdentBed::new().expect("testbed builds (needs root)");
    let vip = IdentBed::vip();
    let client = bed.tb.pod("client").unwrap().clone();
    let cgroup = client.cgroup.display().to_string();
    let redirect = format!("{vip}={}", IdentBed::balancer());
    let argv = [
        env!("CARGO_BIN_EXE_skewless"),
        "agent",
        "--cgroup",
        &cgroup,
        "--redirect",
        &redirect,
        "--admin-addr",
        ADMIN,
        "--provoke-map-update-failures",
    ];
    let log = TempPath::new(format!("skewless-test-agent-log-{}.txt", bed.tb.id()));
    let mut cmd = bed.tb.command(Place::Node(0), &argv).unwrap();
    cmd.stderr(std::fs::File::create(&*log).unwrap());
    bed.tb.spawn_command(&mut cmd).unwrap();
    bed.tb
        .wait_for_tcp(
            Place::Node(0),
            ADMIN.parse::<SocketAddrV4>().unwrap(),
            Duration::from_secs(10),
        )
        .expect("agent serves its admin API");

    // Every record insert fails: connects are still redirected (the hooks fail open), each
    // failure is counted, and the programs log a few of them with what a counter cannot say.
    let started = std::time::Instant::now();
    let probed = bed.probe("client", vip, CONNECTS).unwrap();
    let elapsed = started.elapsed();
    assert!(
        probed.only("balancer"),
        "every connect still reaches the balancer: {probed:?}"
    );
    let origdst = metric(&bed.tb, "skewless_origdst_update_failed_total");
    let records = metric(&bed.tb, "skewless_observed_record_failed_total");
    assert!(
        origdst >= CONNECTS as f64 && records >= CONNECTS as f64,
        "every failure is counted: {origdst} original destinations, {records} records"
    );
    let read = || std::fs::read_to_string(&*log).unwrap_or_default();
    wait_until("the programs' lines reach the agent's log", || {
        let text = read();
        text.contains("not kept for getpeername") && text.contains("unobserved: record not kept")
    });
    let text = read();
    let lines = |what: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.contains("skewless_ebpf") && l.contains(what))
            .map(str::to_owned)
            .collect()
    };
    let kept = lines("not kept for getpeername");
    let unobserved = lines("unobserved: record not kept");
    let cgroup_id = std::fs::metadata(&client.cgroup).unwrap().ino();
    assert!(
        kept[0].contains(&format!("original destination {vip} "))
            && kept[0].contains("map update failed: -2")
            && kept[0].contains(&format!("cgroup {cgroup_id}")),
        "the line names the Service address, the errno (ENOENT) and the pod's cgroup: {}",
        kept[0]
    );
    assert!(
        unobserved[0].contains(&format!("pod connection {}:", client.ip))
            && unobserved[0].contains(&format!("-> {}:", IdentBed::balancer().ip())),
        "the line names the connection's addresses: {}",
        unobserved[0]
    );
    // Rate-limited in the kernel: at most one line per kind, CPU and second.
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let bound = cpus * (elapsed.as_secs() as usize + 2);
    assert!(
        kept.len() <= bound && unobserved.len() <= bound,
        "{} and {} lines for {CONNECTS} failures each in {elapsed:?} on {cpus} CPUs",
        kept.len(),
        unobserved.len()
    );
    eprintln!(
        "{CONNECTS} connects in {elapsed:?}: {} + {} lines logged; first: {}",
        kept.len(),
        unobserved.len(),
        kept[0]
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn agent_never_redirects_connects_from_its_own_cgroup() {
    let mut bed = IdentBed::new().expect("testbed builds (needs root)");
    let vip = IdentBed::vip();
    // As on Kubernetes: the hooks attach to a parent cgroup (kubepods) and the agent's own
    // container is a cgroup below it. The agent is told only where to attach; it finds its
    // own cgroup itself (/proc/self/cgroup).
    let own = bed
        .tb
        .child_cgroup("client", "agent")
        .expect("the agent's cgroup");
    spawn_redirect_agent(&mut bed, Some(&own));

    // Connects from the agent's cgroup: what its own Kubernetes client makes to an opted-in
    // `kubernetes` VIP.
    let own_connects = bed.probe_in("client", &own, vip, 100).unwrap();
    assert!(
        own_connects.all_servers(),
        "connects from the agent's own cgroup must go to the pods through the DNAT, never \
         to the balancer: {own_connects:?}"
    );
    // The rest of the cgroup the hooks attach to is redirected.
    let redirected = bed.probe("client", vip, 100).unwrap();
    assert!(
        redirected.only("balancer"),
        "the pod's other processes must still be redirected: {redirected:?}"
    );
}

#[test]
fn agent_refuses_the_cgroup_root() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_skewless"))
        .args([
            "agent",
            "--cgroup",
            "/sys/fs/cgroup/unified",
            "--admin-addr",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "attaching to the hierarchy root must be refused"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("refusing to attach"),
        "the error must say why: {stderr}"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn agent_balances_pick_first_grpc_client_through_the_vip_and_follows_opt_out() {
    use skewless_testbed::grpc;
    const PODS: [&str; 4] = ECHO_PODS;
    let vip = SocketAddrV4::new(std::net::Ipv4Addr::new(198, 19, 0, 20), 50051);
    let (mut tb, gen_dir) = echo_bed(vip, &PODS);
    let target = vip.to_string();

    // Control: without the agent, grpcio's pick_first channel pins to one pod.
    let pinned = grpc::run_client(&tb, &gen_dir, Place::Pod("client"), &target, 200, 4).unwrap();
    assert_eq!(pinned.ok, 200, "{pinned:?}");
    assert_eq!(
        pinned.pods.len(),
        1,
        "without skewless the client must be pinned: {pinned:?}"
    );

    let services = TempPath::new(format!("skewless-test-services-{}.yaml", tb.id()));
    write_services(&services, &tb, vip, "request", &PODS);
    let cgroup = tb.pod("client").unwrap().cgroup.display().to_string();
    // Only the client pod's network may use the balancer.
    let client_ip = tb.pod("client").unwrap().ip.octets();
    let pod_cidr = format!("{}.{}.{}.0/24", client_ip[0], client_ip[1], client_ip[2]);
    let agent = tb
        .spawn(
            Place::Node(0),
            &[
                env!("CARGO_BIN_EXE_skewless"),
                "agent",
                "--services-file",
                &services.display().to_string(),
                "--cgroup",
                &cgroup,
                "--pod-cidr",
                &pod_cidr,
                "--admin-addr",
                ADMIN,
                // Two data-plane workers on one SO_REUSEPORT address: whichever accepts the
                // client's connection must balance it.
                "--balancer-threads",
                "2",
            ],
        )
        .unwrap();
    wait_until("the agent redirects the Service", || {
        services_in_status(&tb) == 1
    });

    let balanced = grpc::run_client(&tb, &gen_dir, Place::Pod("client"), &target, 200, 4).unwrap();
    assert_eq!(
        balanced.ok, 200,
        "every call must succeed through the balancer: {balanced:?}"
    );
    assert_eq!(
        balanced.pods.len(),
        4,
        "the same client must reach every pod: {balanced:?}"
    );
    // The picker is latency-aware, and these Python servers share two cores with everything
    // else, so exact fairness is not asserted here (the balancer's own tests do that with
    // controlled latencies); what must hold is that no pod keeps the client (pinned = 1.0).
    let largest = balanced.pods.values().copied().max().unwrap_or(0);
    assert!(
        largest <= 120,
        "no pod may keep most of the calls (largest {largest} of 200): {balanced:?}"
    );

    // Anyone else who reaches the listener (here: the node itself, as another node with a
    // route to the link-local address would) is refused before any HTTP/2.
    let listener = status_json(&tb)["services"][0]["listener"]
        .as_str()
        .unwrap()
        .to_owned();
    let outsider = grpc::run_client(&tb, &gen_dir, Place::Node(0), &listener, 5, 1).unwrap();
    assert_eq!(
        outsider.ok, 0,
        "a peer outside the pod CIDR must not be served: {outsider:?}"
    );
    let refused = status_json(&tb)["refused_peers"].as_u64().unwrap();
    assert!(
        refused >= 1,
        "refused connections must be counted, got {refused}"
    );

    // Opt-out (mode observe): the redirect goes away; new connections are plain L4 again.
    write_services(&services, &tb, vip, "observe", &PODS);
    wait_until("the agent drops the redirect", || {
        services_in_status(&tb) == 0
    });
    let after = grpc::run_client(&tb, &gen_dir, Place::Pod("client"), &target, 100, 4).unwrap();
    assert_eq!(after.ok, 100, "{after:?}");
    assert_eq!(
        after.pods.len(),
        1,
        "after opt-out the client is pinned again: {after:?}"
    );

    assert!(
        tb.terminate(agent, Duration::from_secs(10)),
        "the agent must exit on SIGTERM"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn stopped_agent_fails_open_within_a_second_and_resumes() {
    let mut bed = IdentBed::new().expect("testbed builds (needs root)");
    let vip = IdentBed::vip();
    let agent = spawn_redirect_agent(&mut bed, None);
    assert!(
        bed.probe("client", vip, 20).unwrap().only("balancer"),
        "the agent redirects while alive"
    );

    // A hung agent (here: stopped) keeps its bpf_links, so only the stale heartbeat can
    // send connects around a balancer that no longer serves.
    assert!(bed.tb.signal(agent, "STOP"));
    std::thread::sleep(Duration::from_secs(1));
    let stopped = bed.probe("client", vip, 50).unwrap();
    assert!(bed.tb.signal(agent, "CONT"));
    assert!(
        stopped.all_servers(),
        "1 s after the agent hung, connects must go direct: {stopped:?}"
    );

    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let resumed = bed.probe("client", vip, 10).unwrap();
        if resumed.only("balancer") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "redirects must resume once the agent runs again: {resumed:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits up to 10 s for `/status` to show the Service's pod traffic all on one backend, and
/// returns that report.
fn wait_pinned(tb: &skewless_testbed::Testbed) -> serde_json::Value {
    wait_pinned_at(tb, None)
}

/// [`wait_pinned`] for the observed Service port at `vip` (`None`: the first one listed).
fn wait_pinned_at(tb: &skewless_testbed::Testbed, vip: Option<&str>) -> serde_json::Value {
    let started = std::time::Instant::now();
    loop {
        let status = status_json(tb);
        let o = match vip {
            None => status["observed"][0].clone(),
            Some(vip) => status["observed"]
                .as_array()
                .and_then(|a| a.iter().find(|o| o["vip"] == vip).cloned())
                .unwrap_or_default(),
        };
        if o["backends_receiving"] == 1 && o["largest_share"].as_f64() == Some(1.0) {
            return o;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the pinned client must be reported within 10 s; last status: {status}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn assert_pinned_to_a_pod(
    o: &serde_json::Value,
    tb: &skewless_testbed::Testbed,
    pods: &[&str],
    vip: SocketAddrV4,
) {
    assert_eq!(o["ready_backends"], 4, "{o}");
    assert_eq!(
        o["skew"].as_f64(),
        Some(4.0),
        "all traffic on 1 of 4 backends is skew 4: {o}"
    );
    let backend = o["backends"][0]["backend"].as_str().unwrap().to_owned();
    assert!(
        pods.iter()
            .any(|p| backend == format!("{}:{}", tb.pod(p).unwrap().ip, vip.port())),
        "the backend must be a pod resolved through conntrack, not the VIP: {backend}"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn observe_mode_flags_a_pinned_pick_first_client_within_ten_seconds() {
    let vip = SocketAddrV4::new(std::net::Ipv4Addr::new(198, 19, 0, 30), 50051);
    let (mut tb, gen_dir) = echo_bed(vip, &ECHO_PODS);
    let services = TempPath::new(format!("skewless-test-services-{}.yaml", tb.id()));
    write_services(&services, &tb, vip, "observe", &ECHO_PODS);
    spawn_file_agent(&mut tb, &services);
    spawn_long_client(&mut tb, &gen_dir, vip, 2, &[]);
    let o = wait_pinned(&tb);
    assert_eq!(o["mode"], "observe", "{o}");
    assert_pinned_to_a_pod(&o, &tb, &ECHO_PODS, vip);
    // The hook's own bookkeeping is on /metrics: the client's connection was recorded, and
    // nothing failed to be.
    assert!(
        metric(&tb, "skewless_observed_connections_total") >= 1.0,
        "the recorded connection must be counted"
    );
    assert!(
        metric(&tb, "skewless_observed_record_failed_total").abs() < f64::EPSILON,
        "no record may have failed"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connection_opened_before_opt_in_is_left_alone_and_reported_pinned() {
    let vip = SocketAddrV4::new(std::net::Ipv4Addr::new(198, 19, 0, 31), 50051);
    let (mut tb, gen_dir) = echo_bed(vip, &ECHO_PODS);
    let services = TempPath::new(format!("skewless-test-services-{}.yaml", tb.id()));
    std::fs::write(&services, "services: []\n").unwrap();
    spawn_file_agent(&mut tb, &services);
    let client = spawn_long_client(&mut tb, &gen_dir, vip, 2, &[]);
    std::thread::sleep(Duration::from_secs(1));

    // Opt in to request mode while the client's connection is open: that connection is not
    // redirected (it connected before), keeps working, and is reported as pinned.
    write_services(&services, &tb, vip, "request", &ECHO_PODS);
    let o = wait_pinned(&tb);
    assert_eq!(o["mode"], "request", "{o}");
    assert_pinned_to_a_pod(&o, &tb, &ECHO_PODS, vip);
    assert!(
        tb.is_running(client),
        "the client's existing connection must not be disturbed"
    );
}

/// Waits until the agent has balanced more than 60 calls (the tests assert over 50 before
/// their fault). A fixed sleep after spawning the client once injected the fault before the
/// client's first 50 calls: its start-up time grows with the machine's load.
fn wait_for_load(tb: &skewless_testbed::Testbed) {
    wait_until("the load runs through the balancer", || {
        status_json(tb)["services"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| s["endpoints"].as_array().into_iter().flatten())
            .filter_map(|e| e["requests"].as_u64())
            .sum::<u64>()
            > 60
    });
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn sigkill_under_grpc_load_every_call_a_second_later_succeeds() {
    let vip = SocketAddrV4::new(std::net::Ipv4Addr::new(198, 19, 0, 32), 50051);
    let (mut tb, gen_dir) = echo_bed(vip, &ECHO_PODS);
    let services = TempPath::new(format!("skewless-test-services-{}.yaml", tb.id()));
    write_services(&services, &tb, vip, "request", &ECHO_PODS);
    let agent = spawn_file_agent(&mut tb, &services);
    wait_until("the agent redirects the Service", || {
        services_in_status(&tb) == 1
    });

    // pick_first client under load for 5 s. Its reconnect backoff is set to 100 ms so the
    // measurement is about skewless, not about grpcio's default 1 s first backoff.
    let log = TempPath::new(format!("skewless-test-calls-{}.log", tb.id()));
    let log_arg = log.display().to_string();
    let extra = [
        "--duration",
        "5",
        "--timeout",
        "2",
        "--reconnect-backoff-ms",
        "100",
        "--log",
        &log_arg,
    ];
    let client_pid = spawn_long_client(&mut tb, &gen_dir, vip, 4, &extra);
    wait_for_load(&tb);
    let killed_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    tb.kill(agent);
    wait_until("the client finishes", || !tb.is_running(client_pid));

    let text = std::fs::read_to_string(&log).expect("the client writes its call log");
    let calls: Vec<(f64, String)> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(t, r)| (t.parse().unwrap(), r.to_owned()))
        .collect();
    let before = calls.iter().filter(|(t, _)| *t < killed_at).count();
    let late: Vec<&(f64, String)> = calls
        .iter()
        .filter(|(t, _)| *t >= killed_at + 1.0)
        .collect();
    assert!(
        before > 50,
        "the load must run through the balancer before the kill ({before} calls)"
    );
    assert!(
        late.len() > 50,
        "the load must go on after the kill ({} calls)",
        late.len()
    );
    let failed: Vec<&&(f64, String)> = late.iter().filter(|(_, r)| r != "OK").collect();
    assert!(
        failed.is_empty(),
        "every call started 1 s or more after SIGKILL must succeed; {} of {} failed, first: {:?}",
        failed.len(),
        late.len(),
        failed.first()
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn agent_balances_grpc_through_an_ipv6_cluster_ip() {
    use skewless_testbed::grpc;
    let mut d = dual_stack_bed(33);
    let target6 = d.vip6.to_string();

    // Control: through the IPv6 VIP (ip6 DNAT) the pick_first client is pinned.
    let pinned =
        grpc::run_client(&d.tb, &d.gen_dir, Place::Pod("client"), &target6, 100, 4).unwrap();
    assert_eq!(
        (pinned.ok, pinned.pods.len()),
        (100, 1),
        "without skewless: pinned: {pinned:?}"
    );

    write_services_ips(
        &d.services,
        &d.tb,
        &d.ips,
        d.vip.port(),
        "request",
        &ECHO_PODS,
    );
    spawn_dual_stack_agent(&mut d, &[]);
    let status = status_json(&d.tb);
    assert!(
        status["redirects"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["service"] == target6),
        "the IPv6 VIP must be in the redirect map: {status}"
    );

    let balanced =
        grpc::run_client(&d.tb, &d.gen_dir, Place::Pod("client"), &target6, 200, 4).unwrap();
    assert_eq!(
        balanced.ok, 200,
        "every call through the IPv6 VIP must succeed: {balanced:?}"
    );
    assert!(
        balanced.pods.len() >= 2,
        "the IPv6 client must be balanced, not pinned: {balanced:?}"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn observe_mode_reports_the_backend_of_a_pinned_ipv6_client() {
    let DualStack {
        mut tb,
        gen_dir,
        vip,
        vip6,
        services,
        ips,
    } = dual_stack_bed(34);
    write_services_full(
        &services,
        &tb,
        &ips,
        vip.port(),
        "observe",
        &ECHO_PODS,
        true,
    );
    spawn_file_agent(&mut tb, &services);
    // A pick_first client through the IPv6 ClusterIP (ip6 DNAT in the node).
    spawn_long_client(&mut tb, &gen_dir, vip6, 2, &[]);
    let o = wait_pinned_at(&tb, Some(&vip6.to_string()));
    assert_eq!(o["mode"], "observe", "{o}");
    assert_eq!(
        o["ready_backends"], 4,
        "the IPv6 ClusterIP's backends are the pods' IPv6 addresses: {o}"
    );
    assert_eq!(o["skew"].as_f64(), Some(4.0), "{o}");
    assert_eq!(o["unresolved"], 0, "{o}");
    let backend = o["backends"][0]["backend"].as_str().unwrap().to_owned();
    assert!(
        ECHO_PODS.iter().any(|p| backend
            == std::net::SocketAddrV6::new(tb.pod(p).unwrap().ip6, vip.port(), 0, 0).to_string()),
        "the backend must be a pod's IPv6 address resolved through conntrack, not the VIP: \
         {backend}"
    );
    eprintln!("IPv6 observe: pinned to {backend}: {o}");
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn ipv6_balancer_listener_serves_pods_and_refuses_other_peers() {
    use skewless_testbed::{BALANCER_IP6, grpc};
    let mut d = dual_stack_bed(35);
    write_services_ips(
        &d.services,
        &d.tb,
        &d.ips,
        d.vip.port(),
        "request",
        &ECHO_PODS,
    );
    let client = d.tb.pod("client").unwrap();
    // Only the client pod's networks, IPv4 and IPv6, may use the balancers.
    let o = client.ip.octets();
    let pod_cidr = format!("{}.{}.{}.0/24", o[0], o[1], o[2]);
    let pod_cidr6 = format!("{}/64", client.ip6);
    spawn_dual_stack_agent(&mut d, &["--pod-cidr", &pod_cidr, "--pod-cidr", &pod_cidr6]);
    // The file is removed (and the testbed torn down) at the end of the test, with `d`.
    let DualStack {
        tb, gen_dir, vip6, ..
    } = d;
    let status = status_json(&tb);
    let listener6 = status["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["vip"] == vip6.to_string())
        .and_then(|s| s["listener"].as_str())
        .unwrap_or_else(|| panic!("no balancer for the IPv6 VIP: {status}"))
        .to_owned();
    assert!(
        listener6.starts_with(&format!("[{BALANCER_IP6}]:")),
        "the IPv6 VIP is served on the --balancer-ip6 listener: {listener6}"
    );
    let refused_before = status["refused_peers"].as_u64().unwrap();

    // The pod's own IPv6 address is inside its /64: redirected to the IPv6 listener and served.
    let served = grpc::run_client(
        &tb,
        &gen_dir,
        Place::Pod("client"),
        &vip6.to_string(),
        50,
        2,
    )
    .unwrap();
    assert_eq!(
        served.ok, 50,
        "a pod's IPv6 address must be served: {served:?}"
    );
    assert_eq!(
        status_json(&tb)["refused_peers"].as_u64().unwrap(),
        refused_before,
        "no refusal for the pod's own IPv6 connections"
    );

    // The node reaching the IPv6 listener directly has a source address outside the pod
    // CIDRs (as another node with a route to it would): refused before any HTTP/2.
    let outsider = grpc::run_client(&tb, &gen_dir, Place::Node(0), &listener6, 5, 1).unwrap();
    assert_eq!(
        outsider.ok, 0,
        "a peer outside the pod CIDRs must not be served over IPv6: {outsider:?}"
    );
    let refused = status_json(&tb)["refused_peers"].as_u64().unwrap();
    assert!(
        refused > refused_before,
        "the refused IPv6 connection must be counted: {refused_before} -> {refused}"
    );
    let counted = metric(&tb, "skewless_balancer_refused_total");
    assert!(
        counted >= refused as f64,
        "/metrics must count the refusals too: {counted} < {refused}"
    );
    eprintln!(
        "IPv6 peer check: pod {}/50 calls served, node outsider {}/5 served, refused \
         {refused_before} -> {refused}, /metrics {counted}",
        served.ok, outsider.ok
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn rolling_upgrade_under_grpc_load_fails_no_call() {
    const NEW_ADMIN: &str = "127.0.0.1:9991";
    let vip = SocketAddrV4::new(std::net::Ipv4Addr::new(198, 19, 0, 33), 50051);
    let (mut tb, gen_dir) = echo_bed(vip, &ECHO_PODS);
    let services = TempPath::new(format!("skewless-test-services-{}.yaml", tb.id()));
    write_services(&services, &tb, vip, "request", &ECHO_PODS);
    let old = spawn_file_agent(&mut tb, &services);
    wait_until("the old agent redirects the Service", || {
        services_in_status(&tb) == 1
    });

    // A pick_first grpcio client under load for 8 s, 5 s deadlines.
    let log = TempPath::new(format!("skewless-test-calls-{}.log", tb.id()));
    let log_arg = log.display().to_string();
    let extra = ["--duration", "8", "--timeout", "5", "--log", &log_arg];
    let client = spawn_long_client(&mut tb, &gen_dir, vip, 4, &extra);
    wait_for_load(&tb);

    // The upgrade: the old agent is told to stop (it removes its redirects, then drains its
    // balancers with the two-phase GOAWAY), and the new one starts while it drains. Both
    // agents' programs are attached to the pod at once; each redirects only what its own map
    // holds, and each writes a redirect only once its listener serves.
    let upgrade_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(tb.signal(old, "TERM"), "the old agent gets SIGTERM");
    let cgroup = tb.pod("client").unwrap().cgroup.display().to_string();
    let file = services.display().to_string();
    let new_argv = [
        env!("CARGO_BIN_EXE_skewless"),
        "agent",
        "--services-file",
        &file,
        "--cgroup",
        &cgroup,
        "--admin-addr",
        NEW_ADMIN,
    ];
    tb.spawn(Place::Node(0), &new_argv).unwrap();
    wait_until("the client finishes", || !tb.is_running(client));
    assert!(!tb.is_running(old), "the old agent must have exited");

    let text = std::fs::read_to_string(&log).expect("the client writes its call log");
    let calls: Vec<(f64, String)> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(t, r)| (t.parse().unwrap(), r.to_owned()))
        .collect();
    let before = calls.iter().filter(|(t, _)| *t < upgrade_at).count();
    let after = calls.iter().filter(|(t, _)| *t >= upgrade_at + 2.0).count();
    assert!(before > 50, "load before the upgrade ({before} calls)");
    assert!(after > 50, "load after the upgrade ({after} calls)");
    let failed: Vec<&(f64, String)> = calls.iter().filter(|(_, r)| r != "OK").collect();
    assert!(
        failed.is_empty(),
        "no call may fail across the upgrade; {} of {} failed, first: {:?}",
        failed.len(),
        calls.len(),
        failed.first()
    );
    // The new agent took over the redirect: a client connecting now is balanced by it. (The
    // client above reconnected while the old agent drained, before the new one had loaded,
    // so it went direct and stays on its pod: no call lost, but unbalanced until it
    // reconnects. Starting the new agent first, as a surge rollout does, avoids that gap.)
    let late = spawn_long_client(&mut tb, &gen_dir, vip, 2, &["--duration", "1"]);
    wait_until("the late client finishes", || !tb.is_running(late));
    let status = status_json_at(&tb, NEW_ADMIN);
    let served: u64 = status["services"][0]["endpoints"]
        .as_array()
        .map_or(0, |e| e.iter().filter_map(|e| e["requests"].as_u64()).sum());
    assert!(
        served > 50,
        "the new agent's balancer must carry a client that connects after the upgrade: {status}"
    );
}
