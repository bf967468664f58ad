//! Privileged: loads the real connect4 program into the real kernel and drives real sockets
//! through a testbed topology. Run with `cargo xtask test` (as root).

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use skewless_datapath::Datapath;
use skewless_testbed::{BALANCER_IP, Place, Testbed, scripts};

const VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const OTHER_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 11);
const PORT: u16 = 8080;
const OTHER_PORT: u16 = 9090;
const BALANCER_PORT: u16 = 15001;
const SERVERS: [&str; 3] = ["server-0", "server-1", "server-2"];

struct Bed {
    tb: Testbed,
}

impl Bed {
    fn new() -> Self {
        let mut tb = Testbed::builder()
            .nodes(1)
            .pod("client", 0)
            .pod("bystander", 0)
            .pod(SERVERS[0], 0)
            .pod(SERVERS[1], 0)
            .pod(SERVERS[2], 0)
            .service("echo", VIP, PORT, PORT, &SERVERS)
            .service("echo-admin", VIP, OTHER_PORT, OTHER_PORT, &SERVERS)
            .service("other", OTHER_VIP, PORT, PORT, &SERVERS)
            .build()
            .expect("testbed builds (needs root)");
        for s in SERVERS {
            tb.spawn(
                Place::Pod(s),
                &[
                    "python3",
                    "-c",
                    scripts::IDENT_SERVER,
                    s,
                    "0.0.0.0",
                    &PORT.to_string(),
                    &OTHER_PORT.to_string(),
                ],
            )
            .expect("server starts");
        }
        tb.spawn(
            Place::Node(0),
            &[
                "python3",
                "-c",
                scripts::IDENT_SERVER,
                "balancer",
                &BALANCER_IP.to_string(),
                &BALANCER_PORT.to_string(),
            ],
        )
        .expect("balancer stand-in starts");
        for s in SERVERS {
            let ip = tb.pod(s).unwrap().ip;
            tb.wait_for_tcp(
                Place::Node(0),
                SocketAddrV4::new(ip, PORT),
                Duration::from_secs(10),
            )
            .unwrap();
            tb.wait_for_tcp(
                Place::Node(0),
                SocketAddrV4::new(ip, OTHER_PORT),
                Duration::from_secs(10),
            )
            .unwrap();
        }
        tb.wait_for_tcp(
            Place::Node(0),
            SocketAddrV4::new(BALANCER_IP, BALANCER_PORT),
            Duration::from_secs(10),
        )
        .unwrap();
        Self { tb }
    }

    /// Opens `n` connections from `pod` to `addr` and tallies who answered.
    fn probe(&self, pod: &str, addr: SocketAddrV4, n: usize) -> BTreeMap<String, usize> {
        let out = self
            .tb
            .run(
                Place::Pod(pod),
                &[
                    "python3",
                    "-c",
                    scripts::PROBE,
                    &addr.ip().to_string(),
                    &addr.port().to_string(),
                    &n.to_string(),
                ],
            )
            .expect("probe runs");
        let mut tally = BTreeMap::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let who = line.split_whitespace().next().unwrap_or("EMPTY").to_owned();
            *tally.entry(who).or_default() += 1;
        }
        assert_eq!(
            tally.values().sum::<usize>(),
            n,
            "every probe must report: {tally:?}"
        );
        tally
    }
}

fn only(tally: &BTreeMap<String, usize>, who: &str, n: usize) -> bool {
    tally.len() == 1 && tally.get(who) == Some(&n)
}

fn all_servers(tally: &BTreeMap<String, usize>) -> bool {
    tally.keys().all(|k| SERVERS.contains(&k.as_str()))
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connect_to_listed_vip_port_is_redirected_and_nothing_else_is() {
    let bed = Bed::new();
    let vip = SocketAddrV4::new(VIP, PORT);
    let balancer = SocketAddrV4::new(BALANCER_IP, BALANCER_PORT);
    let mut dp = Datapath::load().expect("eBPF programs load");
    dp.set_redirect(vip, balancer).unwrap();

    // Control: with the map filled but the program not attached, the VIP reaches the pods.
    // This is what proves the assertions below measure the hook and nothing else.
    let before = bed.probe("client", vip, 60);
    assert!(
        all_servers(&before),
        "unattached: VIP must reach the pods, got {before:?}"
    );
    assert!(
        before.len() > 1,
        "kube-proxy-style DNAT must spread connections, got {before:?}"
    );

    let attachment = dp
        .attach(&bed.tb.pod("client").unwrap().cgroup)
        .expect("attach to the client cgroup");
    let n = 200;
    let redirected = bed.probe("client", vip, n);
    assert!(
        only(&redirected, "balancer", n),
        "every connect to the listed VIP:port must reach the balancer, got {redirected:?}"
    );

    // Untouched: same VIP other port, another VIP, a pod IP, and a pod without the hook.
    let other_port = bed.probe("client", SocketAddrV4::new(VIP, OTHER_PORT), 50);
    assert!(
        all_servers(&other_port),
        "other port of the VIP must not be redirected: {other_port:?}"
    );
    let other_vip = bed.probe("client", SocketAddrV4::new(OTHER_VIP, PORT), 50);
    assert!(
        all_servers(&other_vip),
        "non-listed VIP must not be redirected: {other_vip:?}"
    );
    let pod_ip = SocketAddrV4::new(bed.tb.pod(SERVERS[1]).unwrap().ip, PORT);
    let direct = bed.probe("client", pod_ip, 20);
    assert!(
        only(&direct, SERVERS[1], 20),
        "pod IP must be reached directly: {direct:?}"
    );
    let bystander = bed.probe("bystander", vip, 50);
    assert!(
        all_servers(&bystander),
        "a cgroup without the hook must not be redirected: {bystander:?}"
    );

    let counters = dp.counters().unwrap();
    assert_eq!(
        counters.connect4_redirected, n as u64,
        "kernel counter must match: {counters:?}"
    );

    // Removing the map entry sends the next connect through the DNAT again.
    dp.remove_redirect(vip).unwrap();
    let removed = bed.probe("client", vip, 30);
    assert!(
        all_servers(&removed),
        "after removing the entry the VIP must reach the pods: {removed:?}"
    );

    // Detaching restores plain L4 even with the entry present.
    dp.set_redirect(vip, balancer).unwrap();
    assert!(only(&bed.probe("client", vip, 10), "balancer", 10));
    dp.detach(attachment).unwrap();
    let detached = bed.probe("client", vip, 30);
    assert!(
        all_servers(&detached),
        "after detach the VIP must reach the pods: {detached:?}"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn dropping_the_datapath_detaches_everything() {
    let bed = Bed::new();
    let vip = SocketAddrV4::new(VIP, PORT);
    let mut dp = Datapath::load().expect("eBPF programs load");
    dp.set_redirect(vip, SocketAddrV4::new(BALANCER_IP, BALANCER_PORT))
        .unwrap();
    let _attachment = dp.attach(&bed.tb.pod("client").unwrap().cgroup).unwrap();
    assert!(only(&bed.probe("client", vip, 10), "balancer", 10));
    // What happens when the agent exits or is killed: bpf_links close with the process.
    drop(dp);
    let after = bed.probe("client", vip, 30);
    assert!(
        all_servers(&after),
        "with the datapath gone, connects must go direct: {after:?}"
    );
}
