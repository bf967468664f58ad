//! skewless's datapath: loads the eBPF programs built from `ebpf/programs`, attaches them to
//! pod cgroups and owns the maps that say which Service addresses are redirected where.
//!
//! This is the only crate of the agent that talks to the kernel's BPF side (conntrack is read
//! through `skewless-conntrack`). It owns the programs' lifetime and every map; it holds no
//! policy: which Services are redirected, and when, is the agent's reconciler's business, and
//! it never touches a cgroup it was not given — [`Datapath::attach`] refuses the root of a
//! hierarchy, which would put every process on the machine behind the hooks.
//!
//! Attachments use bpf_link, so they live exactly as long as the [`Datapath`] (and the
//! process) does: if the agent dies, the kernel detaches every program and new connections go
//! straight to the Service again — the fail-open behaviour skewless promises.
//!
//! - [`Datapath::load`]: the programs and their maps (`programs.rs`); nothing attached yet.
//! - [`Datapath::attach`] / [`Datapath::detach`]: per cgroup, all or nothing (`attach.rs`).
//! - [`Datapath::set_redirect`] and friends: the redirect maps, one generic path for IPv4 and
//!   IPv6 (`redirect.rs`, byte order in `wire.rs`).
//! - [`Datapath::exclude_cgroup`]: cgroups never redirected, the agent's own ([`own_cgroup`],
//!   `exclude.rs`).
//! - [`Datapath::beat`]: the heartbeat the hooks need fresh to redirect (`heartbeat.rs`).
//! - [`Datapath::counters`]: the programs' counters, one value per [`Counter`].
//! - [`Datapath::take_logs`]: the programs' log lines about their rare failures, to forward
//!   into the agent's tracing (`logs.rs`).
//! - [`Datapath::connections`]: every client TCP connection of the attached pods, IPv4 and
//!   IPv6 (`sock_ops`, with a `cgroup_skb` ingress program keeping byte counts live);
//!   [`conntrack`] resolves the backend each one is pinned to when a DNAT hides it.
//!
//! All of it is safe Rust: the unsafe parts are in aya and in the programs themselves.
#![forbid(unsafe_code)]

mod attach;
mod connections;
pub mod conntrack;
mod counters;
mod error;
mod exclude;
mod heartbeat;
mod logs;
mod programs;
mod redirect;
mod wire;

use std::net::{SocketAddrV4, SocketAddrV6};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray},
};
use skewless_common::{
    BPF_EXIST, CONNS_MAP, COUNTERS_MAP, Conn, EXCLUDED_CGROUPS_MAP, HEARTBEAT_MAP,
    INSERT_FLAGS_MAP, REDIRECT4_CAPACITY, REDIRECT4_MAP, REDIRECT6_CAPACITY, REDIRECT6_MAP,
};
use tracing::info;

pub use attach::{Attachment, ensure_child_cgroup};
pub use connections::Connection;
pub use counters::{Counter, Counters};
pub use error::Error;
pub use exclude::own_cgroup;
pub use logs::ProgramLogs;
pub use programs::{ProgramStats, enable_stats};

use crate::{programs::take_map, redirect::RedirectMap};

/// The loaded programs and their maps.
pub struct Datapath {
    ebpf: Ebpf,
    redirect4: RedirectMap<SocketAddrV4>,
    redirect6: RedirectMap<SocketAddrV6>,
    heartbeat: Array<MapData, u64>,
    counters: PerCpuArray<MapData, u64>,
    conns: HashMap<MapData, u64, Conn>,
    excluded: HashMap<MapData, u64, u32>,
    insert_flags: Array<MapData, u64>,
    /// Until [`Datapath::take_logs`]; taken from the object before the programs load.
    logs: Option<ProgramLogs>,
}

impl std::fmt::Debug for Datapath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Datapath").finish_non_exhaustive()
    }
}

impl Datapath {
    /// Loads the programs and creates their maps. Nothing is attached yet, so this changes
    /// no traffic.
    ///
    /// # Errors
    /// When the kernel refuses the object (no privileges, verifier rejection).
    pub fn load() -> Result<Self, Error> {
        // `EbpfLoader::new()` parses the kernel's BTF (/sys/kernel/btf/vmlinux, ~9 MiB of
        // types here) for CO-RE relocations; aya 0.14's `Ebpf::load` then parses it a second
        // time while the first copy is still alive, which made the agent's peak RSS (18.9 MiB
        // of it, in heaptrack). One parse.
        let mut ebpf = EbpfLoader::new()
            .load(programs::OBJECT)
            .map_err(Error::Load)?;
        // Before the programs load: they refer to the log map, which must stay open.
        let logs = ProgramLogs::take(&mut ebpf)?;
        programs::load_all(&mut ebpf)?;
        let redirect4 = RedirectMap::take(&mut ebpf, REDIRECT4_MAP, REDIRECT4_CAPACITY)?;
        let redirect6 = RedirectMap::take(&mut ebpf, REDIRECT6_MAP, REDIRECT6_CAPACITY)?;
        let heartbeat = take_map(&mut ebpf, HEARTBEAT_MAP)?;
        let counters = take_map(&mut ebpf, COUNTERS_MAP)?;
        let conns = take_map(&mut ebpf, CONNS_MAP)?;
        let excluded = take_map(&mut ebpf, EXCLUDED_CGROUPS_MAP)?;
        let insert_flags = take_map(&mut ebpf, INSERT_FLAGS_MAP)?;
        info!("eBPF programs loaded");
        Ok(Self {
            ebpf,
            redirect4,
            redirect6,
            heartbeat,
            counters,
            conns,
            excluded,
            insert_flags,
            logs: Some(logs),
        })
    }

    /// The reader of the programs' log lines (once; `None` after): forward them with
    /// [`ProgramLogs::drain`] whenever its file descriptor is readable.
    pub fn take_logs(&mut self) -> Option<ProgramLogs> {
        self.logs.take()
    }

    /// For tests of the failure paths: from now on the programs insert their records
    /// (`ORIGDST`, `ORIGDST6`, `CONNS`) with `BPF_EXIST`, so the kernel refuses every new
    /// socket's record (ENOENT), as it would a failing update; connects still go through
    /// (redirected, fail open for getpeername) and go unobserved.
    ///
    /// # Errors
    /// When the map cannot be written.
    pub fn provoke_insert_failures(&mut self) -> Result<(), Error> {
        self.insert_flags
            .set(0, BPF_EXIST, 0)
            .map_err(|source| Error::Map {
                name: INSERT_FLAGS_MAP,
                source,
            })
    }
}
