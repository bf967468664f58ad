//! Resolves the backend a client connection is pinned to.
//!
//! Under kube-proxy-style DNAT the client's socket only ever sees the Service VIP; the node's
//! conntrack table knows where the connection really went: the entry whose original tuple is
//! the socket's own (pod ip:port -> VIP:port) has a reply tuple whose source is the backend.
//! The exact 4-tuple is the join key. Under socket-level load balancing (the socket connects
//! straight to a pod) or without NAT, the backend is the socket's own peer.
//!
//! The table is read with Debian's `conntrack` tool (`conntrack -L -f ipv4|ipv6 -p tcp -o
//! extended`, one run per family: the tool lists IPv4 only unless told), inside the network
//! namespace where the DNAT happens (the node's: where the agent runs). IPv6 Services under an
//! `ip6` DNAT resolve exactly like IPv4 ones.
//! Conntrack keeps entries about two minutes after a close (TIME_WAIT), so a dump taken soon
//! after a connection ends still resolves it.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    process::Command,
};

use crate::Connection;

/// Errors from reading the conntrack table.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("running `{cmd}`")]
    Spawn {
        cmd: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Failed {
        cmd: String,
        status: String,
        stderr: String,
    },
}

/// Where to read conntrack from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Conntrack {
    netns: Option<PathBuf>,
}

impl Conntrack {
    /// The network namespace of the calling process (the agent runs in the node's).
    #[must_use]
    pub fn here() -> Self {
        Self { netns: None }
    }

    /// Another network namespace, given as a path such as `/run/netns/<name>` (entered with
    /// `nsenter --net`; needs CAP_SYS_ADMIN).
    #[must_use]
    pub fn in_netns(path: impl Into<PathBuf>) -> Self {
        Self {
            netns: Some(path.into()),
        }
    }

    /// Dumps the TCP entries of the table, IPv4 and IPv6.
    ///
    /// # Errors
    /// When the tool cannot run or fails (no privileges, no conntrack support).
    pub fn dump(&self) -> Result<NatTable, Error> {
        let mut table = self.dump_family("ipv4")?;
        table
            .by_original
            .extend(self.dump_family("ipv6")?.by_original);
        Ok(table)
    }

    fn dump_family(&self, family: &str) -> Result<NatTable, Error> {
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net={}", ns.display()))
                    .arg("--")
                    .arg("conntrack");
                c
            }
            None => Command::new("conntrack"),
        };
        cmd.args(["-L", "-f", family, "-p", "tcp", "-o", "extended"]);
        let out = cmd.output().map_err(|source| Error::Spawn {
            cmd: format!("{cmd:?}"),
            source,
        })?;
        if !out.status.success() {
            return Err(Error::Failed {
                cmd: format!("{cmd:?}"),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        Ok(NatTable::parse(&String::from_utf8_lossy(&out.stdout)))
    }
}

/// The TCP conntrack entries of one dump: original (source, destination) -> reply source.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NatTable {
    by_original: HashMap<(SocketAddr, SocketAddr), SocketAddr>,
}

impl NatTable {
    /// Parses `conntrack -L -o extended` output. Lines that are not IPv4 or IPv6 TCP entries
    /// with both tuples are skipped.
    #[must_use]
    pub fn parse(text: &str) -> Self {
        let by_original = text.lines().filter_map(parse_line).collect();
        Self { by_original }
    }

    /// The reply tuple's source for the connection whose original tuple is `src -> dst`:
    /// the backend when `dst` was DNATed.
    #[must_use]
    pub fn reply_source(&self, src: SocketAddr, dst: SocketAddr) -> Option<SocketAddr> {
        self.by_original.get(&(src, dst)).copied()
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.by_original.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.by_original.is_empty()
    }
}

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

/// Resolves the backend of every connection against one conntrack dump.
///
/// A connection without a conntrack entry is attributed to its peer: the caller, who knows
/// the Service VIPs, must treat a "backend" equal to a VIP as unresolved.
#[must_use]
pub fn attribute(conns: &[Connection], table: &NatTable) -> Vec<Attributed> {
    conns
        .iter()
        .map(|conn| match table.reply_source(conn.local, conn.remote) {
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
        })
        .collect()
}

/// `ipv4 2 tcp 6 117 TIME_WAIT src=A dst=B sport=P dport=Q [UNREPLIED] src=C dst=D sport=R
/// dport=S [ASSURED] mark=0 use=1` -> ((A:P, B:Q), C:R); the same for `ipv6 10 tcp ...`.
fn parse_line(line: &str) -> Option<((SocketAddr, SocketAddr), SocketAddr)> {
    let mut words = line.split_whitespace();
    let v6 = match words.next()? {
        "ipv4" => false,
        "ipv6" => true,
        _ => return None,
    };
    if words.nth(1)? != "tcp" {
        return None;
    }
    // The first src/dst/sport/dport group is the original tuple, the second the reply.
    let mut fields: [Option<&str>; 8] = [None; 8];
    let mut group = 0;
    for word in words {
        let Some((key, value)) = word.split_once('=') else {
            continue;
        };
        let slot = match key {
            "src" => 0,
            "dst" => 1,
            "sport" => 2,
            "dport" => 3,
            _ => continue,
        };
        if fields[group * 4 + slot].is_some() {
            group += 1;
            if group > 1 {
                break;
            }
        }
        fields[group * 4 + slot] = Some(value);
    }
    let addr = |ip: Option<&str>, port: Option<&str>| -> Option<SocketAddr> {
        let ip: IpAddr = ip?.parse().ok()?;
        (ip.is_ipv6() == v6).then_some(())?;
        Some(SocketAddr::new(ip, port?.parse().ok()?))
    };
    let src = addr(fields[0], fields[2])?;
    let dst = addr(fields[1], fields[3])?;
    let reply_src = addr(fields[4], fields[6])?;
    Some(((src, dst), reply_src))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const DUMP: &str = "\
ipv4     2 tcp      6 117 TIME_WAIT src=198.18.1.2 dst=198.19.0.10 sport=40000 dport=8080 src=198.18.3.2 dst=198.18.1.2 sport=8080 dport=40000 [ASSURED] mark=0 use=1
ipv4     2 tcp      6 431999 ESTABLISHED src=198.18.1.2 dst=198.18.4.2 sport=40001 dport=8080 src=198.18.4.2 dst=198.18.1.2 sport=8080 dport=40001 [ASSURED] mark=0 use=1
ipv4     2 tcp      6 119 SYN_SENT src=198.18.1.2 dst=198.19.0.10 sport=40002 dport=8080 [UNREPLIED] src=198.18.5.2 dst=198.18.1.2 sport=8080 dport=40002 mark=0 use=1
ipv6     10 tcp      6 117 TIME_WAIT src=fd00:198:18:1::2 dst=fd00:198:19::c613:a sport=40000 dport=8080 src=fd00:198:18:3::2 dst=fd00:198:18:1::2 sport=8080 dport=40000 [ASSURED] mark=0 use=1
ipv6     10 udp      17 29 src=::1 dst=::1 sport=1 dport=2 src=::1 dst=::1 sport=2 dport=1 mark=0 use=1
garbage line
";

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
    fn parses_original_and_reply_tuples_and_skips_the_rest() {
        let t = NatTable::parse(DUMP);
        assert_eq!(t.len(), 4, "three IPv4 and one IPv6 TCP entries: {t:?}");
        assert_eq!(
            t.reply_source(
                "198.18.1.2:40000".parse().unwrap(),
                "198.19.0.10:8080".parse().unwrap()
            ),
            Some("198.18.3.2:8080".parse().unwrap())
        );
        assert_eq!(
            t.reply_source(
                "198.18.1.2:40002".parse().unwrap(),
                "198.19.0.10:8080".parse().unwrap()
            ),
            Some("198.18.5.2:8080".parse().unwrap()),
            "[UNREPLIED] between the tuples must not confuse the parser"
        );
        assert_eq!(
            t.reply_source(
                "[fd00:198:18:1::2]:40000".parse().unwrap(),
                "[fd00:198:19::c613:a]:8080".parse().unwrap()
            ),
            Some("[fd00:198:18:3::2]:8080".parse().unwrap()),
            "IPv6 DNAT entries resolve like IPv4 ones"
        );
    }

    #[test]
    fn dnat_resolves_through_conntrack_and_direct_is_the_peer() {
        let t = NatTable::parse(DUMP);
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

    #[test]
    fn the_join_key_is_the_exact_tuple() {
        let t = NatTable::parse(DUMP);
        // Same client port, other VIP port: not the same connection.
        assert_eq!(
            t.reply_source(
                "198.18.1.2:40000".parse().unwrap(),
                "198.19.0.10:9090".parse().unwrap()
            ),
            None
        );
    }
}
