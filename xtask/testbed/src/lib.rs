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

pub mod fixtures;
pub mod grpc;
pub mod scripts;

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    io::{self, Write as _},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{
        Mutex, Once,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use tracing::{debug, warn};

/// Every namespace and cgroup the testbed creates starts with this, so [`clean_stale`] can find
/// leftovers of crashed runs without touching anything else.
pub const PREFIX: &str = "sktb-";
/// The cgroup v2 hierarchy on these machines (hybrid layout: v2 is mounted here, not at
/// /sys/fs/cgroup).
pub const CGROUP2_ROOT: &str = "/sys/fs/cgroup/unified";
/// The node-local address of the balancer on every node: a /32 on the node's `lo`, reachable
/// from the node's pods through their default route, like node-local DNS caches do.
pub const BALANCER_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 77, 1);
/// The IPv6 node-local address of the balancer on every node: a /128 on the node's `lo`,
/// reachable from the node's pods through their default IPv6 route.
pub const BALANCER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x169, 0x254, 0, 0, 0, 0, 1);

/// The IPv6 VIP of a Service whose IPv4 VIP is `vip`: `fd00:198:19::a.b.c.d` (the IPv4
/// address in the last 32 bits), so each Service gets one without extra configuration.
#[must_use]
pub fn vip6(vip: Ipv4Addr) -> Ipv6Addr {
    let [a, b, c, d] = vip.octets();
    Ipv6Addr::new(
        0xfd00,
        0x198,
        0x19,
        0,
        0,
        0,
        u16::from_be_bytes([a, b]),
        u16::from_be_bytes([c, d]),
    )
}

/// A pod's IPv6 address (`gateway == false`) or its node-side gateway, in the pod's /64.
fn pod_ip6(subnet: u8, gateway: bool) -> Ipv6Addr {
    Ipv6Addr::new(
        0xfd00,
        0x198,
        0x18,
        u16::from(subnet),
        0,
        0,
        0,
        if gateway { 1 } else { 2 },
    )
}

/// A node's IPv6 address on the fabric bridge.
fn fabric_ip6(index: usize) -> Ipv6Addr {
    Ipv6Addr::new(
        0xfd00,
        0x198,
        0x19,
        0xffff,
        0,
        0,
        0,
        u16::try_from(index + 1).unwrap_or(u16::MAX),
    )
}

const NFT_TABLE: &str = "skewless_testbed";
/// `ip6` family table of the IPv6 DNAT (a separate family, same name).
const NFT_TABLE6: &str = "skewless_testbed";

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

/// Describes a topology to build.
#[derive(Clone, Debug, Default)]
pub struct Builder {
    nodes: usize,
    pods: Vec<(String, usize)>,
    services: Vec<Service>,
}

impl Builder {
    /// Number of node namespaces (at least 1).
    #[must_use]
    pub fn nodes(mut self, n: usize) -> Self {
        self.nodes = n;
        self
    }

    /// Adds a pod on node `node`.
    #[must_use]
    pub fn pod(mut self, name: &str, node: usize) -> Self {
        self.pods.push((name.to_owned(), node));
        self
    }

    /// Adds a Service: `vip:port` DNATed at random to `target_port` on the named pods.
    #[must_use]
    pub fn service(
        mut self,
        name: &str,
        vip: Ipv4Addr,
        port: u16,
        target_port: u16,
        backends: &[&str],
    ) -> Self {
        self.services.push(Service {
            name: name.to_owned(),
            vip,
            port,
            target_port,
            backends: backends.iter().map(|b| (*b).to_owned()).collect(),
        });
        self
    }

    /// Creates every namespace, link, route, cgroup and DNAT rule. On error, whatever was
    /// created is removed again before returning.
    ///
    /// # Errors
    /// When not root, when the topology is inconsistent, or when a command fails.
    pub fn build(self) -> Result<Testbed> {
        let nodes = self.nodes.max(1);
        if self.pods.len() > 250 {
            return Err(Error::Invalid(
                format!("{} pods", self.pods.len()),
                "at most 250 pods",
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (name, node) in &self.pods {
            if *node >= nodes {
                return Err(Error::Invalid(
                    format!("pod {name}"),
                    "its node does not exist",
                ));
            }
            if !seen.insert(name.as_str()) || name.is_empty() {
                return Err(Error::Invalid(
                    format!("pod {name:?}"),
                    "pod names must be unique",
                ));
            }
        }
        for svc in &self.services {
            if svc.backends.iter().any(|b| !seen.contains(b.as_str())) {
                return Err(Error::Invalid(
                    format!("service {}", svc.name),
                    "unknown backend",
                ));
            }
        }
        if !is_root() {
            return Err(Error::NotRoot);
        }
        install_interrupt_handler();
        let id = unique_id();
        let mut tb = Testbed {
            id: id.clone(),
            fabric: None,
            nodes: Vec::new(),
            pods: BTreeMap::new(),
            services: BTreeMap::new(),
            cgroup_root: Path::new(CGROUP2_ROOT).join(format!("{PREFIX}{id}")),
            children: Vec::new(),
        };
        register(&tb);
        // Drop cleans up whatever exists if any step fails.
        tb.create(nodes, &self.pods)?;
        for svc in self.services {
            tb.services.insert(svc.name.clone(), svc);
        }
        tb.write_nat_rules()?;
        Ok(tb)
    }
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

    /// A command that runs `argv` in `place` (network namespace, and the pod's cgroup for
    /// pods). The process joins the cgroup before it execs `argv`, so no socket escapes the
    /// hooks attached there. Uses `nsenter --net` rather than `ip netns exec`, which remounts
    /// /sys and would hide the cgroup v2 mount.
    ///
    /// # Errors
    /// If the pod is unknown.
    pub fn command(&self, place: Place<'_>, argv: &[&str]) -> Result<Command> {
        let (netns, cgroup) = match place {
            Place::Node(i) => (self.nodes[i].netns.clone(), None),
            Place::Pod(name) => {
                let pod = self.pod(name)?;
                (pod.netns.clone(), Some(pod.cgroup.clone()))
            }
        };
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{netns}")).arg("--");
        if let Some(cg) = cgroup {
            cmd.args(["sh", "-c", r#"echo $$ > "$0/cgroup.procs" && exec "$@""#])
                .arg(cg);
        }
        cmd.args(argv);
        Ok(cmd)
    }

    /// Runs `argv` in `place` to completion.
    ///
    /// # Errors
    /// If it cannot start or exits non-zero.
    pub fn run(&self, place: Place<'_>, argv: &[&str]) -> Result<Output> {
        let mut cmd = self.command(place, argv)?;
        checked_output(&mut cmd)
    }

    /// Starts `argv` in `place` in the background. The testbed owns the process and ends it
    /// (by PID) when dropped. Returns the PID.
    ///
    /// # Errors
    /// If it cannot start.
    pub fn spawn(&mut self, place: Place<'_>, argv: &[&str]) -> Result<u32> {
        let mut cmd = self.command(place, argv)?;
        self.spawn_command(&mut cmd)
    }

    /// Starts a prepared command (from [`Testbed::command`]) in the background, owned by the
    /// testbed like [`Testbed::spawn`].
    ///
    /// # Errors
    /// If it cannot start.
    pub fn spawn_command(&mut self, cmd: &mut Command) -> Result<u32> {
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .map_err(|source| Error::Spawn {
                cmd: format!("{cmd:?}"),
                source,
            })?;
        let pid = child.id();
        debug!(pid, "spawned");
        self.children.push(child);
        Ok(pid)
    }

    /// Ends a process started by this testbed (SIGKILL, by PID) and reaps it.
    pub fn kill(&mut self, pid: u32) {
        if let Some(pos) = self.children.iter().position(|c| c.id() == pid) {
            let mut child = self.children.swap_remove(pos);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends SIGTERM to a process started by this testbed and waits up to `grace` for it to
    /// exit, then SIGKILLs it. Returns whether it exited on its own.
    pub fn terminate(&mut self, pid: u32, grace: Duration) -> bool {
        let Some(pos) = self.children.iter().position(|c| c.id() == pid) else {
            return false;
        };
        let mut child = self.children.swap_remove(pos);
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// Sends a signal (`STOP`, `CONT`, `TERM`, ...) to a process started by this testbed.
    /// Returns false if the PID is not one of ours.
    pub fn signal(&self, pid: u32, signal: &str) -> bool {
        self.children.iter().any(|c| c.id() == pid)
            && Command::new("kill")
                .args([format!("-{signal}"), pid.to_string()])
                .status()
                .is_ok_and(|s| s.success())
    }

    /// Whether a process started by this testbed is still running.
    pub fn is_running(&mut self, pid: u32) -> bool {
        self.children
            .iter_mut()
            .find(|c| c.id() == pid)
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Waits until something accepts TCP connections on `addr` as seen from `place`.
    ///
    /// # Errors
    /// On timeout.
    pub fn wait_for_tcp(
        &self,
        place: Place<'_>,
        addr: impl Into<SocketAddr>,
        timeout: Duration,
    ) -> Result<()> {
        let addr = addr.into();
        let deadline = Instant::now() + timeout;
        let script = format!(
            "import socket\ns=socket.create_connection(('{}',{}),timeout=0.5)\ns.close()",
            addr.ip(),
            addr.port()
        );
        loop {
            let mut cmd = self.command(place, &["python3", "-c", &script])?;
            if cmd
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("tcp {addr}"),
                    timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn create(&mut self, nodes: usize, pods: &[(String, usize)]) -> Result<()> {
        mkdir(&self.cgroup_root)?;
        let fabric = format!("{PREFIX}{}-fabric", self.id);
        add_netns(&fabric)?;
        self.fabric = Some(fabric.clone());
        ip(&["-n", &fabric, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &fabric, "link", "set", "br0", "up"])?;
        for index in 0..nodes {
            let netns = format!("{PREFIX}{}-node{index}", self.id);
            add_netns(&netns)?;
            let fabric_ip = Ipv4Addr::new(198, 19, 255, u8::try_from(index + 1).unwrap_or(255));
            let fabric_ip6 = fabric_ip6(index);
            let node = Node {
                index,
                netns: netns.clone(),
                fabric_ip,
                fabric_ip6,
            };
            self.nodes.push(node);
            let host = format!("sk{}n{index}", self.id);
            ip(&[
                "link", "add", &host, "netns", &fabric, "type", "veth", "peer", "name", "fabric",
                "netns", &netns,
            ])?;
            ip(&["-n", &fabric, "link", "set", &host, "master", "br0", "up"])?;
            ip(&[
                "-n",
                &netns,
                "addr",
                "add",
                &format!("{fabric_ip}/24"),
                "dev",
                "fabric",
            ])?;
            add_addr6(&netns, &format!("{fabric_ip6}/64"), "fabric")?;
            ip(&["-n", &netns, "link", "set", "fabric", "up"])?;
            ip(&[
                "-n",
                &netns,
                "addr",
                "add",
                &format!("{BALANCER_IP}/32"),
                "dev",
                "lo",
            ])?;
            add_addr6(&netns, &format!("{BALANCER_IP6}/128"), "lo")?;
            sysctl(&netns, "net.ipv4.ip_forward", "1")?;
            sysctl(&netns, "net.ipv6.conf.all.forwarding", "1")?;
        }
        for (i, (name, node)) in pods.iter().enumerate() {
            let subnet =
                u8::try_from(i + 1).map_err(|_| Error::Invalid(name.clone(), "too many pods"))?;
            let netns = format!("{PREFIX}{}-{name}", self.id);
            add_netns(&netns)?;
            let node_ns = self.nodes[*node].netns.clone();
            let host_veth = format!("sk{}p{i}", self.id);
            let gw = Ipv4Addr::new(198, 18, subnet, 1);
            let pod_ip = Ipv4Addr::new(198, 18, subnet, 2);
            let (gw6, pod_ip6) = (pod_ip6(subnet, true), pod_ip6(subnet, false));
            let cgroup = self.cgroup_root.join(name);
            mkdir(&cgroup)?;
            self.pods.insert(
                name.clone(),
                Pod {
                    name: name.clone(),
                    node: *node,
                    netns: netns.clone(),
                    ip: pod_ip,
                    ip6: pod_ip6,
                    cgroup,
                    host_veth: host_veth.clone(),
                },
            );
            ip(&[
                "link", "add", &host_veth, "netns", &node_ns, "type", "veth", "peer", "name",
                "eth0", "netns", &netns,
            ])?;
            ip(&[
                "-n",
                &node_ns,
                "addr",
                "add",
                &format!("{gw}/24"),
                "dev",
                &host_veth,
            ])?;
            add_addr6(&node_ns, &format!("{gw6}/64"), &host_veth)?;
            ip(&["-n", &node_ns, "link", "set", &host_veth, "up"])?;
            ip(&[
                "-n",
                &netns,
                "addr",
                "add",
                &format!("{pod_ip}/24"),
                "dev",
                "eth0",
            ])?;
            add_addr6(&netns, &format!("{pod_ip6}/64"), "eth0")?;
            ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
            ip(&[
                "-n",
                &netns,
                "route",
                "add",
                "default",
                "via",
                &gw.to_string(),
            ])?;
            ip(&[
                "-n",
                &netns,
                "-6",
                "route",
                "add",
                "default",
                "via",
                &gw6.to_string(),
            ])?;
            // Pods on other nodes: route their subnet via that node's fabric address.
            for other in &self.nodes {
                if other.index != *node {
                    let fabric_ip = self.nodes[*node].fabric_ip;
                    ip(&[
                        "-n",
                        &other.netns,
                        "route",
                        "add",
                        &format!("198.18.{subnet}.0/24"),
                        "via",
                        &fabric_ip.to_string(),
                    ])?;
                    let fabric_ip6 = self.nodes[*node].fabric_ip6;
                    ip(&[
                        "-n",
                        &other.netns,
                        "-6",
                        "route",
                        "add",
                        &format!("fd00:198:18:{subnet:x}::/64"),
                        "via",
                        &fabric_ip6.to_string(),
                    ])?;
                }
            }
        }
        Ok(())
    }

    /// Writes the kube-proxy-style DNAT for every Service into every node, replacing the
    /// previous rules in one nft transaction.
    fn write_nat_rules(&self) -> Result<()> {
        let (mut rules, mut rules6) = (String::new(), String::new());
        for svc in self.services.values() {
            if svc.backends.is_empty() {
                // kube-proxy rejects connections to a Service without endpoints.
                let _ = writeln!(
                    rules,
                    "ip daddr {} tcp dport {} reject with tcp reset",
                    svc.vip, svc.port
                );
                let _ = writeln!(
                    rules6,
                    "ip6 daddr {} tcp dport {} reject with tcp reset",
                    svc.vip6(),
                    svc.port
                );
                continue;
            }
            let (mut map, mut map6) = (String::new(), String::new());
            for (i, b) in svc.backends.iter().enumerate() {
                let pod = self.pod(b)?;
                let sep = if i > 0 { ", " } else { "" };
                let _ = write!(map, "{sep}{i} : {} . {}", pod.ip, svc.target_port);
                let _ = write!(map6, "{sep}{i} : {} . {}", pod.ip6, svc.target_port);
            }
            let n = svc.backends.len();
            let _ = writeln!(
                rules,
                "ip daddr {} tcp dport {} dnat ip to numgen random mod {n} map {{ {map} }}",
                svc.vip, svc.port,
            );
            let _ = writeln!(
                rules6,
                "ip6 daddr {} tcp dport {} dnat ip6 to numgen random mod {n} map {{ {map6} }}",
                svc.vip6(),
                svc.port,
            );
        }
        let script = format!(
            "table ip {NFT_TABLE}\ndelete table ip {NFT_TABLE}\ntable ip {NFT_TABLE} {{\n\
             chain prerouting {{ type nat hook prerouting priority dstnat; policy accept;\n{rules}}}\n\
             chain output {{ type nat hook output priority -100; policy accept;\n{rules}}}\n}}\n\
             table ip6 {NFT_TABLE6}\ndelete table ip6 {NFT_TABLE6}\ntable ip6 {NFT_TABLE6} {{\n\
             chain prerouting {{ type nat hook prerouting priority dstnat; policy accept;\n{rules6}}}\n\
             chain output {{ type nat hook output priority -100; policy accept;\n{rules6}}}\n}}\n"
        );
        for node in &self.nodes {
            nft(&node.netns, &script)?;
        }
        Ok(())
    }

    fn teardown(&mut self) {
        for mut child in self.children.drain(..) {
            let _ = child.kill();
            let _ = child.wait();
        }
        teardown_named(&self.id);
        self.fabric = None;
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        self.teardown();
        unregister(&self.id);
    }
}

/// Removes every namespace, cgroup and process left by this testbed id.
fn teardown_named(id: &str) {
    let prefix = format!("{PREFIX}{id}");
    let cg_root = Path::new(CGROUP2_ROOT).join(&prefix);
    // Processes first: anything still in one of our cgroups or namespaces was started by us.
    kill_cgroup_tree(&cg_root);
    for ns in list_netns().into_iter().filter(|n| n.starts_with(&prefix)) {
        kill_netns_pids(&ns);
        if let Err(e) = ip(&["netns", "del", &ns]) {
            warn!(netns = %ns, error = %e, "removing network namespace");
        }
    }
    remove_cgroup_tree(&cg_root);
}

/// Removes what crashed runs left behind: every `sktb-*` network namespace and cgroup, and the
/// processes inside them. Returns how many namespaces and cgroups were removed.
#[must_use]
pub fn clean_stale() -> (usize, usize) {
    let live: Vec<String> = LIVE.lock().map(|l| l.clone()).unwrap_or_default();
    let is_live = |name: &str| {
        live.iter()
            .any(|id| name.starts_with(&format!("{PREFIX}{id}")))
    };
    let mut netns = 0;
    for ns in list_netns()
        .into_iter()
        .filter(|n| n.starts_with(PREFIX) && !is_live(n))
    {
        kill_netns_pids(&ns);
        if ip(&["netns", "del", &ns]).is_ok() {
            netns += 1;
        }
    }
    let mut cgroups = 0;
    if let Ok(entries) = fs::read_dir(CGROUP2_ROOT) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(PREFIX) && !is_live(&name) && e.path().is_dir() {
                kill_cgroup_tree(&e.path());
                remove_cgroup_tree(&e.path());
                cgroups += 1;
            }
        }
    }
    (netns, cgroups)
}

fn kill_netns_pids(ns: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
}

fn kill_cgroup_tree(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.path().is_dir() {
            kill_cgroup_tree(&e.path());
        }
    }
    if let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) {
        for pid in procs.split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
}

fn remove_cgroup_tree(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.path().is_dir() {
            remove_cgroup_tree(&e.path());
        }
    }
    // A cgroup can only be removed once its processes have exited; give SIGKILLed ones a
    // moment to be reaped.
    for _ in 0..50 {
        match fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    warn!(cgroup = %dir.display(), "cgroup still busy; `cargo xtask testbed clean` removes it later");
}

fn list_netns() -> Vec<String> {
    fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

static LIVE: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn register(tb: &Testbed) {
    if let Ok(mut l) = LIVE.lock() {
        l.push(tb.id.clone());
    }
}

fn unregister(id: &str) {
    if let Ok(mut l) = LIVE.lock() {
        l.retain(|i| i != id);
    }
}

/// On Ctrl-C (or SIGTERM), removes every live testbed of this process before exiting, since
/// destructors do not run when a signal ends the process.
fn install_interrupt_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let result = ctrlc::set_handler(|| {
            let ids: Vec<String> = LIVE.lock().map(|l| l.clone()).unwrap_or_default();
            for id in &ids {
                teardown_named(id);
            }
            let _ = writeln!(
                io::stderr(),
                "interrupted: removed {} testbed(s)",
                ids.len()
            );
            std::process::exit(130);
        });
        if let Err(e) = result {
            // The host program installed its own handler; it must call `clean_stale`.
            debug!(error = %e, "interrupt handler not installed");
        }
    });
}

fn unique_id() -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mix = std::process::id().wrapping_mul(2_654_435_761)
        ^ nanos
        ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(40_503);
    // Interface names are limited to 15 bytes: "sk" + 6 + "p" + up to 3 digits fits.
    format!("{:06x}", mix & 0x00ff_ffff)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

fn mkdir(path: &Path) -> Result<()> {
    fs::create_dir(path).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })
}

fn add_netns(name: &str) -> Result<()> {
    ip(&["netns", "add", name])?;
    // IPv6 must be on (a host may default new namespaces to disable_ipv6=1) and DAD off
    // (interfaces created from now on inherit `default`), so addresses work immediately.
    for key in [
        "net.ipv6.conf.all.disable_ipv6",
        "net.ipv6.conf.default.disable_ipv6",
        "net.ipv6.conf.all.accept_dad",
        "net.ipv6.conf.default.accept_dad",
    ] {
        sysctl(name, key, "0")?;
    }
    ip(&["-n", name, "link", "set", "lo", "up"])?;
    Ok(())
}

/// Adds an IPv6 address without duplicate address detection (usable at once).
fn add_addr6(netns: &str, cidr: &str, dev: &str) -> Result<()> {
    ip(&["-n", netns, "addr", "add", cidr, "dev", dev, "nodad"])
}

fn sysctl(netns: &str, key: &str, value: &str) -> Result<()> {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/run/netns/{netns}"))
        .args(["sysctl", "-qw", &format!("{key}={value}")]);
    checked_output(&mut cmd).map(drop)
}

fn ip(args: &[&str]) -> Result<()> {
    checked_output(Command::new("ip").args(args)).map(drop)
}

fn nft(netns: &str, script: &str) -> Result<()> {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/run/netns/{netns}"))
        .args(["nft", "-f", "-"]);
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| Error::Spawn {
            cmd: "nft -f -".into(),
            source,
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|source| Error::Spawn {
                cmd: "nft -f -".into(),
                source,
            })?;
    }
    let out = child.wait_with_output().map_err(|source| Error::Spawn {
        cmd: "nft -f -".into(),
        source,
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Command {
            cmd: format!("nft -f - <<EOF\n{script}EOF"),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// Runs a command, turning a non-zero exit into an error that carries its stderr.
///
/// # Errors
/// If the command cannot start or exits non-zero.
pub fn checked_output(cmd: &mut Command) -> Result<Output> {
    let out = cmd.output().map_err(|source| Error::Spawn {
        cmd: format!("{cmd:?}"),
        source,
    })?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(Error::Command {
            cmd: format!("{cmd:?}"),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
