//! Types shared by the kernel programs (`skewless-ebpf`) and the agent's datapath.
//!
//! Every map key and value is `#[repr(C)]`, `Copy`, and has no implicit padding: the verifier
//! rejects reads of uninitialised padding on the stack, and the user side reads the same bytes.
//! Sizes are asserted at compile time so a change to a layout cannot go unnoticed on one side.
#![no_std]

/// Name of the map of redirected IPv4 Service addresses (`ServiceKey4` -> `Redirect4`).
pub const REDIRECT4_MAP: &str = "REDIRECT4";
/// Capacity of [`REDIRECT4_MAP`]: one entry per opted-in ClusterIP:port.
pub const REDIRECT4_CAPACITY: u32 = 4096;
/// Name of the map from socket cookie to the Service address a redirected socket asked for
/// (`u64` -> [`ServiceKey4`]); getpeername reads it so the application still sees the VIP.
pub const ORIGDST_MAP: &str = "ORIGDST";
/// Capacity of [`ORIGDST_MAP`]. It is an LRU map: when full, the oldest entries go first, so it
/// never refuses a new connection.
pub const ORIGDST_CAPACITY: u32 = 65_536;
/// Name of the map of redirected native IPv6 Service addresses (`ServiceKey6` -> `Redirect6`).
pub const REDIRECT6_MAP: &str = "REDIRECT6";
/// Capacity of [`REDIRECT6_MAP`]: one entry per opted-in IPv6 ClusterIP:port.
pub const REDIRECT6_CAPACITY: u32 = 4096;
/// Name of the map from socket cookie to the native IPv6 Service address a redirected socket
/// asked for (`u64` -> [`ServiceKey6`]); getpeername6 reads it. IPv4 and IPv4-mapped
/// redirects keep using [`ORIGDST_MAP`].
pub const ORIGDST6_MAP: &str = "ORIGDST6";
/// Capacity of [`ORIGDST6_MAP`]; LRU like [`ORIGDST_MAP`].
pub const ORIGDST6_CAPACITY: u32 = 65_536;
/// Name of the one-slot array holding the agent's last heartbeat (CLOCK_MONOTONIC ns, as
/// `bpf_ktime_get_ns` reads it). 0 means no heartbeat is kept (libraries and tests that drive
/// the datapath directly); the agent always keeps one.
pub const HEARTBEAT_MAP: &str = "HEARTBEAT";
/// A heartbeat older than this makes the hooks stop redirecting (fail open): a hung agent
/// cannot strand new connections on a balancer that no longer serves. The agent beats every
/// 200 ms, so this tolerates a few late beats and still fails open within 1 s.
pub const HEARTBEAT_STALE_NS: u64 = 750_000_000;
/// Name of the per-CPU counter array (indexed by [`Counter`]).
pub const COUNTERS_MAP: &str = "COUNTERS";
/// Name of the map of observed client TCP connections (socket cookie `u64` -> [`Conn`]),
/// written by the `sock_ops` program for every active IPv4 or IPv6 connection from an attached
/// cgroup, and kept current by the `conn_ingress` (cgroup_skb) program.
pub const CONNS_MAP: &str = "CONNS";
/// Capacity of [`CONNS_MAP`]. It is an LRU map: when full, the least recently updated
/// connection (usually a closed one) is evicted, so recording never blocks a connection.
pub const CONNS_CAPACITY: u32 = 65_536;
/// `AF_INET`, as [`Conn::family`] holds it.
pub const FAMILY_INET: u32 = 2;
/// `AF_INET6`, as [`Conn::family`] holds it.
pub const FAMILY_INET6: u32 = 10;

/// An IPv4 Service address as the connect4 hook sees it: both fields in network byte order,
/// exactly as `bpf_sock_addr.user_ip4` / `user_port` carry them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceKey4 {
    /// IPv4 address, network byte order.
    pub addr: u32,
    /// TCP port, network byte order in the low 16 bits.
    pub port: u16,
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<ServiceKey4>() == 8);

impl ServiceKey4 {
    #[must_use]
    pub const fn new(addr_be: u32, port_be: u16) -> Self {
        Self {
            addr: addr_be,
            port: port_be,
            _pad: 0,
        }
    }
}

/// Where connect()s to a [`ServiceKey4`] are sent instead: the node balancer's listener.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Redirect4 {
    /// IPv4 address of the listener, network byte order.
    pub addr: u32,
    /// Listener port, network byte order in the low 16 bits.
    pub port: u16,
    pub _pad: u16,
    /// Non-zero while the redirect is live; zero makes the hook pass the connect through
    /// untouched (fail open) without removing the entry.
    pub enabled: u32,
}
const _: () = assert!(core::mem::size_of::<Redirect4>() == 12);

/// A native IPv6 Service address as the connect6 hook sees it: the address as the four
/// network-order words of `bpf_sock_addr.user_ip6`, the port as in `user_port`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceKey6 {
    /// IPv6 address, four words each in network byte order (wire order in memory).
    pub addr: [u32; 4],
    /// TCP port, network byte order.
    pub port: u16,
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<ServiceKey6>() == 20);

impl ServiceKey6 {
    #[must_use]
    pub const fn new(addr_be: [u32; 4], port_be: u16) -> Self {
        Self {
            addr: addr_be,
            port: port_be,
            _pad: 0,
        }
    }
}

/// Where connect()s to a [`ServiceKey6`] are sent instead: the node balancer's IPv6 listener.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Redirect6 {
    /// IPv6 address of the listener, as in [`ServiceKey6::addr`].
    pub addr: [u32; 4],
    /// Listener port, network byte order.
    pub port: u16,
    pub _pad: u16,
    /// Non-zero while the redirect is live; zero passes the connect through (fail open).
    pub enabled: u32,
}
const _: () = assert!(core::mem::size_of::<Redirect6>() == 24);

/// One client TCP connection as its own socket sees it, recorded by the `sock_ops` program.
///
/// One layout for both families: an IPv4 connection ([`FAMILY_INET`]; also a dual-stack
/// socket talking to an IPv4-mapped address `::ffff:a.b.c.d`) keeps its addresses in word 0
/// and zeroes the other three; a native IPv6 one ([`FAMILY_INET6`]) uses all four words (wire
/// order, as `bpf_sock_ops.local_ip6` carries them). Addresses are in network byte order;
/// ports are in host order (the program converts them). Times are `bpf_ktime_get_ns`
/// (CLOCK_MONOTONIC, ns). Byte counts are the kernel's RFC 4898 counters
/// (`tcp_sock.bytes_acked` and `bytes_received`), copied on every RTT sample, every state
/// change and every packet the socket receives (cgroup_skb ingress), and final once
/// `closed_ns` is set.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conn {
    /// Local (pod) address.
    pub local_addr: [u32; 4],
    /// Remote address the socket is connected to (the VIP under DNAT, the pod under
    /// socket-level load balancing, the balancer when redirected).
    pub remote_addr: [u32; 4],
    /// The Service address a redirected socket asked for (from `ORIGDST` or `ORIGDST6`); all
    /// zero when the socket was not redirected.
    pub orig_addr: [u32; 4],
    /// [`FAMILY_INET`] or [`FAMILY_INET6`]: how to read the addresses.
    pub family: u32,
    /// Last TCP state seen (`BPF_TCP_*`, 1 = established, 7 = close).
    pub state: u32,
    /// Local port, host byte order.
    pub local_port: u16,
    /// Remote port, host byte order.
    pub remote_port: u16,
    /// Port of `orig_addr`, host byte order; 0 when not redirected.
    pub orig_port: u16,
    pub _pad: u16,
    /// When the connection was established.
    pub opened_ns: u64,
    /// When it reached TCP_CLOSE; 0 while open.
    pub closed_ns: u64,
    /// Bytes the peer acknowledged (sent by the client).
    pub bytes_acked: u64,
    /// Bytes received from the peer.
    pub bytes_received: u64,
}
const _: () = assert!(core::mem::size_of::<Conn>() == 96);

/// Indices into the per-CPU [`COUNTERS_MAP`] array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// connect4 calls seen (any destination).
    Connect4Seen = 0,
    /// connect4 calls rewritten to a balancer listener.
    Connect4Redirected = 1,
    /// connects (connect4 or connect6, any family) whose destination matched a disabled entry
    /// (fail open).
    Connect4Disabled = 2,
    /// connect6 calls to an IPv4-mapped address (`::ffff:a.b.c.d`) rewritten to a balancer listener.
    Connect6Redirected = 3,
    /// getpeername calls answered with the original Service address.
    PeerNameRestored = 4,
    /// Redirects whose original destination could not be recorded (getpeername then shows
    /// the balancer's address).
    OrigDstUpdateFailed = 5,
    /// connect6 calls seen (any destination).
    Connect6Seen = 6,
    /// connects to a redirected Service passed through untouched because the agent's heartbeat
    /// was stale (fail open).
    StaleHeartbeat = 7,
    /// Active TCP connections that reached ESTABLISHED in an attached cgroup (sock_ops).
    ConnEstablished = 8,
    /// Connection records that could not be written (the connection is not observed; it is
    /// never affected).
    ConnUpdateFailed = 9,
    /// Established connections whose callbacks (state changes, RTT samples) could not be
    /// enabled: their bytes and close time stay at the values seen at establishment.
    ConnCbFlagsFailed = 10,
    /// Active connections of a family the observer does not record (neither IPv4 nor IPv6;
    /// should stay 0).
    ConnSkippedFamily = 11,
    /// connect6 calls to a native IPv6 Service address rewritten to a balancer listener.
    Connect6NativeRedirected = 12,
    /// Native IPv6 active connections recorded (also counted in `ConnEstablished`).
    ConnEstablished6 = 13,
    /// Received packets whose socket's record was refreshed by the cgroup_skb program.
    ConnIngressRefreshed = 14,
}
/// Number of entries in [`COUNTERS_MAP`].
pub const COUNTERS_LEN: u32 = 15;

#[cfg(feature = "user")]
mod user {
    // SAFETY: all these types are repr(C), Copy, contain only integers and have no padding (sizes
    // asserted above), so every bit pattern is valid.
    unsafe impl aya::Pod for super::ServiceKey4 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Redirect4 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Conn {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ServiceKey6 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Redirect6 {}
}
