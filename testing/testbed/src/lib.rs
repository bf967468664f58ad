//! An isolated Kubernetes-like topology on one machine, built from network namespaces.
//!
//! ```text
//!                 fabric netns: bridge br0 (nodes talk to each other here)
//!                  |                         |
//!   node netns "node0" (agent, VIP DNAT)   node netns "node1" ...
//!    |  veth (routed, one /24 per pod)
//!   pod netns "client" (own cgroup v2)     pod netns "server-0" ...
//! ```
//!
//! - A Service VIP exists only as an nftables DNAT rule with `numgen random` in every node
//!   namespace: exactly kube-proxy's per-connection choice. No interface carries the VIP.
//! - Pods are routed (one subnet per pod), so replies cross the node's conntrack.
//! - Every pod has its own child cgroup under the cgroup v2 hierarchy, so eBPF programs can
//!   be attached per pod without ever touching the root cgroup.
//! - Nothing links into the root namespace: no packet can leave the machine.
//!
//! Every pod, node and Service is dual-stack: next to its IPv4 address it has an IPv6 one
//! from the unique-local range `fd00:198:18::/48` (pods, one /64 each), `fd00:198:19::/48`
//! (Service VIPs: the IPv4 VIP in the last 32 bits, see [`vip6`]; node fabric addresses) and
//! [`BALANCER_IP6`] on every node's `lo`. The IPv6 DNAT is an `ip6` nftables table of the same
//! shape as the IPv4 one. DAD is off in every namespace, so addresses are usable at once.
//!
//! All IPv4 addresses come from 198.18.0.0/15, the range reserved for network benchmarks
//! (RFC 2544), and exist only inside these namespaces. Each run gets a unique name prefix, so
//! two runs never clash. Everything (processes, namespaces, cgroups) is removed on drop, on
//! panic (drop runs while unwinding) and on Ctrl-C; [`clean_stale`] removes what a killed run
//! left behind.
#![forbid(unsafe_code)]

mod addr;
mod builder;
mod cleanup;
pub mod container;
pub mod fixtures;
pub mod grpc;
mod nft;
mod process;
pub mod scripts;
mod services_file;

use std::{
    collections::BTreeMap,
    io,
    net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6},
    path::{Path, PathBuf},
    process::Child,
    time::Duration,
};

pub use addr::{BALANCER_IP, BALANCER_IP6, vip6};
pub use builder::Builder;
pub use cleanup::clean_stale;
pub use process::checked_output;
pub use services_file::FileService;

/// Every namespace and cgroup the testbed creates starts with this, so [`clean_stale`] can find
/// leftovers of crashed runs without touching anything else.
pub const PREFIX: &str = "sktb-";
/// The cgroup v2 hierarchy on these machines (hybrid layout: v2 is mounted here, not at
/// /sys/fs/cgroup).
pub const CGROUP2_ROOT: &str = "/sys/fs/cgroup/unified";

/// Errors from building or driving the testbed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Command {
        cmd: String,
        status: String,
        stderr: String,
    },
    #[error("running `{cmd}`")]
    Spawn {
        cmd: String,
        #[source]
        source: io::Error,
    },
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no pod named {0:?}")]
    NoSuchPod(String),
    #[error("no service named {0:?}")]
    NoSuchService(String),
    #[error("{0} is not a valid topology: {1}")]
    Invalid(String, &'static str),
    #[error("the testbed needs root (network namespaces, nftables, cgroups)")]
    NotRoot,
    #[error("{what} did not become ready within {timeout:?}")]
    Timeout { what: String, timeout: Duration },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A pod in the topology: its own network namespace and cgroup, attached to one node.
#[derive(Clone, Debug)]
pub struct Pod {
    pub name: String,
    pub node: usize,
    pub netns: String,
    pub ip: Ipv4Addr,
    /// The pod's IPv6 address (`fd00:198:18:<n>::2/64` on `eth0`).
    pub ip6: Ipv6Addr,
    /// The pod's child cgroup (cgroup v2). Processes started with [`Testbed::spawn`] join it
    /// before they run any code, so socket hooks attached here see all their sockets.
    pub cgroup: PathBuf,
    /// The interface in the node namespace that leads to this pod.
    pub host_veth: String,
}

/// A node: a network namespace where the agent and the Service DNAT live.
#[derive(Clone, Debug)]
pub struct Node {
    pub index: usize,
    pub netns: String,
    /// The node's address on the fabric bridge.
    pub fabric_ip: Ipv4Addr,
    /// The node's IPv6 address on the fabric bridge.
    pub fabric_ip6: Ipv6Addr,
}

/// A Service: a VIP:port that exists only as a DNAT rule, spread over backend pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    pub name: String,
    pub vip: Ipv4Addr,
    pub port: u16,
    pub target_port: u16,
    /// Backend pod names.
    pub backends: Vec<String>,
}

impl Service {
    #[must_use]
    pub fn addr(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.vip, self.port)
    }

    /// The Service's IPv6 VIP ([`vip6`] of its IPv4 VIP).
    #[must_use]
    pub fn vip6(&self) -> Ipv6Addr {
        vip6(self.vip)
    }

    /// The Service's IPv6 VIP and port.
    #[must_use]
    pub fn addr6(&self) -> SocketAddrV6 {
        SocketAddrV6::new(self.vip6(), self.port, 0, 0)
    }
}

/// Where a process runs.
#[derive(Clone, Copy, Debug)]
pub enum Place<'a> {
    /// In a node's network namespace (no cgroup change), like the agent.
    Node(usize),
    /// In a pod's network namespace and cgroup.
    Pod(&'a str),
}

/// A live topology. Dropping it removes everything it created.
#[derive(Debug)]
pub struct Testbed {
    id: String,
    fabric: Option<String>,
    nodes: Vec<Node>,
    pods: BTreeMap<String, Pod>,
    services: BTreeMap<String, Service>,
    cgroup_root: PathBuf,
    children: Vec<Child>,
}

impl Testbed {
    #[must_use]
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// This run's unique id (part of every name it created).
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// # Panics
    /// If the node does not exist.
    #[must_use]
    pub fn node(&self, index: usize) -> &Node {
        &self.nodes[index]
    }

    /// # Errors
    /// If there is no such pod.
    pub fn pod(&self, name: &str) -> Result<&Pod> {
        self.pods
            .get(name)
            .ok_or_else(|| Error::NoSuchPod(name.to_owned()))
    }

    pub fn pods(&self) -> impl Iterator<Item = &Pod> {
        self.pods.values()
    }

    /// # Errors
    /// If there is no such Service.
    pub fn service(&self, name: &str) -> Result<&Service> {
        self.services
            .get(name)
            .ok_or_else(|| Error::NoSuchService(name.to_owned()))
    }

    /// The directory under which all of this run's pod cgroups live.
    #[must_use]
    pub fn cgroup_root(&self) -> &Path {
        &self.cgroup_root
    }

    /// Replaces a Service's backends (like an EndpointSlice update reaching kube-proxy):
    /// new connections are spread over the new set, established ones keep their backend.
    ///
    /// # Errors
    /// If the Service or a pod is unknown, or nft fails.
    pub fn set_backends(&mut self, service: &str, backends: &[&str]) -> Result<()> {
        for b in backends {
            self.pod(b)?;
        }
        let svc = self
            .services
            .get_mut(service)
            .ok_or_else(|| Error::NoSuchService(service.to_owned()))?;
        svc.backends = backends.iter().map(|b| (*b).to_owned()).collect();
        self.write_nat_rules()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder::unique_id;

    #[test]
    fn ids_are_unique_and_fit_interface_names() {
        let a = unique_id();
        let b = unique_id();
        assert_ne!(a, b, "two testbeds in one process must not share names");
        assert!(
            format!("sk{a}p249").len() <= 15,
            "veth names must fit IFNAMSIZ"
        );
    }

    #[test]
    fn builder_rejects_unknown_backend() {
        let err = Testbed::builder()
            .pod("a", 0)
            .service("svc", Ipv4Addr::new(198, 19, 0, 1), 80, 80, &["b"])
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::Invalid(..)), "unexpected error: {err}");
    }
}
