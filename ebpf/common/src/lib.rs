//! Types shared by the kernel programs (`skewless-ebpf`) and the agent's datapath.
//!
//! Every map key and value is `#[repr(C)]`, `Copy`, and has no implicit padding: the verifier
//! rejects reads of uninitialised padding on the stack, and the user side reads the same bytes.
//! Sizes are asserted at compile time so a change to a layout cannot go unnoticed on one side.
//!
//! Owns the layouts and names both sides must agree on (map keys and values, map names, the
//! counter list, address families). Holds no logic: what the programs do is `skewless-ebpf`'s,
//! how the agent uses the maps is `skewless-datapath`'s.
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
/// Name of the hash map of cgroup v2 ids (`u64` -> `u32`, the value unused) whose processes
/// are never redirected: the agent's own cgroup. The hooks attach to the parent of every pod,
/// the agent's pod included, and an opted-in `kubernetes` Service must never send the agent's
/// own API client to its balancer (which needs that API to have endpoints).
pub const EXCLUDED_CGROUPS_MAP: &str = "EXCLUDED_CGROUPS";
/// Capacity of [`EXCLUDED_CGROUPS_MAP`].
pub const EXCLUDED_CGROUPS_CAPACITY: u32 = 16;
/// Name of the per-CPU counter array (indexed by [`Counter::index`]).
pub const COUNTERS_MAP: &str = "COUNTERS";
/// Name of the map of observed client TCP connections (socket cookie `u64` -> [`Conn`]),
/// written by the `sock_ops` program for every active IPv4 or IPv6 connection from an attached
/// cgroup, and kept current by the `conn_ingress` (cgroup_skb) program.
/// Array map (one `u64`): the flags of the programs' record inserts (`ORIGDST`, `ORIGDST6`,
/// `CONNS`). 0 (`BPF_ANY`) always; a test sets `BPF_EXIST` to make the kernel refuse those
/// inserts and so provoke the programs' rare failure paths for real.
pub const INSERT_FLAGS_MAP: &str = "INSERT_FLAGS";
/// `BPF_EXIST`: update only an existing entry (a new socket's insert fails with ENOENT).
pub const BPF_EXIST: u64 = 2;
/// The programs' log throttle: at most one line per failure kind, CPU and this long.
pub const LOG_EVERY_NS: u64 = 1_000_000_000;

pub const CONNS_MAP: &str = "CONNS";
/// Capacity of [`CONNS_MAP`]. It is an LRU map: when full, the least recently updated
/// connection (usually a closed one) is evicted, so recording never blocks a connection.
pub const CONNS_CAPACITY: u32 = 65_536;
/// `AF_INET`, as [`Conn::family`] holds it.
pub const FAMILY_INET: u32 = 2;
/// `AF_INET6`, as [`Conn::family`] holds it.
pub const FAMILY_INET6: u32 = 10;

/// A Service address as the connect hooks see it: the address `A` as `bpf_sock_addr` carries
/// it (network order: `user_ip4` for IPv4, the four words of `user_ip6` for native IPv6), the
/// port in network byte order as in the low 16 bits of `user_port`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceKey<A> {
    /// The address, network byte order (wire order in memory).
    pub addr: A,
    /// TCP port, network byte order.
    pub port: u16,
    pub _pad: u16,
}

/// An IPv4 Service address: [`REDIRECT4_MAP`]'s key.
pub type ServiceKey4 = ServiceKey<u32>;
/// A native IPv6 Service address: [`REDIRECT6_MAP`]'s key.
pub type ServiceKey6 = ServiceKey<[u32; 4]>;
const _: () = assert!(core::mem::size_of::<ServiceKey4>() == 8);
const _: () = assert!(core::mem::size_of::<ServiceKey6>() == 20);

impl<A> ServiceKey<A> {
    #[must_use]
    pub const fn new(addr_be: A, port_be: u16) -> Self {
        Self {
            addr: addr_be,
            port: port_be,
            _pad: 0,
        }
    }
}

/// Where connect()s to a [`ServiceKey`] of the same family are sent instead: the node
/// balancer's listener.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Redirect<A> {
    /// Address of the listener, as in [`ServiceKey::addr`].
    pub addr: A,
    /// Listener port, network byte order.
    pub port: u16,
    pub _pad: u16,
    /// Non-zero while the redirect is live; zero makes the hook pass the connect through
    /// untouched (fail open) without removing the entry.
    pub enabled: u32,
}

/// [`REDIRECT4_MAP`]'s value.
pub type Redirect4 = Redirect<u32>;
/// [`REDIRECT6_MAP`]'s value.
pub type Redirect6 = Redirect<[u32; 4]>;
const _: () = assert!(core::mem::size_of::<Redirect4>() == 12);
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

/// Declares [`Counter`] from one list: the variants in index order, [`Counter::ALL`] and
/// [`Counter::name`], so adding a counter is one line here.
macro_rules! counters {
    ($($(#[doc = $doc:literal])+ $variant:ident,)+) => {
        /// Indices into the per-CPU [`COUNTERS_MAP`] array: a variant's index is its position
        /// in the list.
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Counter {
            $($(#[doc = $doc])+ $variant,)+
        }

        impl Counter {
            /// Every counter, in index order.
            pub const ALL: [Counter; [$(stringify!($variant)),+].len()] = [$(Counter::$variant),+];

            /// The variant's name, e.g. `"Connect4Seen"`.
            #[must_use]
            pub const fn name(self) -> &'static str {
                match self {
                    $(Counter::$variant => stringify!($variant),)+
                }
            }
        }
    };
}

counters! {
    /// connect4 calls seen (any destination).
    Connect4Seen,
    /// connect4 calls rewritten to a balancer listener.
    Connect4Redirected,
    /// connects (connect4 or connect6, any family) whose destination matched a disabled entry
    /// (fail open).
    Connect4Disabled,
    /// connect6 calls to an IPv4-mapped address (`::ffff:a.b.c.d`) rewritten to a balancer
    /// listener.
    Connect6Redirected,
    /// getpeername calls answered with the original Service address.
    PeerNameRestored,
    /// Redirects whose original destination could not be recorded (getpeername then shows
    /// the balancer's address).
    OrigDstUpdateFailed,
    /// connect6 calls seen (any destination).
    Connect6Seen,
    /// connects to a redirected Service passed through untouched because the agent's heartbeat
    /// was stale (fail open).
    StaleHeartbeat,
    /// Active TCP connections that reached ESTABLISHED in an attached cgroup (sock_ops).
    ConnEstablished,
    /// Connection records that could not be written (the connection is not observed; it is
    /// never affected).
    ConnUpdateFailed,
    /// Established connections whose callbacks (state changes, RTT samples) could not be
    /// enabled: their bytes and close time stay at the values seen at establishment.
    ConnCbFlagsFailed,
    /// Active connections of a family the observer does not record (neither IPv4 nor IPv6;
    /// should stay 0).
    ConnSkippedFamily,
    /// connect6 calls to a native IPv6 Service address rewritten to a balancer listener.
    Connect6NativeRedirected,
    /// Native IPv6 active connections recorded (also counted in `ConnEstablished`).
    ConnEstablished6,
    /// Received packets whose socket's record was refreshed by the cgroup_skb program.
    ConnIngressRefreshed,
    /// connects to a redirected Service from an excluded cgroup (the agent's own), passed
    /// through untouched.
    ConnectExcluded,
}

impl Counter {
    /// The counter's slot in [`COUNTERS_MAP`].
    #[must_use]
    pub const fn index(self) -> u32 {
        self as u32
    }
}

/// Number of entries in [`COUNTERS_MAP`]: one per [`Counter`].
pub const COUNTERS_LEN: u32 = Counter::ALL.len() as u32;
// Every counter's index is its position in `ALL`, below `COUNTERS_LEN`: the programs index the
// map with it and the agent reads slot i as `ALL[i]`.
const _: () = {
    assert!(COUNTERS_LEN as usize == Counter::ALL.len());
    let mut i = 0;
    while i < Counter::ALL.len() {
        assert!(Counter::ALL[i].index() as usize == i);
        i += 1;
    }
};

/// Whether two map names are equal, in a `const` context: the programs assert with it that
/// each map's ELF name (its identifier) is the constant here that the agent looks it up by,
/// so a rename on one side fails the build instead of the privileged load.
#[must_use]
pub const fn same_name(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

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
