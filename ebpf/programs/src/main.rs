//! skewless's kernel programs.
//!
//! `connect4` runs on every IPv4 `connect()` from a process in the cgroup it is attached to
//! (a pod's cgroup, never the root). If the destination is an opted-in Service VIP:port listed
//! in `REDIRECT4`, the destination is rewritten to the node balancer's listener. Anything else
//! — another port, another address, UDP, an unreadable context — passes untouched: every error
//! path returns "allow", so a fault here can never break a connection (fail open).
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

#[cfg(target_arch = "bpf")]
mod programs {
    use aya_ebpf::{
        macros::{cgroup_sock_addr, map},
        maps::{HashMap, PerCpuArray},
        programs::SockAddrContext,
    };
    use skewless_common::{COUNTERS_LEN, Counter, REDIRECT4_CAPACITY, Redirect4, ServiceKey4};

    /// Verdict for cgroup sock_addr programs: 1 lets the syscall proceed (with whatever address
    /// the program left in the context). 0 would fail it with EPERM; skewless never does that.
    const ALLOW: i32 = 1;
    const SOCK_STREAM: u32 = 1;

    #[map(name = "REDIRECT4")]
    static REDIRECT4: HashMap<ServiceKey4, Redirect4> =
        HashMap::with_max_entries(REDIRECT4_CAPACITY, 0);

    #[map(name = "COUNTERS")]
    static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTERS_LEN, 0);

    #[inline(always)]
    fn count(counter: Counter) {
        if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
            // SAFETY: the slot belongs to this CPU's copy of the array and BPF programs are
            // not preempted by another program on the same CPU for cgroup hooks, so this plain
            // add cannot race.
            unsafe { *slot += 1 };
        }
    }

    #[cgroup_sock_addr(connect4)]
    pub fn connect4(ctx: SockAddrContext) -> i32 {
        match try_connect4(&ctx) {
            Ok(verdict) | Err(verdict) => verdict,
        }
    }

    #[inline(always)]
    fn try_connect4(ctx: &SockAddrContext) -> Result<i32, i32> {
        count(Counter::Connect4Seen);
        // SAFETY: `sock_addr` is the kernel-provided context pointer, valid for the whole
        // program run; the verifier checks every field access against bpf_sock_addr.
        let sa = unsafe { &mut *ctx.sock_addr };
        if sa.type_ != SOCK_STREAM {
            return Ok(ALLOW);
        }
        let key = ServiceKey4::new(sa.user_ip4, sa.user_port as u16);
        // SAFETY: the value is copied out before the map can change under us.
        let Some(target) = (unsafe { REDIRECT4.get(key) }).copied() else {
            return Ok(ALLOW);
        };
        if target.enabled == 0 {
            count(Counter::Connect4Disabled);
            return Ok(ALLOW);
        }
        sa.user_ip4 = target.addr;
        sa.user_port = u32::from(target.port);
        count(Counter::Connect4Redirected);
        Ok(ALLOW)
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
