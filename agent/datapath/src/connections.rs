//! The connection records the `sock_ops` and `conn_ingress` programs keep: every client TCP
//! connection of an attached cgroup, as its socket sees it.

use std::{
    net::{SocketAddr, SocketAddrV4, SocketAddrV6},
    time::Duration,
};

use aya::maps::MapError;
use skewless_common::{CONNS_MAP, Conn, FAMILY_INET6};

use crate::{
    Datapath, Error,
    wire::{ip4_from_wire, ip6_from_wire},
};

/// One client TCP connection from an attached cgroup, as its socket sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Connection {
    /// The socket cookie: unique per socket for the kernel's uptime.
    pub cookie: u64,
    /// The pod's address and port (IPv4 also for a dual-stack socket talking to an
    /// IPv4-mapped address).
    pub local: SocketAddr,
    /// The address the socket is connected to: the Service VIP under DNAT, the backend pod
    /// under socket-level load balancing, the balancer's listener when redirected.
    pub remote: SocketAddr,
    /// The Service address a redirected socket asked for; `None` when not redirected.
    pub redirected_from: Option<SocketAddr>,
    /// Last TCP state seen (`BPF_TCP_*`: 1 established, 7 close).
    pub state: u32,
    /// CLOCK_MONOTONIC time the connection was established.
    pub opened: Duration,
    /// CLOCK_MONOTONIC time it closed; `None` while open.
    pub closed: Option<Duration>,
    /// Bytes the client sent that the peer acknowledged (refreshed on every RTT sample,
    /// state change and received packet; final once closed).
    pub bytes_sent: u64,
    /// Bytes the client received (refreshed like `bytes_sent`).
    pub bytes_received: u64,
}

impl Connection {
    /// A record as the programs write it: addresses in network order (IPv4 in word 0),
    /// ports in host order.
    fn from_record(cookie: u64, c: &Conn) -> Self {
        let v6 = c.family == FAMILY_INET6;
        let addr = |words: [u32; 4], port: u16| -> SocketAddr {
            if v6 {
                SocketAddr::V6(SocketAddrV6::new(ip6_from_wire(words), port, 0, 0))
            } else {
                SocketAddr::V4(SocketAddrV4::new(ip4_from_wire(words[0]), port))
            }
        };
        Self {
            cookie,
            local: addr(c.local_addr, c.local_port),
            remote: addr(c.remote_addr, c.remote_port),
            redirected_from: (c.orig_addr != [0; 4] || c.orig_port != 0)
                .then(|| addr(c.orig_addr, c.orig_port)),
            state: c.state,
            opened: Duration::from_nanos(c.opened_ns),
            closed: (c.closed_ns != 0).then(|| Duration::from_nanos(c.closed_ns)),
            bytes_sent: c.bytes_acked,
            bytes_received: c.bytes_received,
        }
    }
}

impl Datapath {
    /// The client connections recorded by the `sock_ops` program: open ones and closed ones
    /// the LRU map has not evicted yet (closed records stay until [`Datapath::forget`] or
    /// eviction, so a dump after a close still sees the final byte counts).
    ///
    /// Entries that disappear while the map is walked are skipped, so a dump is a best-effort
    /// snapshot, never an error.
    #[must_use]
    pub fn connections(&self) -> Vec<Connection> {
        self.conns
            .iter()
            .filter_map(Result::ok)
            .map(|(cookie, c)| Connection::from_record(cookie, &c))
            .collect()
    }

    /// Removes a connection record (for example a closed one the observer has accounted
    /// for). Removing an unknown cookie is not an error.
    ///
    /// # Errors
    /// When the kernel refuses the deletion for another reason than a missing key.
    pub fn forget(&mut self, cookie: u64) -> Result<(), Error> {
        match self.conns.remove(&cookie) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(source) => Err(Error::Map {
                name: CONNS_MAP,
                source,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use skewless_common::FAMILY_INET;

    use super::*;
    use crate::wire::ip6_to_wire;

    fn record(family: u32, local: [u32; 4], remote: [u32; 4], orig: [u32; 4]) -> Conn {
        Conn {
            local_addr: local,
            remote_addr: remote,
            orig_addr: orig,
            family,
            state: 1,
            local_port: 40000,
            remote_port: 8080,
            orig_port: if orig == [0; 4] { 0 } else { 50051 },
            _pad: 0,
            opened_ns: 1,
            closed_ns: 0,
            bytes_acked: 10,
            bytes_received: 20,
        }
    }

    #[test]
    fn records_of_both_families_become_socket_addresses() {
        let v4 = |a: &str| u32::from(a.parse::<Ipv4Addr>().unwrap()).to_be();
        let c = Connection::from_record(
            7,
            &record(
                FAMILY_INET,
                [v4("198.18.1.2"), 0, 0, 0],
                [v4("198.19.0.10"), 0, 0, 0],
                [0; 4],
            ),
        );
        assert_eq!(c.local, "198.18.1.2:40000".parse().unwrap());
        assert_eq!(c.remote, "198.19.0.10:8080".parse().unwrap());
        assert_eq!(c.redirected_from, None, "all-zero origin: not redirected");

        let v6 = |a: &str| ip6_to_wire(a.parse().unwrap());
        let c = Connection::from_record(
            8,
            &record(
                FAMILY_INET6,
                v6("fd00:198:18:1::2"),
                v6("fd00:169:254::1"),
                v6("fd00:198:19::c613:a"),
            ),
        );
        assert_eq!(c.local, "[fd00:198:18:1::2]:40000".parse().unwrap());
        assert_eq!(c.remote, "[fd00:169:254::1]:8080".parse().unwrap());
        assert_eq!(
            c.redirected_from,
            Some("[fd00:198:19::c613:a]:50051".parse().unwrap()),
            "a redirected IPv6 socket keeps its Service address"
        );
        assert_eq!((c.bytes_sent, c.bytes_received), (10, 20));
    }
}
