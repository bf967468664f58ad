//! Which peers may use the node balancer: this node's pods only.
//!
//! The balancer's address is node-local, but link-local is not a security boundary (another
//! node with a route to it reaches it), so the balancer also checks every accepted peer
//! against this node's pod CIDRs and closes anything else before speaking HTTP/2.

use std::{
    net::{IpAddr, SocketAddr},
    str::FromStr,
    sync::{
        RwLock,
        atomic::{AtomicU64, Ordering},
    },
};

/// An IP network, `addr/prefix`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    #[must_use]
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            IpAddr::V4(v4) => IpAddr::V4(v4),
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// Why a string is not a [`Cidr`].
#[derive(Debug, thiserror::Error)]
pub enum CidrError {
    #[error("{input:?} is not ADDR/PREFIX")]
    NoPrefix { input: String },
    #[error("{input:?}: the address is not an IPv4 or IPv6 address")]
    Addr {
        input: String,
        #[source]
        source: std::net::AddrParseError,
    },
    #[error("{input:?}: the prefix length is not a number from 0 to 128")]
    Prefix {
        input: String,
        #[source]
        source: std::num::ParseIntError,
    },
    #[error("{input:?}: prefix longer than {max}")]
    PrefixTooLong { input: String, max: u8 },
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let input = || s.to_owned();
        let (addr, prefix) = s
            .split_once('/')
            .ok_or_else(|| CidrError::NoPrefix { input: input() })?;
        let addr: IpAddr = addr.parse().map_err(|source| CidrError::Addr {
            input: input(),
            source,
        })?;
        let prefix: u8 = prefix.parse().map_err(|source| CidrError::Prefix {
            input: input(),
            source,
        })?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(CidrError::PrefixTooLong {
                input: input(),
                max,
            });
        }
        Ok(Self { addr, prefix })
    }
}

/// The admission check shared by every balancer of the agent.
#[derive(Debug, Default)]
pub struct PeerFilter {
    cidrs: RwLock<Vec<Cidr>>,
    refused: AtomicU64,
}

impl PeerFilter {
    pub fn new(cidrs: Vec<Cidr>) -> Self {
        Self {
            cidrs: RwLock::new(cidrs),
            refused: AtomicU64::new(0),
        }
    }

    /// Replaces the allowed networks (the Node's podCIDRs changed).
    pub fn set(&self, cidrs: Vec<Cidr>) {
        if let Ok(mut c) = self.cidrs.write() {
            *c = cidrs;
        }
    }

    /// Whether `peer` may use the balancer. With no networks configured every peer is
    /// admitted (the agent warns about that at startup). Refusals are counted.
    pub fn admit(&self, peer: SocketAddr) -> bool {
        let ok = self
            .cidrs
            .read()
            .map(|c| c.is_empty() || c.iter().any(|n| n.contains(peer.ip())))
            .unwrap_or(false);
        if !ok {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(ip: &str) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), 40000)
    }

    #[test]
    fn cidr_parses_and_matches() {
        let net: Cidr = "198.18.1.0/24".parse().unwrap();
        assert!(net.contains("198.18.1.2".parse().unwrap()));
        assert!(!net.contains("198.18.2.2".parse().unwrap()));
        assert!(
            net.contains("::ffff:198.18.1.9".parse().unwrap()),
            "IPv4-mapped peers are IPv4"
        );
        assert!(matches!(
            "198.18.1.0/33".parse::<Cidr>(),
            Err(CidrError::PrefixTooLong { max: 32, .. })
        ));
        assert!(matches!(
            "198.18.1.0".parse::<Cidr>(),
            Err(CidrError::NoPrefix { .. })
        ));
        assert!(matches!(
            "198.18.1/24".parse::<Cidr>(),
            Err(CidrError::Addr { .. })
        ));
        assert!(matches!(
            "198.18.1.0/x".parse::<Cidr>(),
            Err(CidrError::Prefix { .. })
        ));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("203.0.113.1".parse().unwrap()));
        let v6: Cidr = "fd00:1::/64".parse().unwrap();
        assert!(v6.contains("fd00:1::5".parse().unwrap()));
        assert!(!v6.contains("fd00:2::5".parse().unwrap()));
    }

    #[test]
    fn filter_refuses_and_counts_other_networks() {
        let f = PeerFilter::new(vec!["198.18.1.0/24".parse().unwrap()]);
        assert!(f.admit(peer("198.18.1.7")));
        assert!(
            !f.admit(peer("198.19.255.2")),
            "another node's address must be refused"
        );
        assert_eq!(f.refused(), 1);
        f.set(Vec::new());
        assert!(
            f.admit(peer("198.19.255.2")),
            "no networks configured admits everyone"
        );
    }
}
