//! Attaching the programs to pod cgroups, all or nothing, and never to the hierarchy root.

use std::{
    fs::File,
    path::{Path, PathBuf},
};

use aya::programs::{
    CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSockAddr, SockOps,
    cgroup_skb::CgroupSkbLinkId, cgroup_sock_addr::CgroupSockAddrLinkId, sock_ops::SockOpsLinkId,
};
use tracing::{debug, warn};

use crate::{
    Datapath, Error,
    programs::{INGRESS, SOCK_ADDR, SOCK_OPS, program},
};

/// A handle to one cgroup attachment; pass it back to [`Datapath::detach`].
#[derive(Debug)]
pub struct Attachment {
    cgroup: PathBuf,
    /// In attach order.
    links: Vec<Link>,
}

impl Attachment {
    #[must_use]
    pub fn cgroup(&self) -> &Path {
        &self.cgroup
    }
}

/// One program's link to a cgroup.
#[derive(Debug)]
enum Link {
    SockAddr(&'static str, CgroupSockAddrLinkId),
    SockOps(SockOpsLinkId),
    Ingress(CgroupSkbLinkId),
}

impl Datapath {
    /// Attaches every program to the cgroup v2 directory `cgroup` (a pod's cgroup, or the
    /// kubelet's parent of all pods), all or nothing: a pod with connect4 but no getpeername4
    /// would see the balancer's address as its peer.
    ///
    /// # Errors
    /// When `cgroup` is not a child cgroup (the root of the hierarchy would put every process
    /// on the machine behind the hooks: refused before anything is attached), it cannot be
    /// opened, or the kernel refuses an attachment (those made before are undone).
    pub fn attach(&mut self, cgroup: &Path) -> Result<Attachment, Error> {
        ensure_child_cgroup(cgroup)?;
        let file = File::open(cgroup).map_err(|source| Error::OpenCgroup {
            path: cgroup.to_owned(),
            source,
        })?;
        let mut links = Vec::with_capacity(SOCK_ADDR.len() + 2);
        if let Err(error) = self.attach_each(&file, &mut links) {
            if let Err(undo) = self.detach_links(links) {
                warn!(error = %undo, "undoing a partial attachment");
            }
            return Err(error);
        }
        debug!(cgroup = %cgroup.display(), "attached");
        Ok(Attachment {
            cgroup: cgroup.to_owned(),
            links,
        })
    }

    /// Detaches the programs from one cgroup.
    ///
    /// # Errors
    /// When a link is unknown to its program (the others are detached anyway).
    pub fn detach(&mut self, attachment: Attachment) -> Result<(), Error> {
        let Attachment { cgroup, links } = attachment;
        self.detach_links(links)?;
        debug!(cgroup = %cgroup.display(), "detached");
        Ok(())
    }

    /// Attaches the programs one by one, pushing each link as it is made.
    fn attach_each(&mut self, cgroup: &File, links: &mut Vec<Link>) -> Result<(), Error> {
        let mode = CgroupAttachMode::Single;
        for name in SOCK_ADDR {
            let link = program::<CgroupSockAddr>(&mut self.ebpf, name)?
                .attach(cgroup, mode)
                .map_err(|source| Error::Program { name, source })?;
            links.push(Link::SockAddr(name, link));
        }
        let link = program::<SockOps>(&mut self.ebpf, SOCK_OPS)?
            .attach(cgroup, mode)
            .map_err(|source| Error::Program {
                name: SOCK_OPS,
                source,
            })?;
        links.push(Link::SockOps(link));
        let link = program::<CgroupSkb>(&mut self.ebpf, INGRESS)?
            .attach(cgroup, CgroupSkbAttachType::Ingress, mode)
            .map_err(|source| Error::Program {
                name: INGRESS,
                source,
            })?;
        links.push(Link::Ingress(link));
        Ok(())
    }

    /// Detaches every link, the last attached first, reporting the first failure after
    /// trying all of them.
    fn detach_links(&mut self, links: Vec<Link>) -> Result<(), Error> {
        let mut first_err = None;
        for link in links.into_iter().rev() {
            let detached = match link {
                Link::SockAddr(name, link) => program::<CgroupSockAddr>(&mut self.ebpf, name)
                    .and_then(|p| {
                        p.detach(link)
                            .map_err(|source| Error::Program { name, source })
                    }),
                Link::SockOps(link) => program::<SockOps>(&mut self.ebpf, SOCK_OPS).and_then(|p| {
                    p.detach(link).map_err(|source| Error::Program {
                        name: SOCK_OPS,
                        source,
                    })
                }),
                Link::Ingress(link) => {
                    program::<CgroupSkb>(&mut self.ebpf, INGRESS).and_then(|p| {
                        p.detach(link).map_err(|source| Error::Program {
                            name: INGRESS,
                            source,
                        })
                    })
                }
            };
            if let Err(error) = detached {
                first_err.get_or_insert(error);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// Checks that `cgroup` may be attached to: a child cgroup, never the root of the hierarchy
/// (which would put every process on the machine behind the hooks). [`Datapath::attach`]
/// checks it; callers can check their paths before loading anything.
///
/// # Errors
/// [`Error::NotChildCgroup`] otherwise.
pub fn ensure_child_cgroup(cgroup: &Path) -> Result<(), Error> {
    if is_child_cgroup(cgroup) {
        Ok(())
    } else {
        Err(Error::NotChildCgroup {
            path: cgroup.to_owned(),
        })
    }
}

/// Whether `dir` is a cgroup (it has `cgroup.procs`) whose parent is one too: the root of a
/// cgroup hierarchy has no cgroup for a parent.
fn is_child_cgroup(dir: &Path) -> bool {
    let is_cgroup = |d: &Path| d.join("cgroup.procs").is_file();
    is_cgroup(dir) && dir.parent().is_some_and(is_cgroup)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_cgroup_below_another_cgroup_is_a_child_cgroup() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let root = tmp.path().join("root");
        let child = root.join("pods");
        let grandchild = child.join("pod-1");
        std::fs::create_dir_all(&grandchild).unwrap();
        assert!(
            !is_child_cgroup(&child),
            "no cgroup.procs anywhere: not a cgroup"
        );
        for dir in [&root, &child, &grandchild] {
            std::fs::write(dir.join("cgroup.procs"), b"").unwrap();
        }
        assert!(
            !is_child_cgroup(&root),
            "a hierarchy root (parent not a cgroup) must be refused"
        );
        assert!(is_child_cgroup(&child));
        assert!(is_child_cgroup(&grandchild));
        assert!(
            !is_child_cgroup(&tmp.path().join("missing")),
            "a missing directory is not a cgroup"
        );
    }

    #[test]
    fn the_machines_cgroup_roots_are_refused() {
        for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/"] {
            assert!(
                !is_child_cgroup(Path::new(root)),
                "{root} is a hierarchy root (or no cgroup) and must never be attached to"
            );
        }
    }
}
