//! Attaching the programs to pod cgroups, all or nothing.

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
    /// kubelet's parent of all pods — never the root of the hierarchy, which would affect the
    /// whole machine), all or nothing: a pod with connect4 but no getpeername4 would see the
    /// balancer's address as its peer.
    ///
    /// # Errors
    /// When the cgroup cannot be opened or the kernel refuses an attachment (those made
    /// before are undone).
    pub fn attach(&mut self, cgroup: &Path) -> Result<Attachment, Error> {
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
