//! The node plumbing the agent makes itself or finds: its balancer address, and the
//! kubelet's pod parent cgroup ([`pods_parent`]).
//!
//! The balancers listen on a node-local address (`--balancer-ip`, a /32 on `lo`). The agent
//! adds it when no interface of the node has it, labelled `lo:skewless` so it can tell its own
//! from one an operator configured, and holds a claim on it while it runs: a UDP socket bound
//! to the address's [`CLAIM_PORT`] with `SO_REUSEPORT`, which every agent on the node shares.
//!
//! Invariants:
//! - An address is removed only by the last agent that claims it, and only when an agent made
//!   it (the label; for IPv6, which has no labels, only when this process added it). Releasing
//!   first binds the claim port without `SO_REUSEPORT`: the kernel refuses that while any
//!   other agent holds its claim, and while this agent holds the port no new agent can claim
//!   it, so a successor starting during a rolling update never loses its address.
//! - A claimed address that disappears (removed by hand, or by a predecessor between a
//!   successor's add and claim) is added again by [`BalancerAddress::repair`], which the
//!   reconcile loop calls before every pass.

use std::{
    net::{IpAddr, SocketAddr, UdpSocket},
    path::{Path, PathBuf},
    time::Duration,
};

use futures::TryStreamExt as _;
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use tracing::{info, warn};

/// The label of an IPv4 balancer address the agent added (`ip addr` shows it).
pub const LABEL: &str = "lo:skewless";

/// The UDP port of the balancer address that running agents bind as their claim (the
/// discard port: nothing is ever sent there, and nothing read).
pub const CLAIM_PORT: u16 = 9;

/// How long starting agents wait for a predecessor that is releasing the address.
const CLAIM_RETRY_FOR: Duration = Duration::from_secs(10);

/// Why the balancer address cannot be set up or released.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("opening a route netlink socket")]
    Socket(#[source] std::io::Error),
    #[error("netlink: {what}")]
    Netlink {
        what: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("the node has no loopback interface `lo`")]
    NoLoopback,
    #[error("claiming {addr} (a UDP socket every agent on the node binds while it runs)")]
    Claim {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// One balancer address and this agent's claim on it.
struct Claimed {
    ip: IpAddr,
    /// This process added it (IPv6 addresses have no label to tell later).
    added: bool,
    claim: UdpSocket,
}

/// The balancer addresses this agent claims; release them with [`BalancerAddress::release`].
pub struct BalancerAddress {
    netlink: Netlink,
    claimed: Vec<Claimed>,
}

impl BalancerAddress {
    /// A route netlink connection and `lo`'s index, with nothing claimed yet.
    ///
    /// # Errors
    /// When the netlink socket cannot be opened or the node has no `lo`.
    pub async fn connect() -> Result<Self, Error> {
        let (connection, handle, _) = rtnetlink::new_connection().map_err(Error::Socket)?;
        tokio::spawn(connection);
        let lo = loopback_index(&handle).await?;
        Ok(Self {
            netlink: Netlink { handle, lo },
            claimed: Vec::new(),
        })
    }

    fn has(&self, ip: IpAddr) -> bool {
        self.claimed.iter().any(|c| c.ip == ip)
    }

    /// Makes sure `ip` is an address of the node, adding it to `lo` as /32 (/128) when no
    /// interface has it, and claims it.
    ///
    /// # Errors
    /// When netlink refuses (no CAP_NET_ADMIN, IPv6 off) or the claim cannot be bound
    /// within 10 s.
    async fn claim(&self, ip: IpAddr) -> Result<Claimed, Error> {
        let started = tokio::time::Instant::now();
        let mut added = false;
        loop {
            if self.find(ip).await?.is_empty() {
                self.add(ip).await?;
                info!(%ip, label = LABEL, "balancer address added to lo");
                added = true;
            }
            let addr = SocketAddr::new(ip, CLAIM_PORT);
            match bind_claim(addr, true) {
                Ok(claim) => return Ok(Claimed { ip, added, claim }),
                // A predecessor is releasing it (it holds the port alone for a moment), or
                // removed it between our check and our bind: look again.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EADDRINUSE | libc::EADDRNOTAVAIL)
                    ) && started.elapsed() < CLAIM_RETRY_FOR =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(source) => return Err(Error::Claim { addr, source }),
            }
        }
    }

    /// Adds back any claimed address that is no longer on the node.
    pub async fn repair(&self) {
        for c in &self.claimed {
            match self.find(c.ip).await {
                Ok(found) if found.is_empty() => match self.add(c.ip).await {
                    Ok(()) => {
                        warn!(ip = %c.ip, "balancer address was removed from the node; added it again")
                    }
                    Err(error) => {
                        warn!(ip = %c.ip, error = %error, "balancer address is gone and cannot be added")
                    }
                },
                Ok(_) => {}
                Err(error) => {
                    warn!(ip = %c.ip, error = %error, "cannot check the balancer address")
                }
            }
        }
    }

    /// Gives up the claims; removes each address that an agent made and no other agent
    /// claims. Call it once the balancers are drained.
    pub async fn release(self) {
        let Self { netlink, claimed } = self;
        for Claimed { ip, added, claim } in claimed {
            drop(claim);
            let addr = SocketAddr::new(ip, CLAIM_PORT);
            // Alone on the port, or another agent still holds its claim; holding it alone
            // keeps a new agent from claiming until the address is gone.
            let _exclusive = match bind_claim(addr, false) {
                Ok(sock) => sock,
                Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => {
                    info!(%ip, "balancer address kept: another agent on the node uses it");
                    continue;
                }
                Err(error) => {
                    warn!(%ip, %error, "balancer address kept: cannot tell whether another agent uses it");
                    continue;
                }
            };
            match netlink.remove_ours(ip, added).await {
                Ok(true) => info!(%ip, "balancer address removed from lo"),
                Ok(false) => info!(%ip, "balancer address kept: not made by an agent"),
                Err(error) => warn!(%ip, error = %error, "cannot remove the balancer address"),
            }
        }
    }

    async fn find(&self, ip: IpAddr) -> Result<Vec<AddressMessage>, Error> {
        Netlink::find_on(&self.netlink.handle, ip).await
    }

    async fn add(&self, ip: IpAddr) -> Result<(), Error> {
        let mut req = self
            .netlink
            .handle
            .address()
            .add(self.netlink.lo, ip, host_prefix(ip));
        if ip.is_ipv4() {
            req.message_mut()
                .attributes
                .push(AddressAttribute::Label(LABEL.to_owned()));
        }
        match req.execute().await {
            Ok(()) => Ok(()),
            // Added by another agent since we looked.
            Err(rtnetlink::Error::NetlinkError(e))
                if e.to_io().raw_os_error() == Some(libc::EEXIST) =>
            {
                Ok(())
            }
            Err(source) => Err(Error::Netlink {
                what: format!("adding {ip}/{} to lo", host_prefix(ip)),
                source,
            }),
        }
    }
}

/// A route netlink handle and the index of `lo`.
struct Netlink {
    handle: rtnetlink::Handle,
    lo: u32,
}

impl Netlink {
    /// Every address message of `ip`, on any interface.
    async fn find_on(handle: &rtnetlink::Handle, ip: IpAddr) -> Result<Vec<AddressMessage>, Error> {
        handle
            .address()
            .get()
            .set_address_filter(ip)
            .execute()
            .try_collect()
            .await
            .map_err(|source| Error::Netlink {
                what: format!("listing the node's addresses for {ip}"),
                source,
            })
    }

    /// Removes `ip` from `lo` if an agent made it: the label for IPv4, `added` (by this
    /// process) for IPv6. Whether it was removed.
    async fn remove_ours(&self, ip: IpAddr, added: bool) -> Result<bool, Error> {
        let mut removed = false;
        for msg in Self::find_on(&self.handle, ip).await? {
            let labelled = msg
                .attributes
                .iter()
                .any(|a| matches!(a, AddressAttribute::Label(l) if l == LABEL));
            let ours = msg.header.index == self.lo && if ip.is_ipv4() { labelled } else { added };
            if !ours {
                continue;
            }
            self.handle
                .address()
                .del(msg)
                .execute()
                .await
                .map_err(|source| Error::Netlink {
                    what: format!("removing {ip} from lo"),
                    source,
                })?;
            removed = true;
        }
        Ok(removed)
    }
}

fn host_prefix(ip: IpAddr) -> u8 {
    if ip.is_ipv4() { 32 } else { 128 }
}

async fn loopback_index(handle: &rtnetlink::Handle) -> Result<u32, Error> {
    let links: Vec<_> = handle
        .link()
        .get()
        .match_name("lo".to_owned())
        .execute()
        .try_collect()
        .await
        .map_err(|source| Error::Netlink {
            what: "looking up lo".to_owned(),
            source,
        })?;
    links
        .first()
        .map(|l| l.header.index)
        .ok_or(Error::NoLoopback)
}

/// A UDP socket on the claim port of a balancer address; `shared` sets `SO_REUSEPORT`.
fn bind_claim(addr: SocketAddr, shared: bool) -> std::io::Result<UdpSocket> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    socket.set_reuse_port(shared)?;
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

/// The balancer addresses of the agent's flags, claimed once they can be: what the agent and
/// its reconcile loop share.
pub struct BalancerAddresses {
    ips: Vec<IpAddr>,
    claimed: tokio::sync::Mutex<Option<BalancerAddress>>,
}

impl BalancerAddresses {
    pub fn new(ips: Vec<IpAddr>) -> Self {
        Self {
            ips,
            claimed: tokio::sync::Mutex::new(None),
        }
    }

    /// Claims each address not claimed yet (adding it when missing), and adds back any
    /// claimed one that was removed. A failure is logged and tried again on the next call;
    /// meanwhile the balancers of that address cannot bind, and their Services show as not
    /// served. Each address stands alone: one that fails leaves the others served.
    pub async fn ensure(&self) {
        let mut claimed = self.claimed.lock().await;
        if claimed.is_none() {
            match BalancerAddress::connect().await {
                Ok(address) => *claimed = Some(address),
                Err(error) => {
                    tracing::error!(error = %format!("{error:#}"), "cannot reach route netlink; the balancer address is not set up");
                    return;
                }
            }
        }
        let Some(address) = claimed.as_mut() else {
            return;
        };
        address.repair().await;
        for &ip in &self.ips {
            if address.has(ip) {
                continue;
            }
            match address.claim(ip).await {
                Ok(c) => address.claimed.push(c),
                Err(error) => tracing::error!(
                    %ip,
                    error = %format!("{error:#}"),
                    "cannot set up the balancer address; its Services cannot be served until it exists"
                ),
            }
        }
    }

    /// Gives the addresses up (see [`BalancerAddress::release`]).
    pub async fn release(&self) {
        if let Some(address) = self.claimed.lock().await.take() {
            address.release().await;
        }
    }
}

/// Why no pod parent cgroup was found under the cgroup root.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error(
        "{root} is not a cgroup directory (no cgroup.procs): mount the host's cgroup v2 hierarchy there"
    )]
    NotCgroup { root: PathBuf },
    #[error(
        "{root} is a cgroup v1 hierarchy: skewless needs cgroup v2 (the unified hierarchy; \
         kernel >= 5.8, e.g. systemd.unified_cgroup_hierarchy=1){hint}"
    )]
    V1 { root: PathBuf, hint: String },
    #[error(
        "no kubelet pod cgroup ({}) within {MAX_DEPTH} levels of {root}: pass the kubelet's pod \
         parent with --cgroup=DIR (with a custom kubelet --cgroup-root it is below that)",
        POD_PARENT_NAMES.join(", ")
    )]
    NotFound { root: PathBuf },
    #[error(
        "several kubelet pod cgroups under {root}: {}; pass the one this node's kubelet uses \
         with --cgroup=DIR",
        found.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    Ambiguous { root: PathBuf, found: Vec<PathBuf> },
}

/// The names of the kubelet's pod parent cgroup: systemd driver, cgroupfs driver; a systemd
/// slice under a custom root (kind's `kubelet.slice/kubelet-kubepods.slice`) ends like
/// [`POD_PARENT_SUFFIX`].
const POD_PARENT_NAMES: [&str; 3] = ["kubepods.slice", "kubepods", "*-kubepods.slice"];
const POD_PARENT_SUFFIX: &str = "-kubepods.slice";

/// How deep below the cgroup root the pod parent is looked for (kind: 2; a cgroupfs custom
/// root `/a/b`: 3).
const MAX_DEPTH: usize = 3;

/// The kubelet's parent cgroup of all pods under the host's cgroup v2 root: the shallowest
/// cgroup named like [`POD_PARENT_NAMES`], at most [`MAX_DEPTH`] levels down.
///
/// # Errors
/// When `root` is not a cgroup v2 hierarchy (naming cgroup v2, and the unified mount of a
/// hybrid node), when nothing is found, or when two candidates are equally shallow.
pub fn pods_parent(root: &Path) -> Result<PathBuf, CgroupError> {
    let is_cgroup = |d: &Path| d.join("cgroup.procs").is_file();
    if !is_cgroup(root) {
        return Err(CgroupError::NotCgroup {
            root: root.to_owned(),
        });
    }
    // Only cgroup v2 has cgroup.controllers, at every level.
    if !root.join("cgroup.controllers").is_file() {
        let unified = root.join("unified");
        let hint = if unified.join("cgroup.controllers").is_file() {
            format!(
                "; this is a hybrid node whose v2 hierarchy is {} (mount that instead)",
                unified.display()
            )
        } else {
            String::new()
        };
        return Err(CgroupError::V1 {
            root: root.to_owned(),
            hint,
        });
    }
    let is_pod_parent = |name: &str| {
        name == "kubepods.slice" || name == "kubepods" || name.ends_with(POD_PARENT_SUFFIX)
    };
    let mut level = vec![root.to_owned()];
    for _ in 0..MAX_DEPTH {
        let mut found = Vec::new();
        let mut next = Vec::new();
        for dir in &level {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            let mut children: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| is_cgroup(p))
                .collect();
            children.sort();
            for child in children {
                let name = child
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or_default();
                if is_pod_parent(name) {
                    found.push(child);
                } else {
                    next.push(child);
                }
            }
        }
        match found.len() {
            0 => level = next,
            1 => return Ok(found.remove(0)),
            _ => {
                return Err(CgroupError::Ambiguous {
                    root: root.to_owned(),
                    found,
                });
            }
        }
    }
    Err(CgroupError::NotFound {
        root: root.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake cgroup v2 tree: every directory gets cgroup.procs (and cgroup.controllers when
    /// `v2`).
    fn tree(dirs: &[&str], v2: bool) -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        let mark = |d: &Path| {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("cgroup.procs"), b"").unwrap();
            if v2 {
                std::fs::write(d.join("cgroup.controllers"), b"").unwrap();
            }
        };
        mark(tmp.path());
        for dir in dirs {
            let mut path = tmp.path().to_owned();
            for part in dir.split('/') {
                path.push(part);
                mark(&path);
            }
        }
        tmp
    }

    #[test]
    fn the_layouts_of_both_drivers_kind_and_custom_roots_are_found() {
        for (dirs, want) in [
            (
                &[
                    "system.slice/sshd.service",
                    "kubepods.slice/kubepods-besteffort.slice",
                ][..],
                "kubepods.slice",
            ),
            (&["kubepods/burstable", "system.slice"][..], "kubepods"),
            (
                &[
                    "kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod1.slice",
                    "init.scope",
                ][..],
                "kubelet.slice/kubelet-kubepods.slice",
            ),
            (
                &["custom/root/kubepods/besteffort"][..],
                "custom/root/kubepods",
            ),
            (
                &["custom.slice/custom-kubepods.slice"][..],
                "custom.slice/custom-kubepods.slice",
            ),
        ] {
            let tmp = tree(dirs, true);
            assert_eq!(
                pods_parent(tmp.path()).unwrap(),
                tmp.path().join(want),
                "{dirs:?}"
            );
        }
    }

    #[test]
    fn the_shallowest_pod_parent_wins_and_a_tie_is_an_error() {
        let tmp = tree(&["kubepods.slice", "a/b/kubepods"], true);
        assert_eq!(
            pods_parent(tmp.path()).unwrap(),
            tmp.path().join("kubepods.slice")
        );
        let tmp = tree(&["kubepods.slice", "kubepods"], true);
        let err = pods_parent(tmp.path()).unwrap_err().to_string();
        assert!(err.contains("several") && err.contains("--cgroup"), "{err}");
    }

    #[test]
    fn missing_cgroup_v2_and_missing_pods_say_what_to_do() {
        let v1 = tree(&["kubepods"], false);
        let err = pods_parent(v1.path()).unwrap_err().to_string();
        assert!(
            err.contains("cgroup v1") && err.contains("needs cgroup v2"),
            "{err}"
        );
        let hybrid = tree(&["unified"], false);
        std::fs::write(hybrid.path().join("unified/cgroup.controllers"), b"").unwrap();
        let err = pods_parent(hybrid.path()).unwrap_err().to_string();
        assert!(err.contains("hybrid") && err.contains("unified"), "{err}");
        let empty = tree(&["system.slice/a.service/b"], true);
        let err = pods_parent(empty.path()).unwrap_err().to_string();
        assert!(
            err.contains("no kubelet pod cgroup") && err.contains("--cgroup="),
            "{err}"
        );
        let none = tempfile::tempdir().unwrap();
        let err = pods_parent(none.path()).unwrap_err().to_string();
        assert!(err.contains("not a cgroup directory"), "{err}");
    }
}
