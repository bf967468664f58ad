//! Privileged: the `sock_ops` observer on the real kernel. Client connections from an attached
//! pod are recorded, their backend is resolved (conntrack under DNAT, the peer under
//! socket-LB) and compared with ground truth: the echo server that answered names itself.
//! Every attribution case runs for IPv4 and for native IPv6 (the testbed is dual-stack: an
//! `ip6` DNAT for the Service's IPv6 VIP, IPv6 addresses on every pod).
//! Run with `cargo xtask test` (as root).

use std::{
    collections::{BTreeMap, HashSet},
    io::{BufRead as _, BufReader},
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4},
    process::Stdio,
    time::{Duration, Instant},
};

use skewless_datapath::{
    Counter, Datapath,
    conntrack::{Attributed, Conntrack, Resolver, Via, attribute},
};
use skewless_observe::{Sample, ServiceSpec, Snapshot, aggregate};
use skewless_testbed::{Place, Testbed, scripts};

const VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 20);
const PORT: u16 = 8080;
const SERVERS: [&str; 4] = ["server-0", "server-1", "server-2", "server-3"];
/// Port of the [`scripts::STREAM_SERVER`] on `server-0`.
const STREAM_PORT: u16 = 9090;

/// Which address family a case runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

/// One node; a `client` pod and four echo servers behind Service `echo` (VIP:PORT, DNAT).
fn echo_bed() -> Testbed {
    let mut tb = Testbed::builder()
        .nodes(1)
        .pod("client", 0)
        .pod(SERVERS[0], 0)
        .pod(SERVERS[1], 0)
        .pod(SERVERS[2], 0)
        .pod(SERVERS[3], 0)
        .service("echo", VIP, PORT, PORT, &SERVERS)
        .build()
        .expect("testbed builds (needs root)");
    let port = PORT.to_string();
    for s in SERVERS {
        tb.spawn(
            Place::Pod(s),
            &[
                "python3",
                scripts::ECHO_IDENT_SERVER,
                s,
                // Dual-stack: one socket answers the IPv4 and the IPv6 cases.
                "::",
                &port,
            ],
        )
        .unwrap();
    }
    for s in SERVERS {
        let ip = tb.pod(s).unwrap().ip;
        tb.wait_for_tcp(
            Place::Node(0),
            SocketAddrV4::new(ip, PORT),
            Duration::from_secs(10),
        )
        .expect("echo server comes up");
    }
    tb
}

fn vip(family: Family) -> SocketAddr {
    match family {
        Family::V4 => SocketAddr::new(VIP.into(), PORT),
        Family::V6 => SocketAddr::new(skewless_testbed::vip6(VIP).into(), PORT),
    }
}

fn pod_ip(tb: &Testbed, name: &str, family: Family) -> IpAddr {
    let pod = tb.pod(name).unwrap();
    match family {
        Family::V4 => pod.ip.into(),
        Family::V6 => pod.ip6.into(),
    }
}

fn backend_of(tb: &Testbed, name: &str, family: Family) -> SocketAddr {
    SocketAddr::new(pod_ip(tb, name, family), PORT)
}

fn spec(tb: &Testbed, family: Family) -> ServiceSpec {
    ServiceSpec {
        addr: vip(family),
        endpoints: SERVERS.iter().map(|s| backend_of(tb, s, family)).collect(),
    }
}

/// What one connection of `ECHO_TALK` reported.
#[derive(Debug)]
struct Talked {
    server: String,
    local: SocketAddr,
    /// The address connected to (a VIP under DNAT, a pod under socket-LB).
    to: SocketAddr,
    sent: u64,
    received: u64,
}

fn talk(tb: &Testbed, to: SocketAddr, n: usize, bytes: usize) -> Vec<Talked> {
    let (host, port, n_s, b) = (
        to.ip().to_string(),
        to.port().to_string(),
        n.to_string(),
        bytes.to_string(),
    );
    let out = tb
        .run(
            Place::Pod("client"),
            &["python3", scripts::ECHO_TALK, &host, &port, &n_s, &b],
        )
        .expect("talk script runs");
    let lines: Vec<Talked> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            assert!(w.len() == 4 && w[0] != "ERR", "connection failed: {l}");
            Talked {
                server: w[0].to_owned(),
                local: w[1].parse().unwrap(),
                to,
                sent: w[2].parse().unwrap(),
                received: w[3].parse().unwrap(),
            }
        })
        .collect();
    assert_eq!(lines.len(), n, "every connection must report");
    lines
}

/// Dumps the recorded connections and resolves them in the node's network namespace, as the
/// agent does (one conntrack GET per connection to a VIP), and checks the answer against a
/// dump of the whole table.
fn observe(tb: &Testbed, dp: &Datapath) -> Vec<Attributed> {
    let conns = dp.connections();
    let ct = Conntrack::in_netns(format!("/run/netns/{}", tb.node(0).netns));
    let vips: HashSet<SocketAddr> = [vip(Family::V4), vip(Family::V6)].into();
    let mut resolver = Resolver::new(ct.open().expect("conntrack socket in the node netns"));
    let resolved = resolver
        .attribute(&conns, &vips)
        .expect("conntrack lookups in the node netns");
    let table = ct.dump().expect("conntrack dump in the node netns");
    assert_eq!(
        resolved,
        attribute(&conns, &table),
        "per-connection lookups and the full dump must attribute alike"
    );
    resolved
}

fn snapshot(at: Duration, attributed: &[Attributed]) -> Snapshot {
    Snapshot {
        at,
        samples: attributed
            .iter()
            .map(|a| Sample {
                cookie: a.conn.cookie,
                remote: a.conn.remote,
                redirected_from: a.conn.redirected_from,
                backend: a.backend,
                open: a.conn.closed.is_none(),
                bytes_sent: a.conn.bytes_sent,
                bytes_received: a.conn.bytes_received,
            })
            .collect(),
    }
}

/// Checks every talked connection against its record; returns the largest relative byte error
/// per backend (sent, received).
fn check_attribution(
    tb: &Testbed,
    family: Family,
    talked: &[Talked],
    seen: &[Attributed],
    via: Via,
) -> (f64, f64) {
    let mut truth: BTreeMap<SocketAddr, (u64, u64)> = BTreeMap::new();
    let mut measured: BTreeMap<SocketAddr, (u64, u64)> = BTreeMap::new();
    for t in talked {
        let rec = seen
            .iter()
            // The full 4-tuple: a local port is reused for another destination once closed.
            .find(|a| a.conn.local == t.local && a.conn.remote == t.to)
            .unwrap_or_else(|| panic!("no record for {t:?}"));
        let want = backend_of(tb, &t.server, family);
        assert_eq!(
            rec.backend, want,
            "attributed backend must be the server that answered: {t:?} {rec:?}"
        );
        assert_eq!(rec.via, via, "resolution path: {rec:?}");
        assert!(
            rec.conn.closed.is_some(),
            "closed connection must have a close time: {rec:?}"
        );
        let e = truth.entry(want).or_default();
        e.0 += t.sent;
        e.1 += t.received;
        let m = measured.entry(want).or_default();
        m.0 += rec.conn.bytes_sent;
        m.1 += rec.conn.bytes_received;
    }
    let rel = |m: u64, t: u64| (m as f64 - t as f64).abs() / t as f64;
    let mut worst = (0.0_f64, 0.0_f64);
    for (b, (ts, tr)) in &truth {
        let (ms, mr) = measured[b];
        worst.0 = worst.0.max(rel(ms, *ts));
        worst.1 = worst.1.max(rel(mr, *tr));
        assert!(
            rel(ms, *ts) <= 0.01 && rel(mr, *tr) <= 0.01,
            "bytes to/from {b} must be within 1%: sent {ms} vs {ts}, received {mr} vs {tr}"
        );
    }
    worst
}

/// Waits until every connection the client made is recorded as closed.
fn settle(dp: &Datapath, locals: &[SocketAddr]) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        let conns = dp.connections();
        if locals
            .iter()
            .all(|l| conns.iter().any(|c| c.local == *l && c.closed.is_some()))
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Connections through the Service VIP of `family` (nftables DNAT in the node): every one is
/// resolved through conntrack to the pod that answered, with bytes within 1%.
fn dnat_case(family: Family) {
    let tb = echo_bed();
    let mut dp = Datapath::load().expect("eBPF programs load");
    let _attachment = dp.attach(&tb.pod("client").unwrap().cgroup).unwrap();
    let n = 200;
    let talked = talk(&tb, vip(family), n, 8192);
    settle(&dp, &talked.iter().map(|t| t.local).collect::<Vec<_>>());
    let seen = observe(&tb, &dp);
    let (worst_sent, worst_received) =
        check_attribution(&tb, family, &talked, &seen, Via::Conntrack);
    eprintln!(
        "DNAT {family:?}: {n}/{n} connections attributed; worst per-backend byte error: sent \
         {:.4}%, received {:.4}%",
        worst_sent * 100.0,
        worst_received * 100.0
    );

    let report = &aggregate(&[spec(&tb, family)], None, &snapshot(Duration::ZERO, &seen))[0];
    let answered: std::collections::BTreeSet<_> = talked.iter().map(|t| &t.server).collect();
    assert_eq!(report.unresolved, 0, "{report:?}");
    assert_eq!(
        report.backends_receiving,
        answered.len(),
        "every server that answered receives traffic: {report:?}"
    );
    let counters = dp.counters().unwrap();
    assert!(
        counters[Counter::ConnEstablished] >= n as u64,
        "{counters:?}"
    );
    if family == Family::V6 {
        assert!(
            counters[Counter::ConnEstablished6] >= n as u64,
            "native IPv6 connections must be counted as such: {counters:?}"
        );
    }
    assert_eq!(counters[Counter::ConnUpdateFailed], 0, "{counters:?}");
    assert_eq!(counters[Counter::ConnCbFlagsFailed], 0, "{counters:?}");
    assert_eq!(counters[Counter::ConnSkippedFamily], 0, "{counters:?}");
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn dnat_connections_are_attributed_to_the_pod_that_answered() {
    dnat_case(Family::V4);
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn ipv6_dnat_connections_are_attributed_to_the_pod_that_answered() {
    dnat_case(Family::V6);
}

/// What Cilium's socket-LB does: the socket connects straight to a backend pod (`family`
/// addresses); every connection is attributed to its peer, with bytes within 1%.
fn socket_lb_case(family: Family) {
    let tb = echo_bed();
    let mut dp = Datapath::load().expect("eBPF programs load");
    let _attachment = dp.attach(&tb.pod("client").unwrap().cgroup).unwrap();
    let mut talked = Vec::new();
    for s in SERVERS {
        talked.extend(talk(&tb, backend_of(&tb, s, family), 25, 4096));
    }
    settle(&dp, &talked.iter().map(|t| t.local).collect::<Vec<_>>());
    let seen = observe(&tb, &dp);
    let (ws, wr) = check_attribution(&tb, family, &talked, &seen, Via::Peer);
    eprintln!(
        "socket-LB {family:?}: {}/{} connections attributed; worst byte error: sent {:.4}%, \
         received {:.4}%",
        talked.len(),
        talked.len(),
        ws * 100.0,
        wr * 100.0
    );
    let report = &aggregate(&[spec(&tb, family)], None, &snapshot(Duration::ZERO, &seen))[0];
    assert_eq!(report.backends_receiving, 4, "{report:?}");
    assert!(
        report.skew < 1.5,
        "25 connections each is close to even: {report:?}"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn socket_lb_connections_are_attributed_to_their_peer() {
    socket_lb_case(Family::V4);
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn ipv6_socket_lb_connections_are_attributed_to_their_peer() {
    socket_lb_case(Family::V6);
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn one_long_lived_connection_is_flagged_as_pinned() {
    let tb = echo_bed();
    let mut dp = Datapath::load().expect("eBPF programs load");
    let _attachment = dp.attach(&tb.pod("client").unwrap().cgroup).unwrap();
    let (host, port) = (VIP.to_string(), PORT.to_string());
    let mut child = tb
        .command(
            Place::Pod("client"),
            &["python3", scripts::ECHO_STREAM, &host, &port, "4", "2048"],
        )
        .unwrap()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("stream client starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().expect("stream client reports").unwrap();
    let (server, local) = first.split_once(' ').expect("`<name> <local>`");
    let local: SocketAddr = local.parse().unwrap();
    let start = Instant::now();

    std::thread::sleep(Duration::from_millis(300));
    let before = snapshot(start.elapsed(), &observe(&tb, &dp));
    std::thread::sleep(Duration::from_secs(1));
    let seen = observe(&tb, &dp);
    let after = snapshot(start.elapsed(), &seen);
    let flagged_within = start.elapsed();
    let report = &aggregate(&[spec(&tb, Family::V4)], Some(&before), &after)[0];

    let rec = seen
        .iter()
        .find(|a| a.conn.local == local)
        .expect("recorded");
    assert_eq!(rec.backend, backend_of(&tb, server, Family::V4), "{rec:?}");
    assert!(rec.conn.closed.is_none(), "still open: {rec:?}");
    assert_eq!(
        report.backends_receiving, 1,
        "pinned to one of 4: {report:?}"
    );
    assert!((report.largest_share - 1.0).abs() < 1e-9, "{report:?}");
    assert!((report.skew - 4.0).abs() < 1e-9, "{report:?}");
    let b = &report.backends[0];
    assert!(
        b.sent_per_sec > 10_000.0 && b.received_per_sec > 10_000.0,
        "live bytes/s must be seen on an open connection: {b:?}"
    );
    eprintln!(
        "pinning: flagged {flagged_within:?} after connect; {:.0} B/s sent, {:.0} B/s received \
         to {server}",
        b.sent_per_sec, b.received_per_sec
    );

    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// [`echo_bed`] plus a [`scripts::STREAM_SERVER`] on `server-0` (both families).
fn stream_bed() -> Testbed {
    let mut tb = echo_bed();
    let port = STREAM_PORT.to_string();
    tb.spawn(
        Place::Pod(SERVERS[0]),
        &["python3", scripts::STREAM_SERVER, SERVERS[0], "::", &port],
    )
    .unwrap();
    tb.wait_for_tcp(Place::Node(0), stream_server(&tb), Duration::from_secs(10))
        .expect("stream server comes up");
    tb
}

fn stream_server(tb: &Testbed) -> SocketAddrV4 {
    SocketAddrV4::new(tb.pod(SERVERS[0]).unwrap().ip, STREAM_PORT)
}

/// Kills a child process on every exit path.
struct Reap(std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running [`scripts::DOWNLOAD`] client in the `client` pod.
struct Download {
    child: Reap,
    /// Its remaining output (the total received, once done).
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
    /// Its socket's local address.
    local: SocketAddr,
}

/// Starts a download of `secs` seconds from [`stream_server`]; returns once connected.
fn start_download(tb: &Testbed, secs: &str) -> Download {
    let server = stream_server(tb);
    let (host, port) = (server.ip().to_string(), server.port().to_string());
    let mut child = tb
        .command(
            Place::Pod("client"),
            &["python3", scripts::DOWNLOAD, &host, &port, secs],
        )
        .unwrap()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("download client starts");
    let stdout = child.stdout.take().unwrap();
    let child = Reap(child);
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().expect("download client reports").unwrap();
    let (_, local) = first.split_once(' ').expect("`<name> <local>`");
    Download {
        child,
        lines,
        local: local.parse().unwrap(),
    }
}

fn record_of(dp: &Datapath, local: SocketAddr) -> skewless_datapath::Connection {
    dp.connections()
        .into_iter()
        .find(|c| c.local == local)
        .unwrap_or_else(|| panic!("no record for {local}"))
}

/// A client that sends one small request and then only receives (server streaming) must show
/// growing received bytes while the connection is open. sock_ops alone refreshes the counters
/// on RTT samples (ACKs of the client's own data) and state changes, so without the
/// cgroup_skb ingress program the count would stand still until the close.
#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn download_only_connection_shows_growing_bytes_while_open() {
    let tb = stream_bed();
    let mut dp = Datapath::load().expect("eBPF programs load");
    let _attachment = dp.attach(&tb.pod("client").unwrap().cgroup).unwrap();
    let refreshed_before = dp.counters().unwrap()[Counter::ConnIngressRefreshed];
    let Download {
        mut child,
        mut lines,
        local,
    } = start_download(&tb, "5");
    let record = |dp: &Datapath| record_of(dp, local);

    std::thread::sleep(Duration::from_millis(500));
    let first = record(&dp);
    std::thread::sleep(Duration::from_millis(1500));
    let second = record(&dp);
    assert!(
        first.closed.is_none() && second.closed.is_none(),
        "the connection must still be open for both reads: {first:?} {second:?}"
    );
    // The server sends ~800 KB/s; 1.5 s apart the count must have moved by far more than a
    // few packets. Without per-packet refresh it does not move at all.
    let grown = second.bytes_received.saturating_sub(first.bytes_received);
    assert!(
        grown >= 100_000,
        "received bytes must grow while the connection only downloads: {} then {} ({grown} \
         in 1.5 s)",
        first.bytes_received,
        second.bytes_received
    );
    let refreshed = dp.counters().unwrap()[Counter::ConnIngressRefreshed] - refreshed_before;
    assert!(refreshed > 0, "the ingress program must have run");

    let total: u64 = lines
        .next()
        .expect("download client prints its total")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _ = child.0.wait();
    settle(&dp, &[local]);
    let last = record(&dp);
    assert!(last.closed.is_some(), "closed at the end: {last:?}");
    let err = (last.bytes_received as f64 - total as f64).abs() / total as f64;
    assert!(
        err <= 0.01,
        "final received bytes within 1% of what the client counted: {} vs {total}",
        last.bytes_received
    );
    eprintln!(
        "download-only: received bytes {} -> {} while open (+{grown} in 1.5 s, {refreshed} \
         ingress refreshes); final {} vs client {total} ({:.4}% error)",
        first.bytes_received,
        second.bytes_received,
        last.bytes_received,
        err * 100.0
    );
}

/// `Datapath::detach` removes the observers too: after it, a download that was recorded while
/// attached keeps flowing but its record is no longer refreshed (cgroup_skb ingress gone),
/// and new connections are not recorded (sock_ops gone).
#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn detach_stops_recording_and_refreshing() {
    let tb = stream_bed();
    let mut dp = Datapath::load().expect("eBPF programs load");
    let attachment = dp.attach(&tb.pod("client").unwrap().cgroup).unwrap();
    let mut download = start_download(&tb, "4");
    std::thread::sleep(Duration::from_millis(300));
    let attached = dp.counters().unwrap();
    assert!(
        attached[Counter::ConnIngressRefreshed] > 0,
        "attached: the ingress program must run: {attached:?}"
    );
    let known: std::collections::BTreeSet<u64> =
        dp.connections().iter().map(|c| c.cookie).collect();

    dp.detach(attachment).expect("detach");
    let (c1, r1) = (dp.counters().unwrap(), record_of(&dp, download.local));
    std::thread::sleep(Duration::from_secs(1));
    let (c2, r2) = (dp.counters().unwrap(), record_of(&dp, download.local));
    assert!(
        download.child.0.try_wait().unwrap().is_none(),
        "the download must still be running for the check to mean anything"
    );
    assert_eq!(
        (c2[Counter::ConnIngressRefreshed], r2.bytes_received),
        (c1[Counter::ConnIngressRefreshed], r1.bytes_received),
        "detached: the ingress program may not refresh the still-flowing download"
    );

    talk(&tb, vip(Family::V6), 10, 4096);
    let c3 = dp.counters().unwrap();
    assert_eq!(
        c3[Counter::ConnEstablished],
        c1[Counter::ConnEstablished],
        "detached: sock_ops may not run"
    );
    let new: Vec<_> = dp
        .connections()
        .into_iter()
        .filter(|c| !known.contains(&c.cookie))
        .collect();
    assert!(
        new.is_empty(),
        "detached: no new connection may be recorded: {new:?}"
    );
}
