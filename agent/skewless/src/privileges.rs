//! Why loading the eBPF programs was refused: missing capabilities, or a seccomp filter that
//! blocks `bpf(2)` although the capabilities are there (the default profile of podman and
//! CRI-O allows `bpf` only with CAP_SYS_ADMIN).
//!
//! Reads this process's `/proc/self/status` (`CapEff`, `Seccomp`) only after a failure; the
//! diagnosis never changes what the agent does, only what its error says.

/// Capability numbers (linux/capability.h).
const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_BPF: u32 = 39;

/// What `/proc/self/status` says about this process's privileges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Privileges {
    /// The effective capability set.
    pub cap_eff: u64,
    /// 0: no seccomp, 1: strict, 2: a filter.
    pub seccomp: u8,
}

impl Privileges {
    /// This process's, if `/proc/self/status` can be read.
    pub fn of_this_process() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/self/status").ok()?)
    }

    fn parse(status: &str) -> Option<Self> {
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
        };
        Some(Self {
            cap_eff: u64::from_str_radix(field("CapEff:")?, 16).ok()?,
            seccomp: field("Seccomp:").and_then(|s| s.parse().ok()).unwrap_or(0),
        })
    }

    fn has(self, cap: u32) -> bool {
        self.cap_eff & (1 << cap) != 0
    }

    /// CAP_SYS_ADMIN, or CAP_BPF with CAP_NET_ADMIN: what loading the programs needs.
    fn can_load(self) -> bool {
        self.has(CAP_SYS_ADMIN) || (self.has(CAP_BPF) && self.has(CAP_NET_ADMIN))
    }
}

/// Whether `error` (any level of its chain) is the kernel's EPERM.
pub fn is_eperm(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.raw_os_error() == Some(libc::EPERM))
            || e.to_string().contains("Operation not permitted")
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// The context for a failure to load the programs: names seccomp when the capabilities are
/// present, a filter is active and the kernel said EPERM.
pub fn load_failure_context(eperm: bool, privileges: Option<Privileges>) -> String {
    match privileges {
        Some(p) if eperm && p.can_load() && p.seccomp == 2 => {
            "loading the eBPF programs: bpf(2) was refused (EPERM) although this process has \
             CAP_BPF and CAP_NET_ADMIN, and a seccomp filter is active (Seccomp: 2 in \
             /proc/self/status): the container runtime's seccomp profile blocks bpf(2) (the \
             default profile of podman and CRI-O allows it only with CAP_SYS_ADMIN); run the \
             agent with seccompProfile Unconfined, as deploy/daemonset.yaml does, or a profile \
             that allows bpf"
                .to_owned()
        }
        Some(p) if !p.can_load() => format!(
            "loading the eBPF programs (needs root or CAP_BPF+CAP_NET_ADMIN; this process has \
             CapEff {:016x}: CAP_BPF {}, CAP_NET_ADMIN {})",
            p.cap_eff,
            if p.has(CAP_BPF) { "yes" } else { "no" },
            if p.has(CAP_NET_ADMIN) { "yes" } else { "no" },
        ),
        // The capabilities are there and it is not seccomp: the kernel refused a program
        // itself, most often its verifier (whose log is in the error's chain).
        Some(_) => "loading the eBPF programs: the kernel refused a program although this \
                    process has CAP_BPF and CAP_NET_ADMIN (the verifier's log follows)"
            .to_owned(),
        None => "loading the eBPF programs (needs root or CAP_BPF+CAP_NET_ADMIN)".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BPF_NET_ADMIN: u64 = (1 << CAP_BPF) | (1 << CAP_NET_ADMIN);

    #[test]
    fn status_lines_parse() {
        let status =
            "Name:\tskewless\nCapEff:\t000000c000001000\nSeccomp:\t2\nSeccomp_filters:\t1\n";
        assert_eq!(
            Privileges::parse(status),
            Some(Privileges {
                cap_eff: 0x0000_00c0_0000_1000,
                seccomp: 2
            })
        );
        assert!(Privileges::parse(status).unwrap().can_load());
        assert_eq!(Privileges::parse("Name:\tx\n"), None);
    }

    #[test]
    fn eperm_with_the_capabilities_under_a_seccomp_filter_names_seccomp() {
        let filtered = Privileges {
            cap_eff: BPF_NET_ADMIN,
            seccomp: 2,
        };
        let msg = load_failure_context(true, Some(filtered));
        assert!(
            msg.contains("seccomp") && msg.contains("Unconfined"),
            "{msg}"
        );
        // No filter, or not EPERM: not seccomp's doing.
        let unfiltered = Privileges {
            seccomp: 0,
            ..filtered
        };
        assert!(!load_failure_context(true, Some(unfiltered)).contains("seccomp"));
        assert!(!load_failure_context(false, Some(filtered)).contains("seccomp"));
        // Missing capabilities say which.
        let no_bpf = Privileges {
            cap_eff: 1 << CAP_NET_ADMIN,
            seccomp: 2,
        };
        let msg = load_failure_context(true, Some(no_bpf));
        assert!(
            msg.contains("CAP_BPF no") && msg.contains("CAP_NET_ADMIN yes"),
            "{msg}"
        );
        // With the capabilities and no seccomp refusal, the error sends nobody after them.
        let msg = load_failure_context(false, Some(filtered));
        assert!(
            msg.contains("kernel refused a program") && !msg.contains("needs root"),
            "{msg}"
        );
    }

    #[test]
    fn eperm_is_found_at_any_level_of_the_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] std::io::Error);
        assert!(is_eperm(&Outer(std::io::Error::from_raw_os_error(
            libc::EPERM
        ))));
        assert!(!is_eperm(&Outer(std::io::Error::from_raw_os_error(
            libc::ENOENT
        ))));
    }
}
