//! skewless's kernel programs, attached to pod cgroups (never the root).
//!
//! - `connect4` / `connect6`: if a TCP `connect()` goes to an opted-in Service VIP:port listed
//!   in `REDIRECT4`, rewrite the destination to the node balancer's listener and remember the
//!   original destination under the socket's cookie. `connect6` handles IPv4-mapped addresses
//!   (`::ffff:a.b.c.d`), which dual-stack sockets use for IPv4 Services, through `REDIRECT4`,
//!   and native IPv6 Service addresses through `REDIRECT6` (original kept in `ORIGDST6`).
//! - `getpeername4` / `getpeername6`: a redirected socket still reports the VIP:port it
//!   connected to, so applications that log or check their peer see no difference.
//!
//! - `sock_ops`: for every active (client-side) IPv4 or IPv6 TCP connection that reaches
//!   ESTABLISHED, records its addresses, the Service it asked for if redirected (`ORIGDST` /
//!   `ORIGDST6`), its open time and, on every RTT sample and state change, the kernel's byte
//!   counters and the close time in the LRU map `CONNS` under the socket cookie. The agent
//!   resolves the real backend from these records (conntrack under DNAT).
//! - `conn_ingress` (cgroup_skb ingress): on every packet a recorded connection receives,
//!   copies the kernel's byte counters into its record, so a connection that only downloads
//!   stays current too (sock_ops has no callback for received data).
//!
//! A redirect also needs a fresh heartbeat from the agent (`HEARTBEAT`): if the agent hangs,
//! connects go straight to the Service again within a second.
//!
//! Anything else — another port, another address, UDP, a failed map lookup — passes
//! untouched: every path returns "allow", so a fault here can never break a connection.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]
// The helpers are inlined into the program that calls them on purpose: one function per
// program for the verifier, with no BPF-to-BPF calls and one stack frame (512 bytes at most).
#![cfg_attr(
    target_arch = "bpf",
    expect(
        clippy::inline_always,
        reason = "eBPF helpers are inlined into their programs"
    )
)]

#[cfg(target_arch = "bpf")]
mod programs {
    use aya_ebpf::{
        bindings::{
            BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_RTT_CB, BPF_SOCK_OPS_RTT_CB_FLAG,
            BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_TCP_CLOSE, bpf_sock_addr,
        },
        helpers::{
            bpf_get_current_cgroup_id, bpf_get_socket_cookie, bpf_ktime_get_ns, bpf_tcp_sock,
        },
        macros::{cgroup_skb, cgroup_sock_addr, map, sock_ops},
        maps::{Array, HashMap, LruHashMap, PerCpuArray},
        programs::{SkBuffContext, SockAddrContext, SockOpsContext},
    };
    use aya_log_ebpf::error;
    use skewless_common::{
        CONNS_CAPACITY, CONNS_MAP, COUNTERS_LEN, COUNTERS_MAP, Conn, Counter,
        EXCLUDED_CGROUPS_CAPACITY, EXCLUDED_CGROUPS_MAP, FAMILY_INET, FAMILY_INET6, HEARTBEAT_MAP,
        HEARTBEAT_STALE_NS, INSERT_FLAGS_MAP, LOG_EVERY_NS, ORIGDST_CAPACITY, ORIGDST_MAP,
        ORIGDST6_CAPACITY, ORIGDST6_MAP, REDIRECT4_CAPACITY, REDIRECT4_MAP, REDIRECT6_CAPACITY,
        REDIRECT6_MAP, Redirect, Redirect4, Redirect6, ServiceKey, ServiceKey4, ServiceKey6,
        same_name,
    };

    /// Verdict for cgroup sock_addr programs: 1 lets the syscall proceed (with whatever address
    /// the program left in the context). 0 would fail it with EPERM; skewless never does that.
    const ALLOW: i32 = 1;
    const SOCK_STREAM: u32 = 1;
    /// `::ffff:0:0/96` in network byte order, word 2.
    const V4_MAPPED_WORD: u32 = 0x0000_ffff_u32.to_be();

    /// Declares a map whose ELF name is its identifier, and checks at compile time that this
    /// is the name the agent looks it up by (the constant of `skewless-common`).
    macro_rules! named_map {
        ($name:ident: $ty:ty = $init:expr, as $agent_name:path) => {
            #[map]
            static $name: $ty = $init;
            const _: () = assert!(
                same_name(stringify!($name), $agent_name),
                concat!(
                    "map ",
                    stringify!($name),
                    " is not the name skewless-common gives the agent"
                )
            );
        };
    }

    named_map!(REDIRECT4: HashMap<ServiceKey4, Redirect4> =
        HashMap::with_max_entries(REDIRECT4_CAPACITY, 0), as REDIRECT4_MAP);
    named_map!(ORIGDST: LruHashMap<u64, ServiceKey4> =
        LruHashMap::with_max_entries(ORIGDST_CAPACITY, 0), as ORIGDST_MAP);
    named_map!(REDIRECT6: HashMap<ServiceKey6, Redirect6> =
        HashMap::with_max_entries(REDIRECT6_CAPACITY, 0), as REDIRECT6_MAP);
    named_map!(ORIGDST6: LruHashMap<u64, ServiceKey6> =
        LruHashMap::with_max_entries(ORIGDST6_CAPACITY, 0), as ORIGDST6_MAP);
    named_map!(HEARTBEAT: Array<u64> = Array::with_max_entries(1, 0), as HEARTBEAT_MAP);
    named_map!(CONNS: LruHashMap<u64, Conn> =
        LruHashMap::with_max_entries(CONNS_CAPACITY, 0), as CONNS_MAP);
    named_map!(EXCLUDED_CGROUPS: HashMap<u64, u32> =
        HashMap::with_max_entries(EXCLUDED_CGROUPS_CAPACITY, 0), as EXCLUDED_CGROUPS_MAP);
    named_map!(COUNTERS: PerCpuArray<u64> =
        PerCpuArray::with_max_entries(COUNTERS_LEN, 0), as COUNTERS_MAP);
    named_map!(INSERT_FLAGS: Array<u64> = Array::with_max_entries(1, 0), as INSERT_FLAGS_MAP);

    /// The rare failures the programs log (besides counting them): an index of `LOGGED`.
    #[derive(Clone, Copy)]
    enum Failure {
        OrigDst = 0,
        ConnRecord = 1,
        CbFlags = 2,
    }

    /// When each [`Failure`] was last logged on this CPU (ns, `bpf_ktime_get_ns`).
    #[map]
    static LOGGED: PerCpuArray<u64> = PerCpuArray::with_max_entries(3, 0);

    /// Whether a line about `failure` may be written now: at most one per kind and CPU every
    /// [`LOG_EVERY_NS`], so a failure that repeats on every connect costs its counter and a
    /// timestamp check, and the agent's log a line a second. Only failure paths call this.
    #[inline(always)]
    fn may_log(failure: Failure) -> bool {
        let Some(last) = LOGGED.get_ptr_mut(failure as u32) else {
            return false;
        };
        // SAFETY: bpf_ktime_get_ns has no preconditions.
        let now = unsafe { bpf_ktime_get_ns() };
        // SAFETY: this CPU's slot; hooks run to completion on one CPU, so nothing races.
        unsafe {
            if *last != 0 && now.saturating_sub(*last) < LOG_EVERY_NS {
                return false;
            }
            *last = now;
        }
        true
    }

    /// The flags of the record inserts: `BPF_ANY` unless a test provokes failures.
    #[inline(always)]
    fn insert_flags() -> u64 {
        INSERT_FLAGS.get(0).copied().unwrap_or(0)
    }

    #[inline(always)]
    fn count(counter: Counter) {
        if let Some(slot) = COUNTERS.get_ptr_mut(counter.index()) {
            // SAFETY: the slot belongs to this CPU's copy of the array and cgroup hooks run
            // to completion on one CPU, so this plain add cannot race.
            unsafe { *slot += 1 };
        }
    }

    /// Whether a redirect entry may be used now: it is enabled and the agent's heartbeat is
    /// fresh (or none is kept). Counts why not otherwise.
    #[inline(always)]
    fn live(enabled: u32) -> bool {
        if enabled == 0 {
            count(Counter::Connect4Disabled);
            return false;
        }
        let beat = HEARTBEAT.get(0).copied().unwrap_or(0);
        // SAFETY: bpf_ktime_get_ns has no preconditions.
        let now = unsafe { bpf_ktime_get_ns() };
        if beat != 0 && now.saturating_sub(beat) > HEARTBEAT_STALE_NS {
            count(Counter::StaleHeartbeat);
            return false;
        }
        true
    }

    /// Whether the connecting task's cgroup is excluded from redirects (the agent's own).
    /// connect() runs in the caller's context, so the current task's cgroup is the socket
    /// owner's.
    #[inline(always)]
    fn excluded() -> bool {
        // SAFETY: bpf_get_current_cgroup_id has no preconditions.
        let id = unsafe { bpf_get_current_cgroup_id() };
        EXCLUDED_CGROUPS.get_ptr(id).is_some()
    }

    /// A Service address in a log line: IPv4 (`REDIRECT4`'s keys) or IPv6 (`REDIRECT6`'s), both
    /// in network order.
    ///
    /// The log lines are written out of line (`#[inline(never)]`, a BPF-to-BPF call): inlined,
    /// the compiler reused the stack slots that held the log's argument pointers for map keys,
    /// and without CAP_PERFMON (which the agent does not get) the verifier refuses a partial
    /// write over a spilled pointer ("attempt to corrupt spilled pointer on stack").
    trait LogAddr {
        fn log_origdst_failed(self, ctx: &SockAddrContext, port: u16, errno: i32);
    }

    impl LogAddr for u32 {
        #[inline(never)]
        fn log_origdst_failed(self, ctx: &SockAddrContext, port: u16, errno: i32) {
            // SAFETY: bpf_get_current_cgroup_id has no preconditions.
            let cgroup = unsafe { bpf_get_current_cgroup_id() };
            error!(
                ctx,
                "redirected connect: original destination {:i}:{} not kept for getpeername (map update failed: {}); cgroup {}",
                u32::from_be(self),
                port,
                errno,
                cgroup
            );
        }
    }

    impl LogAddr for [u32; 4] {
        #[inline(never)]
        fn log_origdst_failed(self, ctx: &SockAddrContext, port: u16, errno: i32) {
            // SAFETY: bpf_get_current_cgroup_id has no preconditions.
            let cgroup = unsafe { bpf_get_current_cgroup_id() };
            // SAFETY: four words in network order are the address's sixteen bytes in order.
            let bytes: [u8; 16] = unsafe { core::mem::transmute(self) };
            error!(
                ctx,
                "redirected connect: original destination [{:i}]:{} not kept for getpeername (map update failed: {}); cgroup {}",
                bytes,
                port,
                errno,
                cgroup
            );
        }
    }

    /// A sock_addr program's context, read and written only through raw field pointers: no
    /// `&mut bpf_sock_addr` is ever formed, so no reference is alive while the address words
    /// are written, and every access is a constant-offset context load or store, as the
    /// verifier requires.
    struct SockAddr(*mut bpf_sock_addr);

    impl SockAddr {
        #[inline(always)]
        fn new(ctx: &SockAddrContext) -> Self {
            Self(ctx.sock_addr)
        }

        #[inline(always)]
        fn sock_type(&self) -> u32 {
            // SAFETY: the pointer is the kernel-provided context, valid for the whole run.
            unsafe { (*self.0).type_ }
        }

        /// The port, network byte order.
        #[inline(always)]
        fn port(&self) -> u16 {
            // SAFETY: as in `sock_type`.
            unsafe { (*self.0).user_port as u16 }
        }

        /// Writes the port (network byte order) as the 4-byte store the kernel requires.
        #[inline(always)]
        fn set_port(&self, port_be: u16) {
            // SAFETY: as in `sock_type`; sock_addr programs may write user_port.
            unsafe { (*self.0).user_port = u32::from(port_be) };
        }

        #[inline(always)]
        fn ip4(&self) -> u32 {
            // SAFETY: as in `sock_type`.
            unsafe { (*self.0).user_ip4 }
        }

        #[inline(always)]
        fn set_ip4(&self, addr: u32) {
            // SAFETY: as in `sock_type`; sock_addr programs may write user_ip4.
            unsafe { (*self.0).user_ip4 = addr };
        }

        /// Reads `user_ip6` one word at a time with volatile loads from the field addresses:
        /// otherwise the compiler forms `ctx + 8` in a register and loads through it, which
        /// the verifier rejects ("dereference of modified ctx ptr").
        #[inline(always)]
        fn ip6(&self) -> [u32; 4] {
            let sa = self.0;
            // SAFETY: as in `sock_type`; each address is a field of the context.
            unsafe {
                [
                    core::ptr::read_volatile(&raw const (*sa).user_ip6[0]),
                    core::ptr::read_volatile(&raw const (*sa).user_ip6[1]),
                    core::ptr::read_volatile(&raw const (*sa).user_ip6[2]),
                    core::ptr::read_volatile(&raw const (*sa).user_ip6[3]),
                ]
            }
        }

        /// Writes `user_ip6` one word at a time, for the same reason as [`SockAddr::ip6`].
        #[inline(always)]
        fn set_ip6(&self, addr: [u32; 4]) {
            let sa = self.0;
            // SAFETY: as in `ip6`; sock_addr programs may write user_ip6 in 4-byte stores.
            unsafe {
                core::ptr::write_volatile(&raw mut (*sa).user_ip6[0], addr[0]);
                core::ptr::write_volatile(&raw mut (*sa).user_ip6[1], addr[1]);
                core::ptr::write_volatile(&raw mut (*sa).user_ip6[2], addr[2]);
                core::ptr::write_volatile(&raw mut (*sa).user_ip6[3], addr[3]);
            }
        }

        /// Writes the IPv4 word of an IPv4-mapped `user_ip6` (`::ffff:a.b.c.d`).
        #[inline(always)]
        fn set_ip6_mapped(&self, addr: u32) {
            // SAFETY: as in `set_ip6`.
            unsafe { core::ptr::write_volatile(&raw mut (*self.0).user_ip6[3], addr) };
        }

        #[inline(always)]
        fn cookie(&self) -> u64 {
            // SAFETY: sock_addr programs may call bpf_get_socket_cookie on their context.
            unsafe { bpf_get_socket_cookie(self.0.cast()) }
        }
    }

    /// If `key` (a TCP destination) is a live redirected Service: records it under the
    /// socket's cookie in `origdst` for getpeername, points the connect at the balancer
    /// (`set_addr` writes the address) and returns true.
    #[inline(always)]
    fn redirect<A: Copy + LogAddr>(
        ctx: &SockAddrContext,
        sa: &SockAddr,
        redirects: &HashMap<ServiceKey<A>, Redirect<A>>,
        origdst: &LruHashMap<u64, ServiceKey<A>>,
        key: ServiceKey<A>,
        set_addr: impl FnOnce(&SockAddr, A),
    ) -> bool {
        if sa.sock_type() != SOCK_STREAM {
            return false;
        }
        // SAFETY: the value is copied out before the map can change under us.
        let Some(target) = (unsafe { redirects.get(key) }).copied() else {
            return false;
        };
        if !live(target.enabled) {
            return false;
        }
        if excluded() {
            count(Counter::ConnectExcluded);
            return false;
        }
        if let Err(errno) = origdst.insert(sa.cookie(), key, insert_flags()) {
            count(Counter::OrigDstUpdateFailed);
            if may_log(Failure::OrigDst) {
                key.addr
                    .log_origdst_failed(ctx, u16::from_be(key.port), errno);
            }
        }
        set_addr(sa, target.addr);
        sa.set_port(target.port);
        true
    }

    /// The Service address a redirected socket asked for, from `origdst`.
    #[inline(always)]
    fn original<A: Copy>(
        origdst: &LruHashMap<u64, ServiceKey<A>>,
        cookie: u64,
    ) -> Option<ServiceKey<A>> {
        // SAFETY: the value is copied out immediately.
        unsafe { origdst.get(cookie) }.copied()
    }

    /// If the socket was redirected (its cookie is in `origdst`): reports the Service address
    /// it asked for (`set_addr` writes the address) and returns true.
    #[inline(always)]
    fn restore<A: Copy>(
        sa: &SockAddr,
        origdst: &LruHashMap<u64, ServiceKey<A>>,
        set_addr: impl FnOnce(&SockAddr, A),
    ) -> bool {
        let Some(orig) = original(origdst, sa.cookie()) else {
            return false;
        };
        set_addr(sa, orig.addr);
        sa.set_port(orig.port);
        count(Counter::PeerNameRestored);
        true
    }

    #[cgroup_sock_addr(connect4)]
    pub fn connect4(ctx: SockAddrContext) -> i32 {
        count(Counter::Connect4Seen);
        let sa = SockAddr::new(&ctx);
        let key = ServiceKey4::new(sa.ip4(), sa.port());
        if redirect(&ctx, &sa, &REDIRECT4, &ORIGDST, key, SockAddr::set_ip4) {
            count(Counter::Connect4Redirected);
        }
        ALLOW
    }

    #[cgroup_sock_addr(connect6)]
    pub fn connect6(ctx: SockAddrContext) -> i32 {
        count(Counter::Connect6Seen);
        let sa = SockAddr::new(&ctx);
        let ip6 = sa.ip6();
        if ip6[0] == 0 && ip6[1] == 0 && ip6[2] == V4_MAPPED_WORD {
            // A dual-stack socket reaching an IPv4 Service: only the IPv4 word changes.
            let key = ServiceKey4::new(ip6[3], sa.port());
            if redirect(
                &ctx,
                &sa,
                &REDIRECT4,
                &ORIGDST,
                key,
                SockAddr::set_ip6_mapped,
            ) {
                count(Counter::Connect6Redirected);
            }
        } else {
            let key = ServiceKey6::new(ip6, sa.port());
            if redirect(&ctx, &sa, &REDIRECT6, &ORIGDST6, key, SockAddr::set_ip6) {
                count(Counter::Connect6NativeRedirected);
            }
        }
        ALLOW
    }

    #[cgroup_sock_addr(getpeername4)]
    pub fn getpeername4(ctx: SockAddrContext) -> i32 {
        restore(&SockAddr::new(&ctx), &ORIGDST, SockAddr::set_ip4);
        ALLOW
    }

    #[cgroup_sock_addr(getpeername6)]
    pub fn getpeername6(ctx: SockAddrContext) -> i32 {
        let sa = SockAddr::new(&ctx);
        // An IPv4-mapped redirect (only the IPv4 word changed), else a native IPv6 one.
        if !restore(&sa, &ORIGDST, SockAddr::set_ip6_mapped) {
            restore(&sa, &ORIGDST6, SockAddr::set_ip6);
        }
        ALLOW
    }

    /// Return value of sock_ops programs; the kernel ignores it for the callbacks used here.
    const SOCK_OPS_OK: u32 = 1;

    #[sock_ops]
    pub fn sock_ops(ctx: SockOpsContext) -> u32 {
        match ctx.op() {
            BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => established(&ctx),
            BPF_SOCK_OPS_RTT_CB => refresh(&ctx, None),
            // args: old state, new state; the callback runs before the socket changes state.
            BPF_SOCK_OPS_STATE_CB => refresh(&ctx, Some(ctx.arg(1))),
            _ => {}
        }
        // Observation only: nothing here can change or fail the connection.
        SOCK_OPS_OK
    }

    /// A socket's family and addresses as a [`Conn`] stores them.
    struct Addrs {
        family: u32,
        local: [u32; 4],
        remote: [u32; 4],
    }

    /// The socket's addresses (network order). Dual-stack sockets reach IPv4 peers through
    /// IPv4-mapped addresses, which are recorded as IPv4; native IPv6 keeps all 16 bytes.
    #[inline(always)]
    fn addrs(ctx: &SockOpsContext) -> Option<Addrs> {
        let o = ctx.ops;
        // Every field is read up front with volatile loads, one word each: otherwise the
        // compiler merges the IPv4 and IPv6 loads into one load through an offset context
        // pointer, which the verifier rejects ("dereference of modified ctx ptr").
        // SAFETY: `ops` is the kernel-provided context, valid for the whole run; each address
        // is a field of it, so the verifier sees constant-offset context loads.
        let word = |p: *const u32| unsafe { core::ptr::read_volatile(p) };
        // SAFETY: as above: only field addresses are formed, nothing is dereferenced here.
        let (family, l4, r4, l6, r6) = unsafe {
            (
                word(&raw const (*o).family),
                word(&raw const (*o).local_ip4),
                word(&raw const (*o).remote_ip4),
                [
                    word(&raw const (*o).local_ip6[0]),
                    word(&raw const (*o).local_ip6[1]),
                    word(&raw const (*o).local_ip6[2]),
                    word(&raw const (*o).local_ip6[3]),
                ],
                [
                    word(&raw const (*o).remote_ip6[0]),
                    word(&raw const (*o).remote_ip6[1]),
                    word(&raw const (*o).remote_ip6[2]),
                    word(&raw const (*o).remote_ip6[3]),
                ],
            )
        };
        let mapped = |a: [u32; 4]| a[0] == 0 && a[1] == 0 && a[2] == V4_MAPPED_WORD;
        let v4 = |l: u32, r: u32| Addrs {
            family: FAMILY_INET,
            local: [l, 0, 0, 0],
            remote: [r, 0, 0, 0],
        };
        // `FAMILY_*` are the kernel's AF_INET / AF_INET6, as `bpf_sock_ops.family` holds them.
        match family {
            FAMILY_INET => Some(v4(l4, r4)),
            FAMILY_INET6 if mapped(l6) && mapped(r6) => Some(v4(l6[3], r6[3])),
            FAMILY_INET6 => Some(Addrs {
                family: FAMILY_INET6,
                local: l6,
                remote: r6,
            }),
            _ => None,
        }
    }

    /// The Service a redirected socket asked for, as (address words, port in network order):
    /// `ORIGDST` for IPv4 (and IPv4-mapped) sockets, `ORIGDST6` for native IPv6 ones.
    #[inline(always)]
    fn origin(family: u32, cookie: u64) -> Option<([u32; 4], u16)> {
        if family == FAMILY_INET6 {
            original(&ORIGDST6, cookie).map(|o| (o.addr, o.port))
        } else {
            original(&ORIGDST, cookie).map(|o| ([o.addr, 0, 0, 0], o.port))
        }
    }

    #[inline(always)]
    fn established(ctx: &SockOpsContext) {
        count(Counter::ConnEstablished);
        let Some(addrs) = addrs(ctx) else {
            count(Counter::ConnSkippedFamily);
            return;
        };
        if addrs.family == FAMILY_INET6 {
            count(Counter::ConnEstablished6);
        }
        // SAFETY: sock_ops programs may call bpf_get_socket_cookie on their context.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
        let orig = origin(addrs.family, cookie);
        // SAFETY: `ops` is the kernel-provided context, valid for the whole run; the verifier
        // checks every field access (a full socket is guaranteed at ESTABLISHED callbacks).
        let ops = unsafe { &*ctx.ops };
        // SAFETY: bpf_ktime_get_ns has no preconditions.
        let now = unsafe { bpf_ktime_get_ns() };
        let conn = Conn {
            local_addr: addrs.local,
            remote_addr: addrs.remote,
            orig_addr: orig.map_or([0; 4], |o| o.0),
            family: addrs.family,
            state: ops.state,
            // local_port is host order; remote_port is network order in the high half.
            local_port: ctx.local_port() as u16,
            remote_port: u32::from_be(ctx.remote_port()) as u16,
            orig_port: orig.map_or(0, |o| u16::from_be(o.1)),
            _pad: 0,
            opened_ns: now,
            closed_ns: 0,
            bytes_acked: ops.bytes_acked,
            bytes_received: ops.bytes_received,
        };
        if let Err(errno) = CONNS.insert(cookie, conn, insert_flags()) {
            count(Counter::ConnUpdateFailed);
            if may_log(Failure::ConnRecord) {
                log_conn_failure(ctx, Failure::ConnRecord, &conn, errno);
            }
            return;
        }
        let flags = ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTT_CB_FLAG;
        if let Err(errno) = ctx.set_cb_flags(flags as i32) {
            count(Counter::ConnCbFlagsFailed);
            if may_log(Failure::CbFlags) {
                log_conn_failure(ctx, Failure::CbFlags, &conn, errno);
            }
        }
    }

    /// Logs a pod connection the hooks could not observe: what failed, its addresses (IPv4
    /// ones; for IPv6 its ports) and its socket cookie. (The ESTABLISHED callback of a
    /// connect runs in softirq, where the current task's cgroup is not the socket's.)
    ///
    /// Out of line, as the other log lines (see [`LogAddr`]). What failed is in each format
    /// string, not an argument: an argument of a length the verifier cannot see is copied
    /// into aya-log's ring buffer at a variable offset, which it refuses without CAP_PERFMON.
    #[inline(never)]
    fn log_conn_failure(ctx: &SockOpsContext, failure: Failure, conn: &Conn, errno: i32) {
        // SAFETY: sock_ops programs may call bpf_get_socket_cookie on their context.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
        let (local, remote) = (conn.local_port, conn.remote_port);
        if conn.family == FAMILY_INET {
            let local_addr = u32::from_be(conn.local_addr[0]);
            let remote_addr = u32::from_be(conn.remote_addr[0]);
            if let Failure::CbFlags = failure {
                error!(
                    ctx,
                    "pod connection {:i}:{} -> {:i}:{} unobserved: state and RTT callbacks not set ({}); socket cookie {}",
                    local_addr,
                    local,
                    remote_addr,
                    remote,
                    errno,
                    cookie
                );
            } else {
                error!(
                    ctx,
                    "pod connection {:i}:{} -> {:i}:{} unobserved: record not kept (map update failed) ({}); socket cookie {}",
                    local_addr,
                    local,
                    remote_addr,
                    remote,
                    errno,
                    cookie
                );
            }
        } else if let Failure::CbFlags = failure {
            error!(
                ctx,
                "pod IPv6 connection from port {} to port {} unobserved: state and RTT callbacks not set ({}); socket cookie {}",
                local,
                remote,
                errno,
                cookie
            );
        } else {
            error!(
                ctx,
                "pod IPv6 connection from port {} to port {} unobserved: record not kept (map update failed) ({}); socket cookie {}",
                local,
                remote,
                errno,
                cookie
            );
        }
    }

    /// Copies the byte counters, the state (`new_state` on a state change) and, at
    /// TCP_CLOSE, the close time into the record.
    #[inline(always)]
    fn refresh(ctx: &SockOpsContext, new_state: Option<u32>) {
        // SAFETY: as in `established`.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
        // Callbacks are only enabled for recorded sockets; a missing record was evicted.
        let Some(conn) = CONNS.get_ptr_mut(cookie) else {
            return;
        };
        // SAFETY: as in `established`; state and RTT callbacks run on full sockets.
        let ops = unsafe { &*ctx.ops };
        // SAFETY: the pointer is to a live map value; a concurrent update of the same socket
        // cannot happen (callbacks run under the socket lock), and a torn read by user space
        // only delays a counter by one refresh.
        unsafe {
            (*conn).bytes_acked = ops.bytes_acked;
            (*conn).bytes_received = ops.bytes_received;
            let state = new_state.unwrap_or(ops.state);
            (*conn).state = state;
            if state == BPF_TCP_CLOSE {
                (*conn).closed_ns = bpf_ktime_get_ns();
            }
        }
    }

    /// Verdict for cgroup_skb programs: 1 lets the packet through. 0 would drop it; skewless
    /// never does that.
    const PASS: i32 = 1;

    /// cgroup_skb ingress: keeps the byte counters of recorded connections current while
    /// they only receive. sock_ops refreshes them on RTT samples (ACKs of the client's own
    /// data) and state changes, so a download-only connection (server streaming) would
    /// otherwise show its bytes at close only. This runs before TCP processes the packet, so
    /// the counters it copies lag by at most that one packet; the close refresh is final.
    #[cgroup_skb(ingress)]
    pub fn conn_ingress(ctx: SkBuffContext) -> i32 {
        ingress(&ctx);
        PASS
    }

    #[inline(always)]
    fn ingress(ctx: &SkBuffContext) {
        let skb = ctx.skb.skb;
        // SAFETY: `skb` is the kernel-provided context, valid for the whole run; `sk` is one
        // of its fields, read with one 8-byte load as the verifier requires.
        let sk = unsafe { core::ptr::read_volatile(&raw const (*skb).__bindgen_anon_2.sk) };
        if sk.is_null() {
            return;
        }
        // SAFETY: cgroup_skb programs may call bpf_get_socket_cookie on their context (the
        // cookie of skb->sk).
        let cookie = unsafe { bpf_get_socket_cookie(skb.cast()) };
        // Only connections sock_ops recorded: server sockets and other traffic miss here.
        let Some(conn) = CONNS.get_ptr_mut(cookie) else {
            return;
        };
        // SAFETY: `sk` is a non-null socket pointer from the context; bpf_tcp_sock returns
        // NULL unless it is a full TCP socket.
        let tp = unsafe { bpf_tcp_sock(sk) };
        if tp.is_null() {
            return;
        }
        // SAFETY: `tp` was checked non-null; `conn` points to a live map value. A concurrent
        // sock_ops refresh of the same record writes the same or newer kernel counters, so a
        // race only delays a counter by one packet.
        unsafe {
            (*conn).bytes_acked = (*tp).bytes_acked;
            (*conn).bytes_received = (*tp).bytes_received;
        }
        count(Counter::ConnIngressRefreshed);
    }

    #[panic_handler]
    fn panic(_info: &core::panic::PanicInfo) -> ! {
        loop {}
    }
}

#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

/// Host builds (clippy, `cargo check --workspace`) compile this stub instead of the programs.
#[cfg(not(target_arch = "bpf"))]
fn main() {}
