//! Byte order: addresses and ports as the hooks see them in `bpf_sock_addr` (network order,
//! IPv6 as four words in wire order) and as the agent uses them.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// An address family as the hooks' maps hold its socket addresses: [`SocketAddrV4`] and
/// [`SocketAddrV6`]. The redirect code is written once over it.
pub(crate) trait Family: Copy + Into<SocketAddr> + std::fmt::Display {
    /// The address as `bpf_sock_addr` carries it: `user_ip4` or the four words of `user_ip6`.
    type Wire: Copy + 'static;

    /// The address and the port (network byte order) as the hooks compare and write them.
    fn to_wire(self) -> (Self::Wire, u16);

    /// The inverse of [`Family::to_wire`].
    fn from_wire(addr: Self::Wire, port_be: u16) -> Self;
}

impl Family for SocketAddrV4 {
    type Wire = u32;

    fn to_wire(self) -> (u32, u16) {
        (ip4_to_wire(*self.ip()), self.port().to_be())
    }

    fn from_wire(addr: u32, port_be: u16) -> Self {
        Self::new(ip4_from_wire(addr), u16::from_be(port_be))
    }
}

impl Family for SocketAddrV6 {
    type Wire = [u32; 4];

    fn to_wire(self) -> ([u32; 4], u16) {
        (ip6_to_wire(*self.ip()), self.port().to_be())
    }

    fn from_wire(addr: [u32; 4], port_be: u16) -> Self {
        Self::new(ip6_from_wire(addr), u16::from_be(port_be), 0, 0)
    }
}

/// The address as `bpf_sock_addr.user_ip4` holds it: network order.
pub(crate) fn ip4_to_wire(ip: Ipv4Addr) -> u32 {
    u32::from(ip).to_be()
}

/// The inverse of [`ip4_to_wire`].
pub(crate) fn ip4_from_wire(addr: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from_be(addr))
}

/// The address as `bpf_sock_addr.user_ip6` holds it: wire-order bytes, read as four words.
pub(crate) fn ip6_to_wire(ip: Ipv6Addr) -> [u32; 4] {
    let o = ip.octets();
    core::array::from_fn(|i| {
        u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
    })
}

/// The inverse of [`ip6_to_wire`].
pub(crate) fn ip6_from_wire(addr: [u32; 4]) -> Ipv6Addr {
    let mut o = [0u8; 16];
    for (chunk, word) in o.chunks_exact_mut(4).zip(addr) {
        chunk.copy_from_slice(&word.to_ne_bytes());
    }
    Ipv6Addr::from(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_addresses_and_ports_are_in_network_order() {
        let addr: SocketAddrV4 = "10.96.0.10:8080".parse().unwrap();
        let (ip, port) = addr.to_wire();
        assert_eq!(
            ip.to_ne_bytes(),
            [10, 96, 0, 10],
            "address bytes must be in wire order"
        );
        assert_eq!(
            port.to_ne_bytes(),
            8080u16.to_be_bytes(),
            "port must be in wire order"
        );
        assert_eq!(SocketAddrV4::from_wire(ip, port), addr);
    }

    #[test]
    fn ipv6_addresses_are_four_words_in_wire_order() {
        let addr: SocketAddrV6 = "[fd00:198:19::c613:a]:8080".parse().unwrap();
        let (ip, port) = addr.to_wire();
        let bytes: Vec<u8> = ip.iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert_eq!(
            bytes,
            addr.ip().octets(),
            "address bytes must be in wire order"
        );
        assert_eq!(port.to_ne_bytes(), 8080u16.to_be_bytes());
        assert_eq!(SocketAddrV6::from_wire(ip, port), addr);
    }
}
