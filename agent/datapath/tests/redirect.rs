//! Privileged: loads the real connect4 program into the real kernel and drives real sockets
//! through a testbed topology. Run with `cargo xtask test` (as root).

use std::net::{SocketAddrV4, SocketAddrV6};

use skewless_datapath::{Counter, Datapath};
use skewless_testbed::fixtures::IdentBed;

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connect_to_listed_vip_port_is_redirected_and_nothing_else_is() {
    let bed = IdentBed::new().expect("testbed builds (needs root)");
    let vip = IdentBed::vip();
    let mut dp = Datapath::load().expect("eBPF programs load");
    dp.set_redirect(vip, IdentBed::balancer()).unwrap();

    // Control: with the map filled but the program not attached, the VIP reaches the pods.
    // This is what proves the assertions below measure the hook and nothing else.
    let before = bed.probe("client", vip, 60).unwrap();
    assert!(
        before.all_servers(),
        "unattached: VIP must reach the pods, got {before:?}"
    );
    assert!(
        before.0.len() > 1,
        "kube-proxy-style DNAT must spread connections, got {before:?}"
    );

    let attachment = dp
        .attach(&bed.tb.pod("client").unwrap().cgroup)
        .expect("attach to the client cgroup");
    let n = 1000;
    let redirected = bed.probe("client", vip, n).unwrap();
    assert!(
        redirected.only("balancer"),
        "every connect to the listed VIP:port must reach the balancer, got {redirected:?}"
    );
    assert!(
        redirected.peer_always(&vip.to_string()),
        "getpeername must report the VIP, not the balancer: {:?}",
        redirected.1
    );
    // Dual-stack sockets reach IPv4 Services through IPv4-mapped addresses (connect6).
    let mapped = bed.probe_v4_mapped("client", vip, 100).unwrap();
    assert!(
        mapped.only("balancer"),
        "::ffff:VIP must be redirected too: {mapped:?}"
    );
    assert!(
        mapped.peer_always(&format!("::ffff:{}:{}", vip.ip(), vip.port())),
        "getpeername6 must report the mapped VIP: {:?}",
        mapped.1
    );

    // Untouched: same VIP other port, another VIP, a pod IP, UDP, and a pod without the hook.
    let other_port = SocketAddrV4::new(IdentBed::VIP, IdentBed::OTHER_PORT);
    let other_port = bed.probe("client", other_port, n).unwrap();
    assert!(
        other_port.all_servers(),
        "other port of the VIP must not be redirected: {other_port:?}"
    );
    let other_vip = SocketAddrV4::new(IdentBed::OTHER_VIP, IdentBed::PORT);
    let other_vip = bed.probe("client", other_vip, n).unwrap();
    assert!(
        other_vip.all_servers(),
        "non-listed VIP must not be redirected: {other_vip:?}"
    );
    let server = IdentBed::SERVERS[1];
    let pod_ip = SocketAddrV4::new(bed.tb.pod(server).unwrap().ip, IdentBed::PORT);
    let direct = bed.probe("client", pod_ip, n).unwrap();
    assert!(
        direct.only(server),
        "pod IP must be reached directly: {direct:?}"
    );
    assert_eq!(
        bed.udp_peer("client", vip).unwrap(),
        vip.to_string(),
        "a UDP socket to the VIP:port must not be redirected"
    );
    let bystander = bed.probe("bystander", vip, n).unwrap();
    assert!(
        bystander.all_servers(),
        "a cgroup without the hook must not be redirected: {bystander:?}"
    );

    let counters = dp.counters().unwrap();
    assert_eq!(
        counters[Counter::Connect4Redirected],
        n as u64,
        "kernel counter must match: {counters:?}"
    );
    assert_eq!(
        counters[Counter::Connect6Redirected],
        100,
        "connect6 counter must match: {counters:?}"
    );
    assert_eq!(
        counters[Counter::PeerNameRestored],
        n as u64 + 100,
        "every redirected socket's getpeername must be restored once: {counters:?}"
    );

    // Removing the map entry sends the next connect through the DNAT again.
    dp.remove_redirect(vip).unwrap();
    let removed = bed.probe("client", vip, 30).unwrap();
    assert!(
        removed.all_servers(),
        "after removing the entry the VIP must reach the pods: {removed:?}"
    );

    // Detaching restores plain L4 even with the entry present.
    dp.set_redirect(vip, IdentBed::balancer()).unwrap();
    assert!(bed.probe("client", vip, 10).unwrap().only("balancer"));
    dp.detach(attachment).unwrap();
    let detached = bed.probe("client", vip, 30).unwrap();
    assert!(
        detached.all_servers(),
        "after detach the VIP must reach the pods: {detached:?}"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn dropping_the_datapath_detaches_everything() {
    let bed = IdentBed::new().expect("testbed builds (needs root)");
    let vip = IdentBed::vip();
    let mut dp = Datapath::load().expect("eBPF programs load");
    dp.set_redirect(vip, IdentBed::balancer()).unwrap();
    let _attachment = dp.attach(&bed.tb.pod("client").unwrap().cgroup).unwrap();
    assert!(bed.probe("client", vip, 10).unwrap().only("balancer"));
    // What happens when the agent exits or is killed: bpf_links close with the process.
    drop(dp);
    let after = bed.probe("client", vip, 30).unwrap();
    assert!(
        after.all_servers(),
        "with the datapath gone, connects must go direct: {after:?}"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connect_to_listed_native_ipv6_vip_port_is_redirected_and_nothing_else_is() {
    let bed = IdentBed::new().expect("testbed builds (needs root)");
    let vip6 = IdentBed::vip6();
    let mut dp = Datapath::load().expect("eBPF programs load");
    dp.set_redirect(vip6, IdentBed::balancer6()).unwrap();
    assert_eq!(
        dp.redirects(),
        vec![(vip6.into(), IdentBed::balancer6().into())],
        "one IPv6 entry, and none in the IPv4 map"
    );

    // Control: the IPv6 DNAT spreads connections over the pods, and the balancer stand-in
    // answers on its IPv6 address.
    let plain = bed.probe("client", vip6, 60).unwrap();
    assert!(
        plain.all_servers() && plain.0.len() > 1,
        "unattached: the IPv6 VIP must reach several pods, got {plain:?}"
    );
    assert!(
        bed.probe("client", IdentBed::balancer6(), 5)
            .unwrap()
            .only("balancer"),
        "the IPv6 balancer stand-in must answer"
    );

    let attachment = dp
        .attach(&bed.tb.pod("client").unwrap().cgroup)
        .expect("attach to the client cgroup");
    // With the program attached but no entry, the IPv6 VIP still reaches the pods.
    dp.remove_redirect(vip6).unwrap();
    assert!(dp.redirects().is_empty());
    let no_entry = bed.probe("client", vip6, 60).unwrap();
    assert!(
        no_entry.all_servers() && no_entry.0.len() > 1,
        "attached without an entry: the IPv6 VIP must reach the pods, got {no_entry:?}"
    );
    let before = dp.counters().unwrap();
    assert_eq!(before[Counter::Connect6NativeRedirected], 0, "{before:?}");

    dp.set_redirect(vip6, IdentBed::balancer6()).unwrap();
    let n = 500;
    let redirected = bed.probe("client", vip6, n).unwrap();
    assert!(
        redirected.only("balancer"),
        "every connect to the listed IPv6 VIP:port must reach the balancer, got {redirected:?}"
    );
    assert!(
        redirected.peer_always(&IdentBed::peer_string(vip6)),
        "getpeername6 must report the IPv6 VIP, not the balancer: {:?}",
        redirected.1
    );

    // Untouched: the IPv6 VIP on another port, another IPv6 VIP, a pod's IPv6 address, UDP,
    // the IPv4 VIP (no IPv4 entry), and a pod without the hook.
    let other_port = SocketAddrV6::new(*vip6.ip(), IdentBed::OTHER_PORT, 0, 0);
    let other_port = bed.probe("client", other_port, n).unwrap();
    assert!(
        other_port.all_servers(),
        "other port of the IPv6 VIP must not be redirected: {other_port:?}"
    );
    let other_vip = SocketAddrV6::new(
        skewless_testbed::vip6(IdentBed::OTHER_VIP),
        IdentBed::PORT,
        0,
        0,
    );
    let other_vip = bed.probe("client", other_vip, 100).unwrap();
    assert!(
        other_vip.all_servers(),
        "non-listed IPv6 VIP must not be redirected: {other_vip:?}"
    );
    let server = IdentBed::SERVERS[1];
    let pod_ip6 = SocketAddrV6::new(bed.tb.pod(server).unwrap().ip6, IdentBed::PORT, 0, 0);
    let direct = bed.probe("client", pod_ip6, n).unwrap();
    assert!(
        direct.only(server),
        "a pod's IPv6 address must be reached directly: {direct:?}"
    );
    assert!(
        direct.peer_always(&IdentBed::peer_string(pod_ip6)),
        "getpeername6 of an unredirected socket must be untouched: {:?}",
        direct.1
    );
    assert_eq!(
        bed.udp_peer("client", vip6).unwrap(),
        IdentBed::peer_string(vip6),
        "a UDP socket to the IPv6 VIP:port must not be redirected"
    );
    let v4 = bed.probe("client", IdentBed::vip(), 100).unwrap();
    assert!(
        v4.all_servers(),
        "an IPv6 entry must not redirect the IPv4 VIP: {v4:?}"
    );
    let bystander = bed.probe("bystander", vip6, n).unwrap();
    assert!(
        bystander.all_servers(),
        "a cgroup without the hook must not be redirected: {bystander:?}"
    );

    let counters = dp.counters().unwrap();
    assert_eq!(
        counters[Counter::Connect6NativeRedirected],
        n as u64,
        "kernel counter must match: {counters:?}"
    );
    assert_eq!(counters[Counter::Connect6Redirected], 0, "{counters:?}");
    assert_eq!(counters[Counter::Connect4Redirected], 0, "{counters:?}");
    assert_eq!(
        counters[Counter::PeerNameRestored],
        n as u64,
        "every redirected socket's getpeername must be restored once: {counters:?}"
    );

    // The same heartbeat rule as IPv4: a stale heartbeat fails open, a fresh one resumes.
    dp.beat().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1000));
    let stale = bed.probe("client", vip6, 20).unwrap();
    assert!(
        stale.all_servers(),
        "with a stale heartbeat the IPv6 VIP must reach the pods: {stale:?}"
    );
    assert!(dp.counters().unwrap()[Counter::StaleHeartbeat] >= 20);
    // From here on the heartbeat is kept fresh, as the agent keeps it: a probe starts a process
    // in the pod, which on a busy machine takes longer than the hooks' 750 ms limit, and a stale
    // heartbeat would make the plain-L4 checks below pass whatever the map says.
    let resumed = beating(&mut dp, || bed.probe("client", vip6, 10).unwrap());
    assert!(
        resumed.only("balancer"),
        "a fresh heartbeat resumes the IPv6 redirect: {resumed:?}"
    );

    // Disabling by removal and detaching both restore plain L4.
    dp.remove_redirect(vip6).unwrap();
    let removed = beating(&mut dp, || bed.probe("client", vip6, 30).unwrap());
    assert!(
        removed.all_servers(),
        "after removing the entry the IPv6 VIP must reach the pods: {removed:?}"
    );
    dp.set_redirect(vip6, IdentBed::balancer6()).unwrap();
    let readded = beating(&mut dp, || bed.probe("client", vip6, 10).unwrap());
    assert!(
        readded.only("balancer"),
        "the re-added entry redirects again: {readded:?}"
    );
    dp.detach(attachment).unwrap();
    let detached = beating(&mut dp, || bed.probe("client", vip6, 30).unwrap());
    assert!(
        detached.all_servers(),
        "after detach the IPv6 VIP must reach the pods: {detached:?}"
    );
}

/// Runs `f` while a thread writes the heartbeat every 100 ms (the agent writes it every 200 ms).
fn beating<T>(dp: &mut Datapath, f: impl FnOnce() -> T) -> T {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dp = std::sync::Mutex::new(dp);
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                dp.lock().unwrap().beat().unwrap();
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        });
        let out = f();
        done.store(true, Ordering::Relaxed);
        out
    })
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn an_excluded_cgroup_is_never_redirected_and_the_rest_of_the_pod_is() {
    let bed = IdentBed::new().expect("testbed builds (needs root)");
    let vip = IdentBed::vip();
    let mut dp = Datapath::load().expect("eBPF programs load");
    dp.set_redirect(vip, IdentBed::balancer()).unwrap();
    let pod = bed.tb.pod("client").unwrap().cgroup.clone();
    // The agent's own cgroup, below the cgroup the hooks attach to (on Kubernetes: the
    // agent's container below kubepods).
    let own = bed
        .tb
        .child_cgroup("client", "agent")
        .expect("child cgroup");
    let _attachment = dp.attach(&pod).expect("attach to the pod cgroup");
    let id = dp.exclude_cgroup(&own).expect("exclude the child cgroup");
    assert_eq!(dp.excluded_cgroups(), [id]);

    // The same probe, run by a process that first moves itself into the excluded cgroup.
    let excluded = bed
        .probe_in("client", &own, vip, 200)
        .expect("probe from the excluded cgroup");
    assert!(
        excluded.all_servers(),
        "the excluded cgroup must reach the pods through the DNAT, never the balancer: {excluded:?}"
    );
    // The rest of the pod is still redirected.
    let redirected = bed.probe("client", vip, 200).unwrap();
    assert!(
        redirected.only("balancer"),
        "the pod's own processes must still be redirected: {redirected:?}"
    );
    let counters = dp.counters().unwrap();
    assert_eq!(counters[Counter::ConnectExcluded], 200, "{counters:?}");
    assert_eq!(counters[Counter::Connect4Redirected], 200, "{counters:?}");
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn this_process_finds_its_own_cgroup() {
    let own = skewless_datapath::own_cgroup().expect("own cgroup");
    let procs = std::fs::read_to_string(own.join("cgroup.procs")).expect("cgroup.procs");
    assert!(
        procs.lines().any(|p| p == std::process::id().to_string()),
        "{} must list this process",
        own.display()
    );
}
