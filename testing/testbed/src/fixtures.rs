//! Ready-made topologies shared by privileged tests.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, SocketAddrV6},
    path::Path,
    time::Duration,
};

use crate::{BALANCER_IP, BALANCER_IP6, Place, Result, Testbed, checked_output, scripts};

/// One node; pods `client` and `bystander`; three ident servers (`server-N`, answering their
/// name on [`IdentBed::PORT`] and [`IdentBed::OTHER_PORT`]) behind Service `echo`
/// ([`IdentBed::VIP`] on both ports) and Service `other` ([`IdentBed::OTHER_VIP`]); and an
/// ident server answering `balancer` on [`BALANCER_IP`]:[`IdentBed::BALANCER_PORT`] in the
/// node, standing in for the node balancer. Tells, per connection, where it really went.
///
/// Dual-stack: the ident servers listen on `::` (both families), every Service also has an
/// IPv6 VIP ([`IdentBed::vip6`]), and a second `balancer` answers on
/// [`BALANCER_IP6`]:[`IdentBed::BALANCER_PORT`] ([`IdentBed::balancer6`]).
pub struct IdentBed {
    pub tb: Testbed,
}

impl IdentBed {
    pub const VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
    pub const OTHER_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 11);
    pub const PORT: u16 = 8080;
    pub const OTHER_PORT: u16 = 9090;
    pub const BALANCER_PORT: u16 = 15001;
    pub const SERVERS: [&'static str; 3] = ["server-0", "server-1", "server-2"];

    /// # Errors
    /// When the testbed cannot be built or a server does not come up.
    pub fn new() -> Result<Self> {
        let servers = Self::SERVERS;
        let mut tb = Testbed::builder()
            .nodes(1)
            .pod("client", 0)
            .pod("bystander", 0)
            .pod(servers[0], 0)
            .pod(servers[1], 0)
            .pod(servers[2], 0)
            .service("echo", Self::VIP, Self::PORT, Self::PORT, &servers)
            .service(
                "echo-admin",
                Self::VIP,
                Self::OTHER_PORT,
                Self::OTHER_PORT,
                &servers,
            )
            .service("other", Self::OTHER_VIP, Self::PORT, Self::PORT, &servers)
            .build()?;
        let (port, other) = (Self::PORT.to_string(), Self::OTHER_PORT.to_string());
        for s in servers {
            tb.spawn(
                Place::Pod(s),
                &["python3", scripts::IDENT_SERVER, s, "::", &port, &other],
            )?;
        }
        let balancer = SocketAddrV4::new(BALANCER_IP, Self::BALANCER_PORT);
        let (ip, bport) = (BALANCER_IP.to_string(), Self::BALANCER_PORT.to_string());
        tb.spawn(
            Place::Node(0),
            &["python3", scripts::IDENT_SERVER, "balancer", &ip, &bport],
        )?;
        let ip6 = BALANCER_IP6.to_string();
        tb.spawn(
            Place::Node(0),
            &["python3", scripts::IDENT_SERVER, "balancer", &ip6, &bport],
        )?;
        let timeout = Duration::from_secs(10);
        for s in servers {
            let (pod_ip, pod_ip6) = (tb.pod(s)?.ip, tb.pod(s)?.ip6);
            for p in [Self::PORT, Self::OTHER_PORT] {
                tb.wait_for_tcp(Place::Node(0), SocketAddrV4::new(pod_ip, p), timeout)?;
                tb.wait_for_tcp(Place::Node(0), SocketAddrV6::new(pod_ip6, p, 0, 0), timeout)?;
            }
        }
        tb.wait_for_tcp(Place::Node(0), balancer, timeout)?;
        tb.wait_for_tcp(Place::Node(0), Self::balancer6(), timeout)?;
        Ok(Self { tb })
    }

    #[must_use]
    pub fn vip() -> SocketAddrV4 {
        SocketAddrV4::new(Self::VIP, Self::PORT)
    }

    #[must_use]
    pub fn balancer() -> SocketAddrV4 {
        SocketAddrV4::new(BALANCER_IP, Self::BALANCER_PORT)
    }

    /// Service `echo`'s IPv6 VIP and port.
    #[must_use]
    pub fn vip6() -> SocketAddrV6 {
        SocketAddrV6::new(crate::vip6(Self::VIP), Self::PORT, 0, 0)
    }

    /// The IPv6 balancer stand-in.
    #[must_use]
    pub fn balancer6() -> SocketAddrV6 {
        SocketAddrV6::new(BALANCER_IP6, Self::BALANCER_PORT, 0, 0)
    }

    /// `ip:port` as the probe scripts print a peer (no brackets around IPv6 addresses).
    #[must_use]
    pub fn peer_string(addr: impl Into<SocketAddr>) -> String {
        let addr = addr.into();
        format!("{}:{}", addr.ip(), addr.port())
    }

    /// Opens `n` connections from `pod` to `addr` (either family) one after another and
    /// tallies who answered (`ERR` for failed connects).
    ///
    /// # Errors
    /// When the probe cannot run or does not report every connection.
    pub fn probe(&self, pod: &str, addr: impl Into<SocketAddr>, n: usize) -> Result<Tally> {
        let addr = addr.into();
        self.probe_host(pod, &addr.ip().to_string(), addr.port(), n)
    }

    /// Opens `n` connections like [`IdentBed::probe`], but through an IPv6 socket to the
    /// IPv4-mapped address `::ffff:a.b.c.d` (what dual-stack clients do).
    ///
    /// # Errors
    /// As [`IdentBed::probe`].
    pub fn probe_v4_mapped(&self, pod: &str, addr: SocketAddrV4, n: usize) -> Result<Tally> {
        self.probe_host(pod, &format!("::ffff:{}", addr.ip()), addr.port(), n)
    }

    /// Connects a UDP socket from `pod` to `addr` and returns what getpeername reports.
    ///
    /// # Errors
    /// When the script cannot run.
    pub fn udp_peer(&self, pod: &str, addr: impl Into<SocketAddr>) -> Result<String> {
        let addr = addr.into();
        let (host, port) = (addr.ip().to_string(), addr.port().to_string());
        let out = self.tb.run(
            Place::Pod(pod),
            &["python3", scripts::UDP_PEER, &host, &port],
        )?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Opens `n` connections like [`IdentBed::probe`], from a process that first moves on
    /// into `cgroup`, a cgroup below the pod's ([`Testbed::child_cgroup`]).
    ///
    /// # Errors
    /// As [`IdentBed::probe`].
    pub fn probe_in(
        &self,
        pod: &str,
        cgroup: &Path,
        addr: impl Into<SocketAddr>,
        n: usize,
    ) -> Result<Tally> {
        let addr = addr.into();
        let (host, port, count) = (
            addr.ip().to_string(),
            addr.port().to_string(),
            n.to_string(),
        );
        let argv = ["python3", scripts::PROBE, &host, &port, &count];
        let out = checked_output(&mut self.tb.command_in(Place::Pod(pod), cgroup, &argv)?)?;
        Ok(Tally::of_probe(&out.stdout, n))
    }

    fn probe_host(&self, pod: &str, host: &str, port: u16, n: usize) -> Result<Tally> {
        let (port, count) = (port.to_string(), n.to_string());
        let argv = ["python3", scripts::PROBE, host, &port, &count];
        let out = self.tb.run(Place::Pod(pod), &argv)?;
        Ok(Tally::of_probe(&out.stdout, n))
    }
}

/// Who answered how many connections, and which peer address getpeername reported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tally(pub BTreeMap<String, usize>, pub Peers);

/// getpeername results as `ip:port` -> count.
pub type Peers = BTreeMap<String, usize>;

impl Tally {
    /// The tally of `n` probes from the probe script's output.
    ///
    /// # Panics
    /// If the output does not report every probe.
    fn of_probe(stdout: &[u8], n: usize) -> Self {
        let mut tally = Tally::default();
        for line in String::from_utf8_lossy(stdout).lines() {
            let mut words = line.split_whitespace();
            let who = words.next().unwrap_or("EMPTY").to_owned();
            *tally.0.entry(who).or_default() += 1;
            let peer = words.next().unwrap_or("none").to_owned();
            *tally.1.entry(peer).or_default() += 1;
        }
        assert_eq!(tally.total(), n, "every probe must report: {tally:?}");
        tally
    }

    #[must_use]
    pub fn total(&self) -> usize {
        self.0.values().sum()
    }

    /// Whether getpeername reported `peer` (`ip:port`) for every connection.
    #[must_use]
    pub fn peer_always(&self, peer: &str) -> bool {
        self.1.len() == 1 && self.1.contains_key(peer)
    }

    /// Whether `who` answered every connection.
    #[must_use]
    pub fn only(&self, who: &str) -> bool {
        self.0.len() == 1 && self.0.contains_key(who)
    }

    /// Whether only the ident servers (never the balancer, never an error) answered.
    #[must_use]
    pub fn all_servers(&self) -> bool {
        self.0
            .keys()
            .all(|k| IdentBed::SERVERS.contains(&k.as_str()))
    }
}
