//! The datapath's errors: one level of context over aya's and the kernel's.

use std::{io, net::SocketAddr, path::PathBuf};

use aya::{maps::MapError, programs::ProgramError};

/// Errors from loading programs, attaching them, or updating their maps.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("loading the eBPF object into the kernel")]
    Load(#[source] aya::EbpfError),
    #[error("eBPF object has no program {0:?}")]
    MissingProgram(&'static str),
    #[error("eBPF object has no map {0:?}")]
    MissingMap(&'static str),
    #[error("the programs' log ring buffer")]
    Logs(#[source] aya_log::Error),
    #[error("program {name:?}")]
    Program {
        name: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error("map {name:?}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error(
        "refusing to attach to {}: not a child cgroup below the cgroup v2 root (the root \
         would redirect every process on the machine)",
        path.display()
    )]
    NotChildCgroup { path: PathBuf },
    #[error("opening cgroup {}", path.display())]
    OpenCgroup {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("finding this process's cgroup v2 directory ({what})")]
    OwnCgroup {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the cgroup exclusion map is full ({capacity} cgroups); {} is not excluded", path.display())]
    ExcludedCgroupsFull { path: PathBuf, capacity: u32 },
    #[error("reading CLOCK_MONOTONIC")]
    Clock(#[source] io::Error),
    #[error("enabling eBPF run time statistics")]
    Stats(#[source] io::Error),
    #[error("redirect map is full ({capacity} Service addresses); {addr} is not redirected")]
    RedirectMapFull { addr: SocketAddr, capacity: u32 },
    #[error("{service} cannot be redirected to {target}, an address of the other family")]
    FamilyMismatch {
        service: SocketAddr,
        target: SocketAddr,
    },
}
