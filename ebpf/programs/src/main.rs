//! skewless's kernel programs, attached to pod cgroups (never the root).
//!
//! - `connect4` / `connect6`: if a TCP `connect()` goes to an opted-in Service VIP:port listed
//!   in `REDIRECT4`, rewrite the destination to the node balancer's listener and remember the
//!   original destination under the socket's cookie. `connect6` handles IPv4-mapped addresses
//!   (`::ffff:a.b.c.d`), which dual-stack sockets use for IPv4 Services.
//! - `getpeername4` / `getpeername6`: a redirected socket still reports the VIP:port it
//!   connected to, so applications that log or check their peer see no difference.
//!
//! A redirect also needs a fresh heartbeat from the agent (`HEARTBEAT`): if the agent hangs,
//! connects go straight to the Service again within a second.
//!
//! Anything else — another port, another address, UDP, a failed map lookup — passes
//! untouched: every path returns "allow", so a fault here can never break a connection.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

#[cfg(target_arch = "bpf")]
mod programs {
    use aya_ebpf::{
        helpers::{bpf_get_socket_cookie, bpf_ktime_get_ns},
        macros::{cgroup_sock_addr, map},
        maps::{Array, HashMap, LruHashMap, PerCpuArray},
        programs::SockAddrContext,
    };
    use skewless_common::{
        COUNTERS_LEN, Counter, HEARTBEAT_STALE_NS, ORIGDST_CAPACITY, REDIRECT4_CAPACITY, Redirect4,
        ServiceKey4,
    };

    /// Verdict for cgroup sock_addr programs: 1 lets the syscall proceed (with whatever address
    /// the program left in the context). 0 would fail it with EPERM; skewless never does that.
    const ALLOW: i32 = 1;
    const SOCK_STREAM: u32 = 1;
    /// `::ffff:0:0/96` in network byte order, word 2.
    const V4_MAPPED_WORD: u32 = 0x0000_ffff_u32.to_be();

    #[map(name = "REDIRECT4")]
    static REDIRECT4: HashMap<ServiceKey4, Redirect4> =
        HashMap::with_max_entries(REDIRECT4_CAPACITY, 0);

    #[map(name = "ORIGDST")]
    static ORIGDST: LruHashMap<u64, ServiceKey4> =
        LruHashMap::with_max_entries(ORIGDST_CAPACITY, 0);

    #[map(name = "HEARTBEAT")]
    static HEARTBEAT: Array<u64> = Array::with_max_entries(1, 0);

    #[map(name = "COUNTERS")]
    static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTERS_LEN, 0);

    #[inline(always)]
    fn count(counter: Counter) {
        if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
            // SAFETY: the slot belongs to this CPU's copy of the array and cgroup hooks run
            // to completion on one CPU, so this plain add cannot race.
            unsafe { *slot += 1 };
        }
    }

    /// Looks up a TCP destination; returns the live redirect target for it, if any.
    #[inline(always)]
    fn lookup(sock_type: u32, key: &ServiceKey4) -> Option<Redirect4> {
        if sock_type != SOCK_STREAM {
            return None;
        }
        // SAFETY: the value is copied out before the map can change under us.
        let target = unsafe { REDIRECT4.get(key) }.copied()?;
        if target.enabled == 0 {
            count(Counter::Connect4Disabled);
            return None;
        }
        let beat = HEARTBEAT.get(0).copied().unwrap_or(0);
        // SAFETY: bpf_ktime_get_ns has no preconditions.
        let now = unsafe { bpf_ktime_get_ns() };
        if beat != 0 && now.saturating_sub(beat) > HEARTBEAT_STALE_NS {
            count(Counter::StaleHeartbeat);
            return None;
        }
        Some(target)
    }

    /// Records where a redirected socket wanted to go, for getpeername.
    #[inline(always)]
    fn remember(ctx: &SockAddrContext, key: &ServiceKey4) {
        // SAFETY: sock_addr programs may call bpf_get_socket_cookie on their context.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
        if ORIGDST.insert(cookie, key, 0).is_err() {
            count(Counter::OrigDstUpdateFailed);
        }
    }

    #[inline(always)]
    fn original(ctx: &SockAddrContext) -> Option<ServiceKey4> {
        // SAFETY: as in `remember`.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
        // SAFETY: the value is copied out immediately.
        unsafe { ORIGDST.get(cookie) }.copied()
    }

    #[cgroup_sock_addr(connect4)]
    pub fn connect4(ctx: SockAddrContext) -> i32 {
        count(Counter::Connect4Seen);
        // SAFETY: `sock_addr` is the kernel-provided context, valid for the whole run; the
        // verifier checks every field access against bpf_sock_addr.
        let sa = unsafe { &mut *ctx.sock_addr };
        let key = ServiceKey4::new(sa.user_ip4, sa.user_port as u16);
        if let Some(target) = lookup(sa.type_, &key) {
            remember(&ctx, &key);
            sa.user_ip4 = target.addr;
            sa.user_port = u32::from(target.port);
            count(Counter::Connect4Redirected);
        }
        ALLOW
    }

    #[cgroup_sock_addr(connect6)]
    pub fn connect6(ctx: SockAddrContext) -> i32 {
        count(Counter::Connect6Seen);
        // SAFETY: as in connect4.
        let sa = unsafe { &mut *ctx.sock_addr };
        if sa.user_ip6[0] != 0 || sa.user_ip6[1] != 0 || sa.user_ip6[2] != V4_MAPPED_WORD {
            return ALLOW;
        }
        let key = ServiceKey4::new(sa.user_ip6[3], sa.user_port as u16);
        if let Some(target) = lookup(sa.type_, &key) {
            remember(&ctx, &key);
            sa.user_ip6[3] = target.addr;
            sa.user_port = u32::from(target.port);
            count(Counter::Connect6Redirected);
        }
        ALLOW
    }

    #[cgroup_sock_addr(getpeername4)]
    pub fn getpeername4(ctx: SockAddrContext) -> i32 {
        if let Some(orig) = original(&ctx) {
            // SAFETY: as in connect4.
            let sa = unsafe { &mut *ctx.sock_addr };
            sa.user_ip4 = orig.addr;
            sa.user_port = u32::from(orig.port);
            count(Counter::PeerNameRestored);
        }
        ALLOW
    }

    #[cgroup_sock_addr(getpeername6)]
    pub fn getpeername6(ctx: SockAddrContext) -> i32 {
        if let Some(orig) = original(&ctx) {
            // SAFETY: as in connect4.
            let sa = unsafe { &mut *ctx.sock_addr };
            sa.user_ip6[3] = orig.addr;
            sa.user_port = u32::from(orig.port);
            count(Counter::PeerNameRestored);
        }
        ALLOW
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
