//! The programs' ELF object and access to its programs and maps by name.

use aya::{
    Ebpf,
    programs::{CgroupSkb, CgroupSockAddr, Program, ProgramError, SockOps},
};

use crate::{Datapath, Error};

/// The programs' ELF object, built by `build.rs` from `ebpf/programs`.
pub(crate) static OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/skewless-ebpf"));

/// The cgroup sock_addr programs, all attached to every pod cgroup.
pub(crate) const SOCK_ADDR: [&str; 4] = ["connect4", "connect6", "getpeername4", "getpeername6"];
/// The sock_ops program that records client connections, attached next to them.
pub(crate) const SOCK_OPS: &str = "sock_ops";
/// The cgroup_skb ingress program that keeps recorded connections' byte counts current.
pub(crate) const INGRESS: &str = "conn_ingress";

/// Loads every program of `ebpf` into the kernel (the verifier runs here).
pub(crate) fn load_all(ebpf: &mut Ebpf) -> Result<(), Error> {
    for name in SOCK_ADDR {
        let loaded = program::<CgroupSockAddr>(ebpf, name)?.load();
        loaded.map_err(|source| Error::Program { name, source })?;
    }
    let loaded = program::<SockOps>(ebpf, SOCK_OPS)?.load();
    loaded.map_err(|source| Error::Program {
        name: SOCK_OPS,
        source,
    })?;
    let loaded = program::<CgroupSkb>(ebpf, INGRESS)?.load();
    loaded.map_err(|source| Error::Program {
        name: INGRESS,
        source,
    })
}

/// The program `name`, as the program type `P` it must be.
pub(crate) fn program<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P, Error>
where
    &'a mut P: TryFrom<&'a mut Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(Error::MissingProgram(name))?
        .try_into()
        .map_err(|source| Error::Program { name, source })
}

/// Takes the map `name` out of `ebpf` as the map type `T`.
pub(crate) fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, Error>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(Error::MissingMap(name))?;
    T::try_from(map).map_err(|source| Error::Map { name, source })
}

/// Cumulative statistics of one program, from the kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProgramStats {
    pub run_count: u64,
    pub run_time: std::time::Duration,
}

/// Turns on the kernel's per-program run time accounting (what `kernel.bpf_stats_enabled`
/// does) for as long as the returned descriptor is open. It costs a little on every program
/// run, so only benchmarks use it.
///
/// # Errors
/// When the kernel refuses (no privileges).
pub fn enable_stats() -> Result<std::os::fd::OwnedFd, Error> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime).map_err(|e| Error::Stats(e.io_error))
}

impl Datapath {
    /// Cumulative run count and run time of one of the socket programs. The kernel only
    /// accumulates them while statistics are enabled (see [`enable_stats`]).
    ///
    /// # Errors
    /// When the program is unknown or its info cannot be read.
    pub fn program_stats(&mut self, name: &'static str) -> Result<ProgramStats, Error> {
        let info = program::<CgroupSockAddr>(&mut self.ebpf, name)?
            .info()
            .map_err(|source| Error::Program { name, source })?;
        Ok(ProgramStats {
            run_count: info.run_count(),
            run_time: info.run_time(),
        })
    }
}
