//! Resolves the backend a client connection is pinned to.
//!
//! Under kube-proxy-style DNAT the client's socket only ever sees the Service VIP; the node's
//! conntrack table knows where the connection really went: the entry whose original tuple is
//! the socket's own (pod ip:port -> VIP:port) has a reply tuple whose source is the backend.
//! The exact 4-tuple is the join key. Under socket-level load balancing (the socket connects
//! straight to a pod) or without NAT, the backend is the socket's own peer.
//!
//! The table is read over ctnetlink (`skewless-conntrack`, re-exported here), inside the
//! network namespace where the DNAT happens (the node's: where the agent runs). IPv6 Services
//! under an `ip6` DNAT resolve exactly like IPv4 ones. Two ways in:
//! - [`Resolver`], what the agent uses: one conntrack GET per connection to a Service VIP,
//!   sent in batches, and only once per socket (a connection's backend never changes, so the
//!   answer is kept by socket cookie until the record goes). Its cost follows the connections
//!   opened since the last cycle, not the size of the table: a busy kube-proxy node holds
//!   100,000 entries, and dumping them every cycle (what running `conntrack -L` did) was most
//!   of the agent's CPU.
//! - [`Session::dump`] and [`attribute`]: the whole table (tests, debugging).
//!
//! Conntrack keeps entries about two minutes after a close (TIME_WAIT), so a lookup soon
//! after a connection ends still resolves it.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
};

pub use skewless_conntrack::{Conntrack, Entry, Error, NatTable, Reply, Session, decode};

use crate::Connection;

/// How a connection's backend was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Via {
    /// From the conntrack entry of the socket's 4-tuple, whose reply came from another
    /// address than the socket's peer (DNAT).
    Conntrack,
    /// The socket's own peer (socket-level load balancing, no NAT, or no conntrack entry).
    Peer,
}

/// A connection and the backend it is pinned to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attributed {
    pub conn: Connection,
    pub backend: SocketAddr,
    pub via: Via,
}

fn attributed(conn: &Connection, reply_src: Option<SocketAddr>) -> Attributed {
    match reply_src {
        Some(backend) if backend != conn.remote => Attributed {
            conn: *conn,
            backend,
            via: Via::Conntrack,
        },
        _ => Attributed {
            conn: *conn,
            backend: conn.remote,
            via: Via::Peer,
        },
    }
}

/// Resolves the backend of every connection against one conntrack dump.
///
/// A connection without a conntrack entry is attributed to its peer: the caller, who knows
/// the Service VIPs, must treat a "backend" equal to a VIP as unresolved.
#[must_use]
pub fn attribute(conns: &[Connection], table: &NatTable) -> Vec<Attributed> {
    conns
        .iter()
        .map(|conn| attributed(conn, table.reply_source(conn.local, conn.remote)))
        .collect()
}

/// Resolves connections cycle after cycle, asking conntrack only about what it has not seen.
///
/// Only a connection whose peer is a Service VIP can be hidden by a DNAT, so only those are
/// looked up (a socket-LB connection, a redirected one, or any other is its peer's). The
/// answer, found or not, is kept per socket cookie for as long as the connection is in the
/// dump: a socket's conntrack entry is made with its SYN and never changes its reply source,
/// so asking again would only cost.
#[derive(Debug)]
pub struct Resolver {
    session: Session,
    known: HashMap<u64, Option<SocketAddr>>,
}

impl Resolver {
    #[must_use]
    pub fn new(session: Session) -> Self {
        Self {
            session,
            known: HashMap::new(),
        }
    }

    /// Attributes every connection; `vips` are the Service addresses that may be DNATed.
    ///
    /// # Errors
    /// When conntrack cannot be asked; nothing is kept from that cycle then.
    pub fn attribute(
        &mut self,
        conns: &[Connection],
        vips: &HashSet<SocketAddr>,
    ) -> Result<Vec<Attributed>, Error> {
        let live: HashSet<u64> = conns.iter().map(|c| c.cookie).collect();
        self.known.retain(|cookie, _| live.contains(cookie));
        let ask: Vec<&Connection> = conns
            .iter()
            .filter(|c| vips.contains(&c.remote) && !self.known.contains_key(&c.cookie))
            .collect();
        let tuples: Vec<(SocketAddr, SocketAddr)> =
            ask.iter().map(|c| (c.local, c.remote)).collect();
        let answers = self.session.lookup(&tuples)?;
        for (c, answer) in ask.iter().zip(answers) {
            self.known.insert(c.cookie, answer);
        }
        Ok(conns
            .iter()
            .map(|c| attributed(c, self.known.get(&c.cookie).copied().flatten()))
            .collect())
    }

    /// Connections whose answer is kept.
    #[must_use]
    pub fn known(&self) -> usize {
        self.known.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn entry(src: &str, dst: &str, reply_src: &str) -> Entry {
        Entry {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            reply_src: reply_src.parse().unwrap(),
        }
    }

    fn conn(local: &str, remote: &str) -> Connection {
        Connection {
            cookie: 1,
            local: local.parse().unwrap(),
            remote: remote.parse().unwrap(),
            redirected_from: None,
            state: 1,
            opened: Duration::ZERO,
            closed: None,
            bytes_sent: 0,
            bytes_received: 0,
        }
    }

    #[test]
    fn dnat_resolves_through_conntrack_and_direct_is_the_peer() {
        let t = NatTable::from_entries([
            entry("198.18.1.2:40000", "198.19.0.10:8080", "198.18.3.2:8080"),
            entry("198.18.1.2:40001", "198.18.4.2:8080", "198.18.4.2:8080"),
            entry(
                "[fd00:198:18:1::2]:40000",
                "[fd00:198:19::c613:a]:8080",
                "[fd00:198:18:3::2]:8080",
            ),
        ]);
        let got = attribute(
            &[
                conn("198.18.1.2:40000", "198.19.0.10:8080"),
                conn("198.18.1.2:40001", "198.18.4.2:8080"),
                conn("198.18.1.2:49999", "198.18.6.2:8080"),
                conn("[fd00:198:18:1::2]:40000", "[fd00:198:19::c613:a]:8080"),
                conn("[fd00:198:18:1::2]:40001", "[fd00:198:18:6::2]:8080"),
            ],
            &t,
        );
        let summary: Vec<_> = got.iter().map(|a| (a.backend.to_string(), a.via)).collect();
        assert_eq!(
            summary,
            [
                ("198.18.3.2:8080".to_owned(), Via::Conntrack),
                ("198.18.4.2:8080".to_owned(), Via::Peer),
                ("198.18.6.2:8080".to_owned(), Via::Peer),
                ("[fd00:198:18:3::2]:8080".to_owned(), Via::Conntrack),
                ("[fd00:198:18:6::2]:8080".to_owned(), Via::Peer),
            ]
        );
    }
}
