//! Privileged: loads the real connect4 program into the real kernel and drives real sockets
//! through a testbed topology. Run with `cargo xtask test` (as root).

use std::net::SocketAddrV4;

use skewless_datapath::Datapath;
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
        counters.connect4_redirected, n as u64,
        "kernel counter must match: {counters:?}"
    );
    assert_eq!(
        counters.connect6_redirected, 100,
        "connect6 counter must match: {counters:?}"
    );
    assert_eq!(
        counters.peername_restored,
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
