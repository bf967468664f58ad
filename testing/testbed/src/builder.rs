//! Building a topology: the [`Builder`] checks the description, then [`Testbed`] creates
//! every namespace, veth, address, route and cgroup it names (the DNAT is [`crate::nft`]'s).

use std::{
    collections::{BTreeMap, HashSet},
    fs,
    net::Ipv4Addr,
    path::Path,
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    time::{SystemTime, UNIX_EPOCH},
};

use crate::{
    BALANCER_IP, BALANCER_IP6, CGROUP2_ROOT, Error, Node, PREFIX, Pod, Result, Service, Testbed,
    addr, cleanup,
    process::{checked_output, ip},
};

/// Describes a topology to build.
#[derive(Clone, Debug, Default)]
pub struct Builder {
    nodes: usize,
    pods: Vec<(String, usize)>,
    services: Vec<Service>,
    without_balancer_address: bool,
    pod_cgroup_parent: Option<String>,
}

impl Builder {
    /// Leaves the balancer address off the nodes' `lo` (the agent adds it itself).
    #[must_use]
    pub fn without_balancer_address(mut self) -> Self {
        self.without_balancer_address = true;
        self
    }

    /// Puts every pod's cgroup below `parent` (a relative path, e.g. kind's
    /// `kubelet.slice/kubelet-kubepods.slice`) in the testbed's cgroup directory, as a
    /// kubelet's layout has it; by default pods are directly in it.
    #[must_use]
    pub fn pod_cgroup_parent(mut self, parent: &str) -> Self {
        self.pod_cgroup_parent = Some(parent.to_owned());
        self
    }

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
        let mut seen = HashSet::new();
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
        cleanup::install_interrupt_handler();
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
        cleanup::register(&tb);
        // Drop cleans up whatever exists if any step fails.
        tb.create(
            nodes,
            &self.pods,
            !self.without_balancer_address,
            self.pod_cgroup_parent.as_deref(),
        )?;
        for svc in self.services {
            tb.services.insert(svc.name.clone(), svc);
        }
        tb.write_nat_rules()?;
        Ok(tb)
    }
}

impl Testbed {
    fn create(
        &mut self,
        nodes: usize,
        pods: &[(String, usize)],
        balancer_address: bool,
        pod_cgroup_parent: Option<&str>,
    ) -> Result<()> {
        mkdir(&self.cgroup_root)?;
        let mut pods_cgroup = self.cgroup_root.clone();
        for part in pod_cgroup_parent.iter().flat_map(|p| p.split('/')) {
            pods_cgroup.push(part);
            mkdir(&pods_cgroup)?;
        }
        let fabric = format!("{PREFIX}{}-fabric", self.id);
        add_netns(&fabric)?;
        self.fabric = Some(fabric.clone());
        ip(&["-n", &fabric, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &fabric, "link", "set", "br0", "up"])?;
        for index in 0..nodes {
            let netns = format!("{PREFIX}{}-node{index}", self.id);
            add_netns(&netns)?;
            let fabric_ip = addr::fabric_ip(index);
            let fabric_ip6 = addr::fabric_ip6(index);
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
            if balancer_address {
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
            }
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
            let (gw, pod_ip) = (addr::pod_ip(subnet, true), addr::pod_ip(subnet, false));
            let (gw6, pod_ip6) = (addr::pod_ip6(subnet, true), addr::pod_ip6(subnet, false));
            let cgroup = pods_cgroup.join(name);
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
                        &addr::pod_subnet(subnet),
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
                        &addr::pod_subnet6(subnet),
                        "via",
                        &fabric_ip6.to_string(),
                    ])?;
                }
            }
        }
        Ok(())
    }
}

pub(crate) fn unique_id() -> String {
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
