//! The address plan: every address the testbed hands out, in one place.
//!
//! | what | IPv4 | IPv6 |
//! |---|---|---|
//! | pod `n` (1-based subnet, one per pod) | `198.18.n.2/24` | `fd00:198:18:n::2/64` |
//! | its gateway (node side of the veth) | `198.18.n.1/24` | `fd00:198:18:n::1/64` |
//! | node `i` on the fabric bridge | `198.19.255.(i+1)/24` | `fd00:198:19:ffff::(i+1)/64` |
//! | a Service VIP | chosen by the caller (198.19.0.0/16 by convention) | [`vip6`] of it |
//! | the balancer on every node's `lo` | [`BALANCER_IP`] | [`BALANCER_IP6`] |
//!
//! 198.18.0.0/15 is reserved for network benchmarks (RFC 2544) and the IPv6 addresses are
//! unique-local; none of them exists outside the testbed's namespaces.

use std::net::{Ipv4Addr, Ipv6Addr};

/// The node-local address of the balancer on every node: a /32 on the node's `lo`, reachable
/// from the node's pods through their default route, like node-local DNS caches do.
pub const BALANCER_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 77, 1);
/// The IPv6 node-local address of the balancer on every node: a /128 on the node's `lo`,
/// reachable from the node's pods through their default IPv6 route.
pub const BALANCER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x169, 0x254, 0, 0, 0, 0, 1);

/// The IPv6 VIP of a Service whose IPv4 VIP is `vip`: `fd00:198:19::a.b.c.d` (the IPv4
/// address in the last 32 bits), so each Service gets one without extra configuration.
#[must_use]
pub fn vip6(vip: Ipv4Addr) -> Ipv6Addr {
    let [a, b, c, d] = vip.octets();
    Ipv6Addr::new(
        0xfd00,
        0x198,
        0x19,
        0,
        0,
        0,
        u16::from_be_bytes([a, b]),
        u16::from_be_bytes([c, d]),
    )
}

/// A pod's IPv4 address (`gateway == false`) or its node-side gateway, in the pod's /24.
pub(crate) fn pod_ip(subnet: u8, gateway: bool) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, subnet, if gateway { 1 } else { 2 })
}

/// A pod's IPv6 address (`gateway == false`) or its node-side gateway, in the pod's /64.
pub(crate) fn pod_ip6(subnet: u8, gateway: bool) -> Ipv6Addr {
    Ipv6Addr::new(
        0xfd00,
        0x198,
        0x18,
        u16::from(subnet),
        0,
        0,
        0,
        if gateway { 1 } else { 2 },
    )
}

/// A pod's IPv4 subnet, as other nodes route it.
pub(crate) fn pod_subnet(subnet: u8) -> String {
    format!("198.18.{subnet}.0/24")
}

/// A pod's IPv6 subnet, as other nodes route it.
pub(crate) fn pod_subnet6(subnet: u8) -> String {
    format!("fd00:198:18:{subnet:x}::/64")
}

/// A node's IPv4 address on the fabric bridge.
pub(crate) fn fabric_ip(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 19, 255, u8::try_from(index + 1).unwrap_or(255))
}

/// A node's IPv6 address on the fabric bridge.
pub(crate) fn fabric_ip6(index: usize) -> Ipv6Addr {
    Ipv6Addr::new(
        0xfd00,
        0x198,
        0x19,
        0xffff,
        0,
        0,
        0,
        u16::try_from(index + 1).unwrap_or(u16::MAX),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_and_gateway_share_the_pod_subnet_in_both_families() {
        assert_eq!(pod_ip(7, false), Ipv4Addr::new(198, 18, 7, 2));
        assert_eq!(pod_ip(7, true), Ipv4Addr::new(198, 18, 7, 1));
        assert_eq!(pod_ip6(7, false).to_string(), "fd00:198:18:7::2");
        assert_eq!(pod_ip6(7, true).to_string(), "fd00:198:18:7::1");
        assert_eq!(pod_subnet(7), "198.18.7.0/24");
        // The IPv6 subnet's fourth group is hexadecimal, like the address's.
        assert_eq!(pod_subnet6(250), "fd00:198:18:fa::/64");
        assert_eq!(pod_ip6(250, false).to_string(), "fd00:198:18:fa::2");
    }

    #[test]
    fn vip6_carries_the_ipv4_vip_in_its_last_32_bits() {
        assert_eq!(
            vip6(Ipv4Addr::new(198, 19, 0, 10)).to_string(),
            "fd00:198:19::c613:a"
        );
        assert_eq!(fabric_ip(0), Ipv4Addr::new(198, 19, 255, 1));
        assert_eq!(fabric_ip6(1).to_string(), "fd00:198:19:ffff::2");
    }
}
