//! Cgroups whose processes are never redirected: the agent's own.
//!
//! On Kubernetes the hooks attach to the kubelet's parent of every pod, so the agent's own
//! pod is behind them too. Its balancers' upstream connections go to pod IPs (never a VIP),
//! but its Kubernetes client talks to the `kubernetes` Service's VIP: opting that Service in
//! would send the agent's API client through its own balancer, whose endpoints come from that
//! very API. So the agent excludes its own cgroup: connect4/connect6 skip any task whose cgroup
//! id is in the `EXCLUDED_CGROUPS` map (and count it).

use std::{
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use skewless_common::EXCLUDED_CGROUPS_CAPACITY;
use tracing::info;

use crate::{Datapath, Error};

impl Datapath {
    /// Never redirects connects made by processes in the cgroup v2 directory `cgroup` (only
    /// that cgroup, not its children). Returns the cgroup's id.
    ///
    /// # Errors
    /// When the directory cannot be read or the map is full.
    pub fn exclude_cgroup(&mut self, cgroup: &Path) -> Result<u64, Error> {
        // A cgroup's id is its directory's inode number in cgroupfs (what
        // bpf_get_current_cgroup_id returns).
        let id = std::fs::metadata(cgroup)
            .map_err(|source| Error::OpenCgroup {
                path: cgroup.to_owned(),
                source,
            })?
            .ino();
        self.excluded.insert(id, 1, 0).map_err(|source| {
            if crate::redirect::is_full(&source) {
                Error::ExcludedCgroupsFull {
                    path: cgroup.to_owned(),
                    capacity: EXCLUDED_CGROUPS_CAPACITY,
                }
            } else {
                Error::Map {
                    name: skewless_common::EXCLUDED_CGROUPS_MAP,
                    source,
                }
            }
        })?;
        info!(cgroup = %cgroup.display(), id, "cgroup excluded from redirects");
        Ok(id)
    }

    /// The cgroup ids excluded so far.
    #[must_use]
    pub fn excluded_cgroups(&self) -> Vec<u64> {
        self.excluded.keys().filter_map(Result::ok).collect()
    }
}

/// The calling process's cgroup v2 directory, as this mount namespace sees it.
///
/// # Errors
/// When `/proc/self/cgroup` or `/proc/self/mountinfo` cannot be read, or no mounted cgroup2
/// filesystem contains the process's cgroup.
pub fn own_cgroup() -> Result<PathBuf, Error> {
    let read = |what: &'static str, path: &str| {
        std::fs::read_to_string(path).map_err(|source| Error::OwnCgroup { what, source })
    };
    let cgroup = read("reading /proc/self/cgroup", "/proc/self/cgroup")?;
    let mounts = read("reading /proc/self/mountinfo", "/proc/self/mountinfo")?;
    own_cgroup_in(&cgroup, &mounts).ok_or_else(|| Error::OwnCgroup {
        what: "no cgroup2 mount holds this process's cgroup",
        source: std::io::Error::from(std::io::ErrorKind::NotFound),
    })
}

/// The directory of the v2 entry (`0::/path`) of `proc_cgroup` under a cgroup2 mount of
/// `mountinfo` whose root contains it. Under a cgroup namespace (a container) both are
/// relative to the namespace's root, so the process's cgroup is the mount point itself.
fn own_cgroup_in(proc_cgroup: &str, mountinfo: &str) -> Option<PathBuf> {
    let path = proc_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))?
        .trim();
    mountinfo.lines().find_map(|line| {
        // id parent major:minor root mount-point options [optional...] - fstype source opts
        let (fields, rest) = line.split_once(" - ")?;
        if rest.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let mut f = fields.split_whitespace();
        let root = f.nth(3)?;
        let mount_point = f.next()?;
        let below = if root == "/" {
            path.strip_prefix('/')?
        } else {
            path.strip_prefix(root)?.trim_start_matches('/')
        };
        let dir = Path::new(mount_point).join(below);
        Some(if below.is_empty() {
            PathBuf::from(mount_point)
        } else {
            dir
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
22 1 0:21 / /sys rw,nosuid shared:7 - sysfs sysfs rw
25 22 0:23 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:24 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
27 25 0:25 / /sys/fs/cgroup/memory rw,nosuid shared:11 - cgroup cgroup rw,memory
";

    #[test]
    fn the_v2_entry_is_found_under_the_cgroup2_mount_of_a_hybrid_host() {
        let cgroup = "12:memory:/sktb-1/agent\n0::/sktb-1/agent\n";
        assert_eq!(
            own_cgroup_in(cgroup, HYBRID),
            Some(PathBuf::from("/sys/fs/cgroup/unified/sktb-1/agent"))
        );
        assert_eq!(
            own_cgroup_in("0::/\n", HYBRID),
            Some(PathBuf::from("/sys/fs/cgroup/unified")),
            "a process at the root is the mount point itself"
        );
    }

    #[test]
    fn a_namespaced_container_sees_its_cgroup_at_its_mount_point() {
        // containerd with a private cgroup namespace: both views start at the container.
        let mounts = "700 690 0:30 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw\n";
        assert_eq!(
            own_cgroup_in("0::/\n", mounts),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        // A bind mount of a sub-tree: the path is taken relative to the mount's root.
        let mounts = "701 690 0:30 /kubepods.slice /run/cg rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            own_cgroup_in("0::/kubepods.slice/pod-a/agent\n", mounts),
            Some(PathBuf::from("/run/cg/pod-a/agent"))
        );
        assert_eq!(
            own_cgroup_in("0::/system.slice/x\n", mounts),
            None,
            "a cgroup outside every mount is not found"
        );
    }
}
