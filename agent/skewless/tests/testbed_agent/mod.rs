//! What the privileged agent tests (`agent`, `metrics`) share: the echo testbed, the services
//! file, launching the real agent in the node, and reading its admin API from inside the node.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of these helpers"
)]

use std::{net::SocketAddrV4, time::Duration};

use skewless_testbed::Place;

pub const ADMIN: &str = "127.0.0.1:9990";

/// A file under the temp directory, removed when dropped (also when a test fails).
pub struct TempPath(std::path::PathBuf);

impl TempPath {
    pub fn new(name: String) -> Self {
        Self(std::env::temp_dir().join(name))
    }
}

impl std::ops::Deref for TempPath {
    type Target = std::path::Path;

    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for TempPath {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Writes the services file the agent reads: one Service `echo` at `vip` over `pods`.
pub fn write_services(
    path: &std::path::Path,
    tb: &skewless_testbed::Testbed,
    vip: SocketAddrV4,
    mode: &str,
    pods: &[&str],
) {
    write_services_ips(path, tb, &[vip.ip().to_string()], vip.port(), mode, pods);
}

/// Like [`write_services`], with any ClusterIPs (a dual-stack Service lists both).
pub fn write_services_ips(
    path: &std::path::Path,
    tb: &skewless_testbed::Testbed,
    cluster_ips: &[String],
    port: u16,
    mode: &str,
    pods: &[&str],
) {
    write_services_full(path, tb, cluster_ips, port, mode, pods, false);
}

/// The services file with any ClusterIPs; with `ipv6_endpoints` every pod is also listed
/// with its IPv6 address (what a dual-stack Service's IPv6 EndpointSlice holds).
pub fn write_services_full(
    path: &std::path::Path,
    tb: &skewless_testbed::Testbed,
    cluster_ips: &[String],
    port: u16,
    mode: &str,
    pods: &[&str],
    ipv6_endpoints: bool,
) {
    let mut yaml = String::from("services:\n");
    yaml.push_str(
        &tb.services_entry(&skewless_testbed::FileService {
            name: "echo",
            cluster_ips,
            port,
            mode,
            pods,
            ipv6_endpoints,
        })
        .unwrap(),
    );
    // Write-then-rename: the agent polls the file and must never read half of it.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, yaml).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

pub fn services_in_status(tb: &skewless_testbed::Testbed) -> usize {
    status_json(tb)["services"].as_array().map_or(0, Vec::len)
}

pub fn status_json(tb: &skewless_testbed::Testbed) -> serde_json::Value {
    status_json_at(tb, ADMIN)
}

/// `skewless status --json` run in the node against the agent serving its admin API at
/// `admin`; `Null` when it does not answer.
pub fn status_json_at(tb: &skewless_testbed::Testbed, admin: &str) -> serde_json::Value {
    let out = tb
        .command(
            Place::Node(0),
            &[
                env!("CARGO_BIN_EXE_skewless"),
                "status",
                "--json",
                "--admin-addr",
                admin,
            ],
        )
        .unwrap()
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or_default()
}

/// `skewless status` (the table) run in the node against the agent at [`ADMIN`].
pub fn status_text(tb: &skewless_testbed::Testbed) -> String {
    let out = tb
        .run(
            Place::Node(0),
            &[
                env!("CARGO_BIN_EXE_skewless"),
                "status",
                "--admin-addr",
                ADMIN,
            ],
        )
        .expect("skewless status runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Four grpcio echo pods behind `vip`, a client pod, the Python stubs.
pub fn echo_bed(
    vip: SocketAddrV4,
    pods: &[&str],
) -> (skewless_testbed::Testbed, std::path::PathBuf) {
    echo_bed_with(vip, pods, |b| b)
}

/// [`echo_bed`] with more of the testbed's options (`shape` gets the builder).
pub fn echo_bed_with(
    vip: SocketAddrV4,
    pods: &[&str],
    shape: impl FnOnce(skewless_testbed::Builder) -> skewless_testbed::Builder,
) -> (skewless_testbed::Testbed, std::path::PathBuf) {
    use skewless_testbed::{Testbed, grpc};
    let mut b = shape(Testbed::builder()).nodes(1).pod("client", 0);
    for p in pods {
        b = b.pod(p, 0);
    }
    let mut tb = b
        .service("echo", *vip.ip(), vip.port(), vip.port(), pods)
        .build()
        .expect("testbed builds (needs root)");
    let gen_dir = grpc::generate_stubs().expect("python stubs (run `cargo xtask setup`)");
    for p in pods {
        grpc::spawn_echo_server(&mut tb, &gen_dir, p, vip.port(), 0).unwrap();
    }
    for p in pods {
        let ip = tb.pod(p).unwrap().ip;
        tb.wait_for_tcp(
            Place::Node(0),
            SocketAddrV4::new(ip, vip.port()),
            Duration::from_secs(20),
        )
        .unwrap();
    }
    (tb, gen_dir)
}

/// Starts the agent on a services file, attached to the client pod; waits for its admin API.
pub fn spawn_file_agent(tb: &mut skewless_testbed::Testbed, services: &std::path::Path) -> u32 {
    spawn_file_agent_with(tb, services, &[])
}

/// [`spawn_file_agent`] with more flags.
pub fn spawn_file_agent_with(
    tb: &mut skewless_testbed::Testbed,
    services: &std::path::Path,
    extra: &[&str],
) -> u32 {
    spawn_file_agent_at(tb, services, ADMIN, extra)
}

/// [`spawn_file_agent_with`] serving its admin API at `admin` (a second agent beside the
/// first, as in a rolling update).
pub fn spawn_file_agent_at(
    tb: &mut skewless_testbed::Testbed,
    services: &std::path::Path,
    admin: &str,
    extra: &[&str],
) -> u32 {
    let cgroup = tb.pod("client").unwrap().cgroup.display().to_string();
    let file = services.display().to_string();
    let mut argv = vec![
        env!("CARGO_BIN_EXE_skewless"),
        "agent",
        "--services-file",
        &file,
        "--cgroup",
        &cgroup,
        "--admin-addr",
        admin,
    ];
    argv.extend_from_slice(extra);
    let pid = tb.spawn(Place::Node(0), &argv).unwrap();
    tb.wait_for_tcp(
        Place::Node(0),
        admin.parse::<SocketAddrV4>().unwrap(),
        Duration::from_secs(10),
    )
    .expect("agent serves its admin API");
    pid
}

/// The balancer address on the node's `lo`, as `ip -o addr` shows it (with its label), if
/// present.
pub fn balancer_address_line(tb: &skewless_testbed::Testbed) -> Option<String> {
    let out = tb
        .run(
            Place::Node(0),
            &["ip", "-o", "-4", "addr", "show", "dev", "lo"],
        )
        .expect("ip addr runs in the node");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.contains(&format!(" {}/32 ", skewless_testbed::BALANCER_IP)))
        .map(str::to_owned)
}

/// A long-running pick_first grpcio client in the client pod: one connection, calls until
/// killed (or until `extra` args such as `--duration` say otherwise).
pub fn spawn_long_client(
    tb: &mut skewless_testbed::Testbed,
    gen_dir: &std::path::Path,
    vip: impl std::fmt::Display,
    concurrency: u32,
    extra: &[&str],
) -> u32 {
    use skewless_testbed::grpc;
    let (py, client) = (grpc::python(), grpc::script("echo_client.py"));
    let (gen_arg, target, conc) = (
        gen_dir.display().to_string(),
        vip.to_string(),
        concurrency.to_string(),
    );
    let mut argv = vec![
        py.to_str().unwrap(),
        client.to_str().unwrap(),
        "--gen",
        &gen_arg,
        "--target",
        &target,
        "--calls",
        "1000000",
        "--concurrency",
        &conc,
    ];
    argv.extend_from_slice(extra);
    tb.spawn(Place::Pod("client"), &argv).unwrap()
}

pub const ECHO_PODS: [&str; 4] = ["echo-0", "echo-1", "echo-2", "echo-3"];

/// One unlabelled metric's value from the agent's /metrics.
pub fn metric(tb: &skewless_testbed::Testbed, name: &str) -> f64 {
    let metrics = node_get(tb, &format!("http://{ADMIN}/metrics"));
    metrics
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("{name} in /metrics: {metrics}"))
}

/// The body of `GET url` (`http://ADDR/PATH`) from node 0's network namespace, made in this
/// process: a thread enters the namespace to open the socket, which stays in it. Panics on
/// anything but a 200. (A client process per request costs 0.1-0.3 s of start-up, which tests
/// that query hundreds of times pay in minutes.)
pub fn node_get(tb: &skewless_testbed::Testbed, url: &str) -> String {
    use std::io::{Read as _, Write as _};
    let rest = url
        .strip_prefix("http://")
        .unwrap_or_else(|| panic!("{url}: not http://"));
    let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let addr: std::net::SocketAddr = host.parse().unwrap_or_else(|e| panic!("{url}: {e}"));
    let netns = format!("/run/netns/{}", tb.node(0).netns);
    let mut stream = std::thread::spawn(move || {
        let ns = std::fs::File::open(&netns).unwrap_or_else(|e| panic!("{netns}: {e}"));
        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
    })
    .join()
    .unwrap()
    .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // HTTP/1.0: the server closes the connection after the body, which is then read to EOF.
    write!(
        stream,
        "GET {} HTTP/1.0\r\nHost: {host}\r\n\r\n",
        if path.is_empty() { "/" } else { path }
    )
    .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let response = String::from_utf8(response).expect("utf-8");
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("GET {url}: no header end in {response:?}"));
    let status = head.split_whitespace().nth(1).unwrap_or_default();
    assert_eq!(status, "200", "GET {url}: {head}\n{body}");
    body.to_owned()
}

/// The testbed of the end-to-end metrics and status-page tests: four grpcio echo pods (the
/// last answering 20 ms late) and a client pod; `echo` in request mode, `obs` observed and
/// `conn` in connection mode over the same pods, and a Service `bad` the agent rejects; the
/// agent running on the services file, both balanced Services redirected. No client yet:
/// [`ThreeModes::spawn_clients`].
pub struct ThreeModes {
    pub tb: skewless_testbed::Testbed,
    pub gen_dir: std::path::PathBuf,
    pub services: TempPath,
    pub balanced: SocketAddrV4,
    pub observed: SocketAddrV4,
    pub relayed: SocketAddrV4,
    /// When the agent was started.
    pub traffic_from: std::time::SystemTime,
}

impl ThreeModes {
    pub fn start() -> Self {
        use skewless_testbed::{Testbed, grpc};
        use std::net::Ipv4Addr;
        let balanced = SocketAddrV4::new(Ipv4Addr::new(198, 19, 0, 42), 50051);
        let observed = SocketAddrV4::new(Ipv4Addr::new(198, 19, 0, 43), 50051);
        let relayed = SocketAddrV4::new(Ipv4Addr::new(198, 19, 0, 44), 50051);
        let mut b = Testbed::builder().nodes(1).pod("client", 0);
        for p in ECHO_PODS {
            b = b.pod(p, 0);
        }
        let mut tb = b
            .service(
                "echo",
                *balanced.ip(),
                balanced.port(),
                balanced.port(),
                &ECHO_PODS,
            )
            .service(
                "obs",
                *observed.ip(),
                observed.port(),
                observed.port(),
                &ECHO_PODS,
            )
            .service(
                "conn",
                *relayed.ip(),
                relayed.port(),
                relayed.port(),
                &ECHO_PODS,
            )
            .build()
            .expect("testbed builds (needs root)");
        let gen_dir = grpc::generate_stubs().expect("python stubs (run `cargo xtask setup`)");
        // The last pod answers 20 ms late: the balancer sends it probes only, which the
        // panels show (its share below the fair line, the balancer's skew at 4/3).
        for (i, p) in ECHO_PODS.iter().enumerate() {
            let delay = if i == ECHO_PODS.len() - 1 { 20 } else { 0 };
            grpc::spawn_echo_server(&mut tb, &gen_dir, p, balanced.port(), delay).unwrap();
        }
        for p in ECHO_PODS {
            let ip = tb.pod(p).unwrap().ip;
            tb.wait_for_tcp(
                Place::Node(0),
                SocketAddrV4::new(ip, balanced.port()),
                Duration::from_secs(20),
            )
            .unwrap();
        }
        let services = TempPath::new(format!("skewless-test-services-{}.yaml", tb.id()));
        write_three_services(&services, &tb, balanced, observed, relayed);
        let traffic_from = std::time::SystemTime::now();
        // The requests and limits a DaemonSet's downward API would pass.
        spawn_file_agent_with(
            &mut tb,
            &services,
            &[
                "--cpu-request-millicores",
                "100",
                "--cpu-limit-millicores",
                "2000",
                "--memory-request-bytes",
                "67108864",
                "--memory-limit-bytes",
                "268435456",
            ],
        );
        wait_until("the agent redirects the balanced Services", || {
            services_in_status(&tb) == 2
        });
        Self {
            tb,
            gen_dir,
            services,
            balanced,
            observed,
            relayed,
            traffic_from,
        }
    }

    /// One pinned pick_first grpcio client per Service (one connection each, 2 calls in
    /// flight, until the test ends); their PIDs.
    pub fn spawn_clients(&mut self) -> Vec<u32> {
        [self.balanced, self.observed, self.relayed]
            .into_iter()
            .map(|vip| spawn_long_client(&mut self.tb, &self.gen_dir, vip, 2, &[]))
            .collect()
    }
}

/// The services file of the end-to-end test: `echo` balanced (request mode) at `balanced`,
/// `obs` observed at `observed` and `conn` in connection mode at `relayed`, over the same
/// pods, and `bad` with an invalid annotation (so the rejection counter has a series).
fn write_three_services(
    path: &std::path::Path,
    tb: &skewless_testbed::Testbed,
    balanced: SocketAddrV4,
    observed: SocketAddrV4,
    relayed: SocketAddrV4,
) {
    let mut yaml = String::from("services:\n");
    for (name, vip, mode) in [
        ("echo", balanced, "request"),
        ("obs", observed, "observe"),
        ("conn", relayed, "connection"),
    ] {
        yaml.push_str(
            &tb.services_entry(&skewless_testbed::FileService {
                name,
                cluster_ips: &[vip.ip().to_string()],
                port: vip.port(),
                mode,
                pods: &ECHO_PODS,
                ipv6_endpoints: false,
            })
            .unwrap(),
        );
    }
    yaml.push_str(
        "  - name: bad\n    clusterIPs: [\"198.19.0.99\"]\n    mode: request\n    annotations:\n      skewless.io/hold-time: soon\n    ports:\n      - port: 80\n        targetPort: 80\n",
    );
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, yaml).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A dual-stack echo Service: its IPv4 VIP `198.19.0.<octet>:50051`, the IPv6 twin the
/// testbed gives it, and the path its services file goes to.
pub struct DualStack {
    pub tb: skewless_testbed::Testbed,
    pub gen_dir: std::path::PathBuf,
    pub vip: SocketAddrV4,
    pub vip6: std::net::SocketAddrV6,
    pub services: TempPath,
    /// Both ClusterIPs, as the services file lists them.
    pub ips: [String; 2],
}

pub fn dual_stack_bed(octet: u8) -> DualStack {
    let vip = SocketAddrV4::new(std::net::Ipv4Addr::new(198, 19, 0, octet), 50051);
    let vip6 = std::net::SocketAddrV6::new(skewless_testbed::vip6(*vip.ip()), vip.port(), 0, 0);
    let (tb, gen_dir) = echo_bed(vip, &ECHO_PODS);
    let services = TempPath::new(format!("skewless-test-services-{}.yaml", tb.id()));
    let ips = [vip.ip().to_string(), vip6.ip().to_string()];
    DualStack {
        tb,
        gen_dir,
        vip,
        vip6,
        services,
        ips,
    }
}

/// Starts the agent on `d`'s services file with the testbed's IPv6 balancer address (plus
/// `extra` flags), attached to the client pod; waits until both families are redirected.
pub fn spawn_dual_stack_agent(d: &mut DualStack, extra: &[&str]) {
    start_dual_stack_agent(d, extra);
    wait_until("both families are redirected", || {
        services_in_status(&d.tb) == 2
    });
}

/// Starts the agent on `d`'s services file with the testbed's IPv6 balancer address (plus
/// `extra` flags), attached to the client pod.
pub fn start_dual_stack_agent(d: &mut DualStack, extra: &[&str]) {
    let cgroup = d.tb.pod("client").unwrap().cgroup.display().to_string();
    let file = d.services.display().to_string();
    let ip6 = skewless_testbed::BALANCER_IP6.to_string();
    let mut argv = vec![
        env!("CARGO_BIN_EXE_skewless"),
        "agent",
        "--services-file",
        &file,
        "--cgroup",
        &cgroup,
        "--balancer-ip6",
        &ip6,
        "--admin-addr",
        ADMIN,
    ];
    argv.extend_from_slice(extra);
    d.tb.spawn(Place::Node(0), &argv).unwrap();
}
