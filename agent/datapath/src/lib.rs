//! skewless's datapath: loads the eBPF programs built from `ebpf/programs`, attaches them to
//! pod cgroups and owns the maps that say which Service addresses are redirected where.
//!
//! This is the only crate of the agent that talks to the kernel. Attachments use bpf_link, so
//! they live exactly as long as the [`Datapath`] (and the process) does: if the agent dies, the
//! kernel detaches every program and new connections go straight to the Service again — the
//! fail-open behaviour skewless promises.
//!
//! The same attachment observes every client TCP connection of the pod, IPv4 and IPv6
//! (`sock_ops`, with a `cgroup_skb` ingress program keeping byte counts live):
//! [`Datapath::connections`] dumps them, and [`conntrack`] resolves the backend each one is
//! pinned to when a DNAT hides it from the socket.

pub mod conntrack;

use std::{
    fs::File,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData, PerCpuArray},
    programs::{
        CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSockAddr, ProgramError, SockOps,
        cgroup_skb::CgroupSkbLinkId, cgroup_sock_addr::CgroupSockAddrLinkId,
        sock_ops::SockOpsLinkId,
    },
};
pub use skewless_common::Counter;
use skewless_common::{
    CONNS_MAP, COUNTERS_LEN, COUNTERS_MAP, Conn, FAMILY_INET6, HEARTBEAT_MAP, REDIRECT4_CAPACITY,
    REDIRECT4_MAP, REDIRECT6_CAPACITY, REDIRECT6_MAP, Redirect4, Redirect6, ServiceKey4,
    ServiceKey6,
};
use tracing::{debug, info};

/// The programs' ELF object, built by `build.rs` from `ebpf/programs`.
static PROGRAMS: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/skewless-ebpf"));

/// The cgroup sock_addr programs, all attached to every pod cgroup.
const SOCK_ADDR_PROGRAMS: [&str; 4] = ["connect4", "connect6", "getpeername4", "getpeername6"];
/// The sock_ops program that records client connections, attached next to them.
const SOCK_OPS_PROGRAM: &str = "sock_ops";
/// The cgroup_skb ingress program that keeps recorded connections' byte counts current.
const INGRESS_PROGRAM: &str = "conn_ingress";

/// Errors from loading programs, attaching them, or updating their maps.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("loading the eBPF object into the kernel")]
    Load(#[source] aya::EbpfError),
    #[error("eBPF object has no program {0:?}")]
    MissingProgram(&'static str),
    #[error("eBPF object has no map {0:?}")]
    MissingMap(&'static str),
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
        source: aya::maps::MapError,
    },
    #[error("opening cgroup {path}")]
    OpenCgroup {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("reading CLOCK_MONOTONIC")]
    Clock(#[source] std::io::Error),
    #[error("enabling eBPF run time statistics")]
    Stats(#[source] std::io::Error),
    #[error("redirect map is full ({capacity} Service addresses); {addr} is not redirected")]
    RedirectMapFull { addr: SocketAddrV4, capacity: u32 },
    #[error("IPv6 redirect map is full ({capacity} Service addresses); {addr} is not redirected")]
    Redirect6MapFull { addr: SocketAddrV6, capacity: u32 },
    #[error("{service} cannot be redirected to {target}, an address of the other family")]
    FamilyMismatch {
        service: SocketAddr,
        target: SocketAddr,
    },
}

/// A handle to one cgroup attachment; pass it back to [`Datapath::detach`].
#[derive(Debug)]
pub struct Attachment {
    cgroup: PathBuf,
    links: Vec<(&'static str, CgroupSockAddrLinkId)>,
    sock_ops: SockOpsLinkId,
    ingress: CgroupSkbLinkId,
}

impl Attachment {
    #[must_use]
    pub fn cgroup(&self) -> &Path {
        &self.cgroup
    }
}

/// Kernel-side counters, summed over CPUs: one value per [`Counter`], so a new counter is a
/// line in `skewless-common` and nothing here. Index it with a [`Counter`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Counters([u64; COUNTERS_LEN as usize]);

impl Counters {
    /// Every counter with its value, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (Counter, u64)> + '_ {
        Counter::ALL.into_iter().zip(self.0)
    }
}

impl Default for Counters {
    fn default() -> Self {
        Self([0; COUNTERS_LEN as usize])
    }
}

impl std::ops::Index<Counter> for Counters {
    type Output = u64;

    fn index(&self, counter: Counter) -> &u64 {
        &self.0[counter.index() as usize]
    }
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.iter().map(|(c, v)| (c.name(), v)))
            .finish()
    }
}

/// One client TCP connection from an attached cgroup, as its socket sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Connection {
    /// The socket cookie: unique per socket for the kernel's uptime.
    pub cookie: u64,
    /// The pod's address and port (IPv4 also for a dual-stack socket talking to an
    /// IPv4-mapped address).
    pub local: SocketAddr,
    /// The address the socket is connected to: the Service VIP under DNAT, the backend pod
    /// under socket-level load balancing, the balancer's listener when redirected.
    pub remote: SocketAddr,
    /// The Service address a redirected socket asked for; `None` when not redirected.
    pub redirected_from: Option<SocketAddr>,
    /// Last TCP state seen (`BPF_TCP_*`: 1 established, 7 close).
    pub state: u32,
    /// CLOCK_MONOTONIC time the connection was established.
    pub opened: std::time::Duration,
    /// CLOCK_MONOTONIC time it closed; `None` while open.
    pub closed: Option<std::time::Duration>,
    /// Bytes the client sent that the peer acknowledged (refreshed on every RTT sample,
    /// state change and received packet; final once closed).
    pub bytes_sent: u64,
    /// Bytes the client received (refreshed like `bytes_sent`).
    pub bytes_received: u64,
}

impl Connection {
    fn from_record(cookie: u64, c: &Conn) -> Self {
        let v6 = c.family == FAMILY_INET6;
        let addr = |words: [u32; 4], port: u16| -> SocketAddr {
            if v6 {
                SocketAddr::V6(SocketAddrV6::new(ip6_of_words(words), port, 0, 0))
            } else {
                SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(words[0])),
                    port,
                ))
            }
        };
        Self {
            cookie,
            local: addr(c.local_addr, c.local_port),
            remote: addr(c.remote_addr, c.remote_port),
            redirected_from: (c.orig_addr != [0; 4] || c.orig_port != 0)
                .then(|| addr(c.orig_addr, c.orig_port)),
            state: c.state,
            opened: std::time::Duration::from_nanos(c.opened_ns),
            closed: (c.closed_ns != 0).then(|| std::time::Duration::from_nanos(c.closed_ns)),
            bytes_sent: c.bytes_acked,
            bytes_received: c.bytes_received,
        }
    }
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

/// The loaded programs and their maps.
pub struct Datapath {
    ebpf: Ebpf,
    redirect4: HashMap<MapData, ServiceKey4, Redirect4>,
    redirect6: HashMap<MapData, ServiceKey6, Redirect6>,
    heartbeat: Array<MapData, u64>,
    counters: PerCpuArray<MapData, u64>,
    conns: HashMap<MapData, u64, Conn>,
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
        let mut ebpf = Ebpf::load(PROGRAMS).map_err(Error::Load)?;
        for name in SOCK_ADDR_PROGRAMS {
            sock_addr_program(&mut ebpf, name)?
                .load()
                .map_err(|source| Error::Program { name, source })?;
        }
        sock_ops_program(&mut ebpf)?
            .load()
            .map_err(|source| Error::Program {
                name: SOCK_OPS_PROGRAM,
                source,
            })?;
        ingress_program(&mut ebpf)?
            .load()
            .map_err(|source| Error::Program {
                name: INGRESS_PROGRAM,
                source,
            })?;
        let redirect4 = take_map(&mut ebpf, REDIRECT4_MAP)?;
        let redirect6 = take_map(&mut ebpf, REDIRECT6_MAP)?;
        let heartbeat = take_map(&mut ebpf, HEARTBEAT_MAP)?;
        let counters = take_map(&mut ebpf, COUNTERS_MAP)?;
        let conns = take_map(&mut ebpf, CONNS_MAP)?;
        info!("eBPF programs loaded");
        Ok(Self {
            ebpf,
            redirect4,
            redirect6,
            heartbeat,
            counters,
            conns,
        })
    }

    /// Attaches the socket hooks to the cgroup v2 directory `cgroup` (a pod's cgroup — never
    /// the root of the hierarchy, which would affect the whole machine).
    ///
    /// # Errors
    /// When the cgroup cannot be opened or the kernel refuses the attachment.
    pub fn attach(&mut self, cgroup: &Path) -> Result<Attachment, Error> {
        let file = File::open(cgroup).map_err(|source| Error::OpenCgroup {
            path: cgroup.to_owned(),
            source,
        })?;
        let mut links = Vec::with_capacity(SOCK_ADDR_PROGRAMS.len());
        for name in SOCK_ADDR_PROGRAMS {
            let attached = sock_addr_program(&mut self.ebpf, name).and_then(|p| {
                p.attach(&file, CgroupAttachMode::Single)
                    .map_err(|source| Error::Program { name, source })
            });
            match attached {
                Ok(link) => links.push((name, link)),
                Err(e) => {
                    // All or nothing: a pod with connect4 but no getpeername4 would see the
                    // balancer's address as its peer.
                    if let Err(undo) = self.detach_links(links) {
                        tracing::warn!(error = %undo, "undoing a partial attachment");
                    }
                    return Err(e);
                }
            }
        }
        let sock_ops = sock_ops_program(&mut self.ebpf).and_then(|p| {
            p.attach(&file, CgroupAttachMode::Single)
                .map_err(|source| Error::Program {
                    name: SOCK_OPS_PROGRAM,
                    source,
                })
        });
        let sock_ops = match sock_ops {
            Ok(link) => link,
            Err(e) => {
                if let Err(undo) = self.detach_links(links) {
                    tracing::warn!(error = %undo, "undoing a partial attachment");
                }
                return Err(e);
            }
        };
        let ingress = ingress_program(&mut self.ebpf).and_then(|p| {
            p.attach(
                &file,
                CgroupSkbAttachType::Ingress,
                CgroupAttachMode::Single,
            )
            .map_err(|source| Error::Program {
                name: INGRESS_PROGRAM,
                source,
            })
        });
        let ingress = match ingress {
            Ok(link) => link,
            Err(e) => {
                if let Err(undo) = self.detach_observers(sock_ops, None) {
                    tracing::warn!(error = %undo, "undoing a partial attachment");
                }
                if let Err(undo) = self.detach_links(links) {
                    tracing::warn!(error = %undo, "undoing a partial attachment");
                }
                return Err(e);
            }
        };
        debug!(cgroup = %cgroup.display(), "attached");
        Ok(Attachment {
            cgroup: cgroup.to_owned(),
            links,
            sock_ops,
            ingress,
        })
    }

    /// Detaches the hooks from one cgroup.
    ///
    /// # Errors
    /// When the attachment is unknown to the program.
    pub fn detach(&mut self, attachment: Attachment) -> Result<(), Error> {
        let Attachment {
            cgroup,
            links,
            sock_ops,
            ingress,
        } = attachment;
        let observed = self.detach_observers(sock_ops, Some(ingress));
        // Detach the redirect hooks even if the observer could not be detached.
        self.detach_links(links)?;
        observed?;
        debug!(cgroup = %cgroup.display(), "detached");
        Ok(())
    }

    /// Makes the next connect() to `service` from an attached cgroup go to `target` instead.
    ///
    /// # Errors
    /// When the map is full (the entry is not added and the Service stays plain L4) or the
    /// update fails.
    pub fn set_redirect(
        &mut self,
        service: SocketAddrV4,
        target: SocketAddrV4,
    ) -> Result<(), Error> {
        let key = service_key(service);
        let value = Redirect4 {
            addr: u32::from(*target.ip()).to_be(),
            port: target.port().to_be(),
            _pad: 0,
            enabled: 1,
        };
        self.redirect4.insert(key, value, 0).map_err(|source| {
            if is_full(&source) {
                Error::RedirectMapFull {
                    addr: service,
                    capacity: REDIRECT4_CAPACITY,
                }
            } else {
                Error::Map {
                    name: REDIRECT4_MAP,
                    source,
                }
            }
        })?;
        debug!(%service, %target, "redirect set");
        Ok(())
    }

    /// Stops redirecting `service`; the next connect() goes through the VIP as before.
    /// Removing an address that is not redirected is not an error.
    ///
    /// # Errors
    /// When the kernel refuses the deletion for another reason than a missing key.
    pub fn remove_redirect(&mut self, service: SocketAddrV4) -> Result<(), Error> {
        match self.redirect4.remove(&service_key(service)) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {
                debug!(%service, "redirect removed");
                Ok(())
            }
            Err(source) => Err(Error::Map {
                name: REDIRECT4_MAP,
                source,
            }),
        }
    }

    /// The redirect entries currently in the kernel map, as (service, target) pairs.
    #[must_use]
    pub fn redirects(&self) -> Vec<(SocketAddrV4, SocketAddrV4)> {
        self.redirect4
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, v)| v.enabled != 0)
            .map(|(k, v)| (socket_addr(k.addr, k.port), socket_addr(v.addr, v.port)))
            .collect()
    }

    /// Makes the next connect() to the native IPv6 Service address `service` from an attached
    /// cgroup go to `target` instead (an IPv6 listener of the balancer). IPv4 Services, also
    /// when reached through IPv4-mapped addresses, use [`Datapath::set_redirect`].
    ///
    /// # Errors
    /// When the map is full (the entry is not added and the Service stays plain L4) or the
    /// update fails.
    pub fn set_redirect6(
        &mut self,
        service: SocketAddrV6,
        target: SocketAddrV6,
    ) -> Result<(), Error> {
        let key = service_key6(service);
        let value = Redirect6 {
            addr: words_be(*target.ip()),
            port: target.port().to_be(),
            _pad: 0,
            enabled: 1,
        };
        self.redirect6.insert(key, value, 0).map_err(|source| {
            if is_full(&source) {
                Error::Redirect6MapFull {
                    addr: service,
                    capacity: REDIRECT6_CAPACITY,
                }
            } else {
                Error::Map {
                    name: REDIRECT6_MAP,
                    source,
                }
            }
        })?;
        debug!(%service, %target, "IPv6 redirect set");
        Ok(())
    }

    /// Stops redirecting the native IPv6 Service address `service`. Removing an address that
    /// is not redirected is not an error.
    ///
    /// # Errors
    /// When the kernel refuses the deletion for another reason than a missing key.
    pub fn remove_redirect6(&mut self, service: SocketAddrV6) -> Result<(), Error> {
        match self.redirect6.remove(&service_key6(service)) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {
                debug!(%service, "IPv6 redirect removed");
                Ok(())
            }
            Err(source) => Err(Error::Map {
                name: REDIRECT6_MAP,
                source,
            }),
        }
    }

    /// The IPv6 redirect entries currently in the kernel map, as (service, target) pairs.
    #[must_use]
    pub fn redirects6(&self) -> Vec<(SocketAddrV6, SocketAddrV6)> {
        self.redirect6
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, v)| v.enabled != 0)
            .map(|(k, v)| (socket_addr6(k.addr, k.port), socket_addr6(v.addr, v.port)))
            .collect()
    }

    /// Records that the agent is alive now. Once a heartbeat has been written, the hooks only
    /// redirect while it stays fresh (younger than `HEARTBEAT_STALE_NS`), so the caller must
    /// keep beating (the agent does every 200 ms) from the part of the program whose hang
    /// should stop redirects.
    ///
    /// # Errors
    /// When the clock or the map cannot be read or written.
    pub fn beat(&mut self) -> Result<(), Error> {
        let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
            .map_err(|e| Error::Clock(std::io::Error::from(e)))?;
        let ns = u64::try_from(now.tv_sec()).unwrap_or(0) * 1_000_000_000
            + u64::try_from(now.tv_nsec()).unwrap_or(0);
        self.heartbeat.set(0, ns, 0).map_err(|source| Error::Map {
            name: HEARTBEAT_MAP,
            source,
        })
    }

    /// Reads the kernel counters, summed over CPUs.
    ///
    /// # Errors
    /// When the counter map cannot be read.
    pub fn counters(&self) -> Result<Counters, Error> {
        let mut counters = Counters::default();
        for counter in Counter::ALL {
            let per_cpu = self
                .counters
                .get(&counter.index(), 0)
                .map_err(|source| Error::Map {
                    name: COUNTERS_MAP,
                    source,
                })?;
            counters.0[counter.index() as usize] = per_cpu.iter().sum();
        }
        Ok(counters)
    }

    /// The client connections recorded by the `sock_ops` program: open ones and closed ones
    /// the LRU map has not evicted yet (closed records stay until [`Datapath::forget`] or
    /// eviction, so a dump after a close still sees the final byte counts).
    ///
    /// Entries that disappear while the map is walked are skipped, so a dump is a best-effort
    /// snapshot, never an error.
    #[must_use]
    pub fn connections(&self) -> Vec<Connection> {
        self.conns
            .iter()
            .filter_map(Result::ok)
            .map(|(cookie, c)| Connection::from_record(cookie, &c))
            .collect()
    }

    /// Removes a connection record (for example a closed one the observer has accounted
    /// for). Removing an unknown cookie is not an error.
    ///
    /// # Errors
    /// When the kernel refuses the deletion for another reason than a missing key.
    pub fn forget(&mut self, cookie: u64) -> Result<(), Error> {
        match self.conns.remove(&cookie) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(source) => Err(Error::Map {
                name: CONNS_MAP,
                source,
            }),
        }
    }

    /// Cumulative run count and run time of one of the socket programs. The kernel only
    /// accumulates them while statistics are enabled (see [`enable_stats`]).
    ///
    /// # Errors
    /// When the program is unknown or its info cannot be read.
    pub fn program_stats(&mut self, name: &'static str) -> Result<ProgramStats, Error> {
        let info = sock_addr_program(&mut self.ebpf, name)?
            .info()
            .map_err(|source| Error::Program { name, source })?;
        Ok(ProgramStats {
            run_count: info.run_count(),
            run_time: info.run_time(),
        })
    }

    /// Detaches the observation programs (sock_ops, and cgroup_skb ingress if attached),
    /// reporting the first failure after trying both.
    fn detach_observers(
        &mut self,
        sock_ops: SockOpsLinkId,
        ingress: Option<CgroupSkbLinkId>,
    ) -> Result<(), Error> {
        let ops = sock_ops_program(&mut self.ebpf).and_then(|p| {
            p.detach(sock_ops).map_err(|source| Error::Program {
                name: SOCK_OPS_PROGRAM,
                source,
            })
        });
        let skb = match ingress {
            Some(link) => ingress_program(&mut self.ebpf).and_then(|p| {
                p.detach(link).map_err(|source| Error::Program {
                    name: INGRESS_PROGRAM,
                    source,
                })
            }),
            None => Ok(()),
        };
        ops.and(skb)
    }

    /// Detaches every link, reporting the first failure after trying all of them.
    fn detach_links(
        &mut self,
        links: Vec<(&'static str, CgroupSockAddrLinkId)>,
    ) -> Result<(), Error> {
        let mut first_err = None;
        for (name, link) in links {
            let res = sock_addr_program(&mut self.ebpf, name).and_then(|p| {
                p.detach(link)
                    .map_err(|source| Error::Program { name, source })
            });
            if let Err(e) = res {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

fn sock_addr_program<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut CgroupSockAddr, Error> {
    ebpf.program_mut(name)
        .ok_or(Error::MissingProgram(name))?
        .try_into()
        .map_err(|source| Error::Program { name, source })
}

fn sock_ops_program(ebpf: &mut Ebpf) -> Result<&mut SockOps, Error> {
    ebpf.program_mut(SOCK_OPS_PROGRAM)
        .ok_or(Error::MissingProgram(SOCK_OPS_PROGRAM))?
        .try_into()
        .map_err(|source| Error::Program {
            name: SOCK_OPS_PROGRAM,
            source,
        })
}

fn ingress_program(ebpf: &mut Ebpf) -> Result<&mut CgroupSkb, Error> {
    ebpf.program_mut(INGRESS_PROGRAM)
        .ok_or(Error::MissingProgram(INGRESS_PROGRAM))?
        .try_into()
        .map_err(|source| Error::Program {
            name: INGRESS_PROGRAM,
            source,
        })
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, Error>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(Error::MissingMap(name))?;
    T::try_from(map).map_err(|source| Error::Map { name, source })
}

fn service_key(addr: SocketAddrV4) -> ServiceKey4 {
    ServiceKey4::new(u32::from(*addr.ip()).to_be(), addr.port().to_be())
}

fn socket_addr(addr_be: u32, port_be: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::from(u32::from_be(addr_be)), u16::from_be(port_be))
}

fn service_key6(addr: SocketAddrV6) -> ServiceKey6 {
    ServiceKey6::new(words_be(*addr.ip()), addr.port().to_be())
}

/// The address as `bpf_sock_addr.user_ip6` holds it: wire-order bytes, read as four words.
fn words_be(ip: Ipv6Addr) -> [u32; 4] {
    let o = ip.octets();
    core::array::from_fn(|i| {
        u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
    })
}

fn socket_addr6(addr: [u32; 4], port_be: u16) -> SocketAddrV6 {
    SocketAddrV6::new(ip6_of_words(addr), u16::from_be(port_be), 0, 0)
}

/// The inverse of [`words_be`].
fn ip6_of_words(addr: [u32; 4]) -> Ipv6Addr {
    let mut o = [0u8; 16];
    for (chunk, word) in o.chunks_exact_mut(4).zip(addr) {
        chunk.copy_from_slice(&word.to_ne_bytes());
    }
    Ipv6Addr::from(o)
}

fn is_full(err: &aya::maps::MapError) -> bool {
    matches!(
        err,
        aya::maps::MapError::SyscallError(e) if e.io_error.raw_os_error() == Some(libc_e2big())
    )
}

/// `E2BIG`: what the kernel returns when inserting a new key into a full hash map.
const fn libc_e2big() -> i32 {
    7
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_key_is_network_order() {
        let key = service_key("10.96.0.10:8080".parse().unwrap());
        assert_eq!(
            key.addr.to_ne_bytes(),
            [10, 96, 0, 10],
            "address bytes must be in wire order"
        );
        assert_eq!(
            key.port.to_ne_bytes(),
            8080u16.to_be_bytes(),
            "port must be in wire order"
        );
        assert_eq!(
            socket_addr(key.addr, key.port),
            "10.96.0.10:8080".parse().unwrap()
        );
    }

    #[test]
    fn service_key6_is_wire_order() {
        let addr: SocketAddrV6 = "[fd00:198:19::c613:a]:8080".parse().unwrap();
        let key = service_key6(addr);
        let bytes: Vec<u8> = key.addr.iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert_eq!(
            bytes,
            addr.ip().octets(),
            "address bytes must be in wire order"
        );
        assert_eq!(key.port.to_ne_bytes(), 8080u16.to_be_bytes());
        assert_eq!(socket_addr6(key.addr, key.port), addr);
    }

    #[test]
    fn counters_are_indexed_and_shown_by_name() {
        let mut c = Counters::default();
        c.0[Counter::StaleHeartbeat.index() as usize] = 3;
        assert_eq!(c[Counter::StaleHeartbeat], 3);
        assert_eq!(c[Counter::Connect4Seen], 0);
        assert_eq!(c.iter().count(), Counter::ALL.len());
        assert!(
            format!("{c:?}").contains("\"StaleHeartbeat\": 3"),
            "Debug names each counter: {c:?}"
        );
    }

    fn record(family: u32, local: [u32; 4], remote: [u32; 4], orig: [u32; 4]) -> Conn {
        Conn {
            local_addr: local,
            remote_addr: remote,
            orig_addr: orig,
            family,
            state: 1,
            local_port: 40000,
            remote_port: 8080,
            orig_port: if orig == [0; 4] { 0 } else { 50051 },
            _pad: 0,
            opened_ns: 1,
            closed_ns: 0,
            bytes_acked: 10,
            bytes_received: 20,
        }
    }

    #[test]
    fn records_of_both_families_become_socket_addresses() {
        let v4 = |a: &str| u32::from(a.parse::<Ipv4Addr>().unwrap()).to_be();
        let c = Connection::from_record(
            7,
            &record(
                skewless_common::FAMILY_INET,
                [v4("198.18.1.2"), 0, 0, 0],
                [v4("198.19.0.10"), 0, 0, 0],
                [0; 4],
            ),
        );
        assert_eq!(c.local, "198.18.1.2:40000".parse().unwrap());
        assert_eq!(c.remote, "198.19.0.10:8080".parse().unwrap());
        assert_eq!(c.redirected_from, None, "all-zero origin: not redirected");

        let v6 = |a: &str| words_be(a.parse().unwrap());
        let c = Connection::from_record(
            8,
            &record(
                FAMILY_INET6,
                v6("fd00:198:18:1::2"),
                v6("fd00:169:254::1"),
                v6("fd00:198:19::c613:a"),
            ),
        );
        assert_eq!(c.local, "[fd00:198:18:1::2]:40000".parse().unwrap());
        assert_eq!(c.remote, "[fd00:169:254::1]:8080".parse().unwrap());
        assert_eq!(
            c.redirected_from,
            Some("[fd00:198:19::c613:a]:50051".parse().unwrap()),
            "a redirected IPv6 socket keeps its Service address"
        );
        assert_eq!((c.bytes_sent, c.bytes_received), (10, 20));
    }
}
