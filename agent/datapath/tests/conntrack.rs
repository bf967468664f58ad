//! Privileged: conntrack over netlink against the real kernel, in a test network namespace
//! (a testbed node with nothing in it: the entries are made with ctnetlink, no traffic).
//! Run with `cargo xtask test` (as root).

use std::{
    collections::HashSet,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    time::Duration,
};

use skewless_datapath::{
    Connection,
    conntrack::{Conntrack, Entry, Resolver, Via},
};
use skewless_testbed::Testbed;

const VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(198, 19, 0, 30), 8080);

fn bed() -> (Testbed, Conntrack) {
    let tb = Testbed::builder()
        .nodes(1)
        .build()
        .expect("testbed builds (needs root)");
    let ct = Conntrack::in_netns(format!("/run/netns/{}", tb.node(0).netns));
    (tb, ct)
}

/// Client `i`'s connection to the VIP, DNATed to one of four backends.
fn entry(i: u32) -> Entry {
    let client = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + (i >> 14) + 1);
    let port = 10_000 + u16::try_from(i & 0x3fff).unwrap();
    Entry {
        src: SocketAddr::new(client.into(), port),
        dst: VIP.into(),
        reply_src: SocketAddr::new(
            Ipv4Addr::new(198, 18, 200, u8::try_from(i % 4).unwrap() + 2).into(),
            8080,
        ),
    }
}

fn conn(cookie: u64, e: &Entry) -> Connection {
    Connection {
        cookie,
        local: e.src,
        remote: e.dst,
        redirected_from: None,
        state: 1,
        opened: Duration::ZERO,
        closed: None,
        bytes_sent: 0,
        bytes_received: 0,
    }
}

#[test]
#[ignore = "privileged: network namespace and ctnetlink (run as root via cargo xtask test)"]
fn lookups_find_dnat_entries_among_many_and_miss_absent_ones() {
    let (_tb, ct) = bed();
    let mut session = ct.open().expect("ctnetlink socket in the node netns");
    let entries: Vec<Entry> = (0..20_000).map(entry).collect();
    session
        .create(&entries, Duration::from_secs(120))
        .expect("creating 20,000 entries");
    let table = session.dump().expect("dump");
    assert_eq!(table.len(), entries.len(), "the dump must hold every entry");
    for e in entries.iter().step_by(997) {
        assert_eq!(table.reply_source(e.src, e.dst), Some(e.reply_src));
    }

    // Every 7th connection asked about, plus 300 that have no entry.
    let mut asked: Vec<(SocketAddr, SocketAddr)> =
        entries.iter().step_by(7).map(|e| (e.src, e.dst)).collect();
    let absent: Vec<(SocketAddr, SocketAddr)> = (0..300)
        .map(|i| {
            let e = entry(100_000 + i);
            (e.src, e.dst)
        })
        .collect();
    asked.extend(&absent);
    let got = session.lookup(&asked).expect("lookups");
    assert_eq!(got.len(), asked.len());
    for (i, e) in entries.iter().step_by(7).enumerate() {
        assert_eq!(got[i], Some(e.reply_src), "lookup {i} must find {e:?}");
    }
    assert!(
        got[got.len() - absent.len()..].iter().all(Option::is_none),
        "tuples without an entry must come back empty"
    );
}

#[test]
#[ignore = "privileged: network namespace and ctnetlink (run as root via cargo xtask test)"]
fn the_resolver_asks_about_each_vip_connection_once() {
    let (tb, ct) = bed();
    let entries: Vec<Entry> = (0..1_000).map(entry).collect();
    ct.open()
        .unwrap()
        .create(&entries, Duration::from_secs(120))
        .unwrap();
    let vips: HashSet<SocketAddr> = [SocketAddr::from(VIP)].into();
    let mut conns: Vec<Connection> = entries
        .iter()
        .enumerate()
        .map(|(i, e)| conn(i as u64, e))
        .collect();
    // A socket-LB connection straight to a pod: its peer, never looked up.
    let direct = Entry {
        src: "198.18.9.9:5000".parse().unwrap(),
        dst: "198.18.200.2:8080".parse().unwrap(),
        reply_src: "198.18.200.2:8080".parse().unwrap(),
    };
    conns.push(conn(5_000, &direct));
    let mut resolver = Resolver::new(ct.open().unwrap());
    let first = resolver.attribute(&conns, &vips).expect("first cycle");
    assert_eq!(
        resolver.known(),
        entries.len(),
        "one answer per VIP connection"
    );
    for (a, e) in first.iter().zip(&entries) {
        assert_eq!((a.backend, a.via), (e.reply_src, Via::Conntrack));
    }
    assert_eq!(
        (first[entries.len()].backend, first[entries.len()].via),
        (direct.dst, Via::Peer)
    );

    // The entries go; the kept answers still resolve the same sockets, and the sockets that
    // are gone from the dump are forgotten.
    let mut flush = std::process::Command::new("nsenter");
    flush.args([
        &format!("--net=/run/netns/{}", tb.node(0).netns),
        "conntrack",
        "-F",
    ]);
    let status = flush.output().expect("conntrack -F runs");
    assert!(status.status.success(), "{status:?}");
    assert!(ct.dump().unwrap().is_empty(), "the table must be empty now");
    conns.truncate(500);
    let second = resolver.attribute(&conns, &vips).expect("second cycle");
    assert_eq!(&second[..], &first[..500], "kept answers must not change");
    assert_eq!(
        resolver.known(),
        500,
        "closed-and-gone sockets are forgotten"
    );
}
