//! Privileged: real gRPC clients (grpcio, @grpc/grpc-js, tonic) through the real VIP, the
//! eBPF redirect and the real `skewless agent`, against tonic echo backends in testbed pods.
//! Run with `cargo xtask test` (as root; the venv and npm packages come from `cargo xtask
//! setup`). Every load is bounded in count and time; the testbed removes everything on drop.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    time::{Duration, Instant},
};

use skewless_clients::{
    ClientKind, ClientResult, ClientSpec, Harness,
    framelog::{self, Dir, LogLine, Withhold},
};
use skewless_testbed::{Place, Testbed};

const ADMIN: &str = "127.0.0.1:9990";
const PORT: u16 = 50051;

/// One node; `backends` tonic echo pods (`echo-N`, all running; the Service's endpoints are
/// chosen per test); client pods; the agent on a services file.
struct ClientBed {
    tb: Testbed,
    harness: Harness,
    vip: SocketAddrV4,
    services: PathBuf,
    backends: Vec<String>,
    clients: Vec<String>,
    agent: Option<u32>,
}

/// How the echo backends run.
#[derive(Clone, Copy, Default)]
struct Backends {
    /// Their own max connection age (they GOAWAY their clients, here: the balancer).
    max_age: Option<Duration>,
}

impl ClientBed {
    fn new(octet: u8, backends: usize, clients: &[&str], opts: Backends) -> Self {
        let harness = Harness::new().expect("the harness (run `cargo xtask setup`)");
        let vip = SocketAddrV4::new(Ipv4Addr::new(198, 19, 0, octet), PORT);
        let names: Vec<String> = (0..backends).map(|i| format!("echo-{i}")).collect();
        let mut b = Testbed::builder().nodes(1);
        for c in clients {
            b = b.pod(c, 0);
        }
        for n in &names {
            b = b.pod(n, 0);
        }
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut tb = b
            .service("echo", *vip.ip(), PORT, PORT, &refs)
            .build()
            .expect("testbed builds (needs root)");
        let echo = harness.bin("skewless-echo").display().to_string();
        let age = opts.max_age.map_or(0, |d| d.as_millis()).to_string();
        for n in &names {
            tb.spawn(
                Place::Pod(n),
                &[
                    &echo,
                    "--listen",
                    &format!("0.0.0.0:{PORT}"),
                    "--name",
                    n,
                    "--max-connection-age-ms",
                    &age,
                ],
            )
            .unwrap();
        }
        for n in &names {
            let ip = tb.pod(n).unwrap().ip;
            tb.wait_for_tcp(
                Place::Node(0),
                SocketAddrV4::new(ip, PORT),
                Duration::from_secs(20),
            )
            .unwrap();
        }
        let services = std::env::temp_dir().join(format!("skewless-clients-{}.yaml", tb.id()));
        Self {
            tb,
            harness,
            vip,
            services,
            backends: names,
            clients: clients.iter().map(|c| (*c).to_owned()).collect(),
            agent: None,
        }
    }

    /// The Service's endpoints (DNAT and services file alike), mode and annotations.
    fn configure(&mut self, mode: &str, annotations: &[(&str, &str)], endpoints: usize) {
        let eps: Vec<&str> = self.backends[..endpoints]
            .iter()
            .map(String::as_str)
            .collect();
        self.tb.set_backends("echo", &eps).unwrap();
        let mut yaml = format!(
            "services:\n  - name: echo\n    clusterIPs: [\"{}\"]\n    mode: {mode}\n",
            self.vip.ip()
        );
        if !annotations.is_empty() {
            yaml.push_str("    annotations:\n");
            for (k, v) in annotations {
                yaml.push_str(&format!("      skewless.io/{k}: \"{v}\"\n"));
            }
        }
        yaml.push_str(&format!(
            "    ports:\n      - port: {PORT}\n        targetPort: {PORT}\n    endpoints:\n"
        ));
        for e in &eps {
            let ip = self.tb.pod(e).unwrap().ip;
            yaml.push_str(&format!("      - {{address: {ip}, target: {e}}}\n"));
        }
        let tmp = self.services.with_extension("tmp");
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, &self.services).unwrap();
    }

    /// Starts the agent attached to every client pod (only their networks may use the
    /// balancer) and waits until the Service is redirected.
    fn start_agent(&mut self) {
        let mut argv: Vec<String> = vec![
            env!("CARGO_BIN_EXE_skewless").into(),
            "agent".into(),
            "--services-file".into(),
            self.services.display().to_string(),
            "--admin-addr".into(),
            ADMIN.into(),
        ];
        for c in &self.clients {
            let pod = self.tb.pod(c).unwrap();
            let [a, b, c3, _] = pod.ip.octets();
            argv.extend(["--cgroup".into(), pod.cgroup.display().to_string()]);
            argv.extend(["--pod-cidr".into(), format!("{a}.{b}.{c3}.0/24")]);
        }
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        self.agent = Some(self.tb.spawn(Place::Node(0), &argv).unwrap());
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.status()["services"]
            .as_array()
            .is_none_or(Vec::is_empty)
        {
            assert!(
                Instant::now() < deadline,
                "the agent redirects the Service within 20 s: {}",
                self.status()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn status(&self) -> serde_json::Value {
        let out = self
            .tb
            .command(
                Place::Node(0),
                &[
                    env!("CARGO_BIN_EXE_skewless"),
                    "status",
                    "--json",
                    "--admin-addr",
                    ADMIN,
                ],
            )
            .unwrap()
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or_default()
    }

    fn status_text(&self) -> String {
        let out = self
            .tb
            .run(
                Place::Node(0),
                &[
                    env!("CARGO_BIN_EXE_skewless"),
                    "status",
                    "--admin-addr",
                    ADMIN,
                ],
            )
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// An unlabelled counter from the agent's /metrics.
    fn metric(&self, name: &str) -> f64 {
        let url = format!("http://{ADMIN}/metrics");
        let out = self
            .tb
            .run(
                Place::Node(0),
                &["python3", skewless_testbed::scripts::HTTP_GET, &url],
            )
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in /metrics: {text}"))
    }

    /// Fails the test when the agent's heartbeat went stale during the run: connects were then
    /// sent direct (fail open, by design), so the run did not test the balancer alone. Seen
    /// only on a machine starved of CPU.
    fn assert_never_failed_open(&self) {
        let stale = self.metric("skewless_stale_heartbeat_total");
        assert!(
            stale < 1.0,
            "{stale} connect()s went direct because the agent's heartbeat was stale (the \
             machine is starved of CPU): this run did not test the balancer alone"
        );
    }

    fn target(&self) -> String {
        self.vip.to_string()
    }
}

impl Drop for ClientBed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.services);
    }
}

/// A frame-logging tap in `pod` on 127.0.0.1:`port` in front of the VIP: the client in that
/// pod dials it, the tap's own connect goes through the VIP and the redirect.
struct PodTap {
    log: PathBuf,
    addr: SocketAddrV4,
}

impl PodTap {
    fn start(bed: &mut ClientBed, pod: &str, withhold: Withhold) -> Self {
        let addr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 15100);
        let log = std::env::temp_dir().join(format!("skewless-tap-{}-{pod}.jsonl", bed.tb.id()));
        let argv = bed
            .harness
            .tap_argv(addr.into(), bed.vip.into(), withhold, &log);
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        bed.tb.spawn(Place::Pod(pod), &argv).unwrap();
        bed.tb
            .wait_for_tcp(Place::Pod(pod), addr, Duration::from_secs(10))
            .unwrap();
        Self { log, addr }
    }

    fn log(&self) -> Vec<LogLine> {
        framelog::read_log(&self.log).unwrap()
    }
}

impl Drop for PodTap {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.log);
    }
}

/// The load of the rotation tests: `in_flight` unary calls (each 250 ms on the server, so
/// every GOAWAY meets `in_flight` open streams while the rate stays bounded on a 2-core
/// machine: 200 in flight are ~800 calls/s), a server stream
/// and a bidi stream held open for `streams`, and 4 MiB calls one after another, for
/// `duration`.
fn rotation_load(
    target: &str,
    duration: Duration,
    in_flight: u32,
    streams: Duration,
) -> ClientSpec {
    ClientSpec {
        concurrency: in_flight,
        call_delay: Some(Duration::from_millis(250)),
        duration: Some(duration),
        timeout: Duration::from_secs(10),
        large_calls: 1000,
        stream: Some(streams),
        bidi: Some(streams),
        ..ClientSpec::unary(target, 10_000_000)
    }
}

fn summary(r: &ClientResult) -> String {
    let stream = |s: &Option<skewless_clients::StreamResult>| {
        s.as_ref().map_or_else(
            || "-".to_owned(),
            |s| format!("{}/{} {} {:?}", s.messages, s.expected, s.code, s.message),
        )
    };
    format!(
        "{} {}: unary {} ok, failed {:?}; 4 MiB {} ok (p50 {:?} ms), failed {:?} {:?}; server stream {}; \
         bidi {}; pods {:?}; first failures {:?}",
        r.client,
        r.version,
        r.unary.ok,
        r.unary.failed,
        r.large.ok,
        r.large.p50_ms,
        r.large.failed,
        r.large.failures.first(),
        stream(&r.server_stream),
        stream(&r.bidi),
        r.unary.pods,
        r.unary.failures.iter().take(3).collect::<Vec<_>>()
    )
}

/// Asserts the wire sequence of every rotated connection in a tap's log, as the client saw
/// it: GOAWAY(2^31-1, NO_ERROR), then a PING, then (after the client's ACK or a timeout) a
/// GOAWAY with the last stream the client opened, never a higher one, and the server's FIN.
/// Returns how many connections were rotated.
fn assert_two_phase_goaways(log: &[LogLine]) -> usize {
    let mut rotated = 0;
    for conn in framelog::http2_conns(log) {
        let down = framelog::frames(log, conn, Dir::ToClient);
        let Some(first) = down.iter().position(|f| f.kind == "GOAWAY") else {
            continue;
        };
        rotated += 1;
        let kinds: Vec<&str> = down.iter().map(|f| f.kind.as_str()).collect();
        assert_eq!(
            down[first].goaway.as_ref().map(|g| (g.0, g.1)),
            Some((skewless_frame::MAX_STREAM_ID, 0)),
            "connection {conn}: the first GOAWAY refuses nothing: {kinds:?}"
        );
        assert!(
            down[first..]
                .iter()
                .any(|f| f.ping.as_ref().is_some_and(|p| !p.0)),
            "connection {conn}: a PING follows the first GOAWAY: {kinds:?}"
        );
        let goaways: Vec<u32> = down
            .iter()
            .filter_map(|f| f.goaway.as_ref().map(|g| g.0))
            .collect();
        assert!(
            goaways.windows(2).all(|w| w[1] <= w[0]),
            "connection {conn}: no GOAWAY raises the last-stream-id: {goaways:?}"
        );
        let highest_opened = framelog::frames(log, conn, Dir::ToServer)
            .iter()
            .filter(|f| f.kind == "HEADERS")
            .map(|f| f.stream)
            .max()
            .unwrap_or(0);
        if let Some(&last) = goaways.last().filter(|_| goaways.len() > 1) {
            assert!(
                last <= highest_opened || highest_opened == 0,
                "connection {conn}: the final GOAWAY names a stream the client opened \
                 ({last} > {highest_opened})"
            );
        }
        let closed_by_server = log.iter().any(|l| {
            matches!(l, LogLine::End { conn: c, dir: Dir::ToClient, reset: false, .. } if *c == conn)
        });
        let still_open = !log
            .iter()
            .any(|l| matches!(l, LogLine::End { conn: c, .. } if *c == conn));
        assert!(
            closed_by_server || still_open,
            "connection {conn}: a rotated connection ends with the server's FIN, never a reset"
        );
    }
    rotated
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn request_mode_one_second_max_age_rotates_real_clients_without_failing_a_call() {
    // The two-phase GOAWAY of the request-mode balancer, every ~1 s per client connection:
    // what connection mode's rotation does on the wire, already real today.
    let clients = ["grpcio", "grpc-js", "tonic", "tapped"];
    let mut bed = ClientBed::new(40, 4, &clients, Backends::default());
    bed.configure("request", &[("max-connection-age", "1s")], 4);
    bed.start_agent();
    let target = bed.target();
    let run_for = Duration::from_secs(15);
    // Streams stay open across rotations (their own connection's GOAWAY comes after ~1 s, and
    // the other connections' meanwhile), and end inside the balancer's drain grace (10 s)
    // with room for a client that starts them late on a busy machine.
    let streams = Duration::from_secs(5);
    let tap = PodTap::start(&mut bed, "tapped", Withhold::default());
    // One client at a time (the tapped one beside the first): on a 2-core machine three
    // clients at 200 in flight at once starve each other, and a call slowed past the drain
    // grace is cut whoever rotates.
    let tapped_spec = ClientSpec {
        concurrency: 4,
        ..rotation_load(&tap.addr.to_string(), run_for, 4, streams)
    };
    let mut tapped = Some(
        bed.harness
            .spawn(
                &mut bed.tb,
                Place::Pod("tapped"),
                ClientKind::Grpcio,
                &tapped_spec,
            )
            .unwrap(),
    );
    let mut results = Vec::new();
    for (pod, kind) in [
        ("grpcio", ClientKind::Grpcio),
        ("grpc-js", ClientKind::GrpcJs),
        ("tonic", ClientKind::Tonic),
    ] {
        let spec = rotation_load(&target, run_for, 200, streams);
        let r = bed
            .harness
            .run(&mut bed.tb, Place::Pod(pod), kind, &spec)
            .unwrap();
        eprintln!("{}", summary(&r));
        results.push(r);
        if let Some(t) = tapped.take() {
            let r = t.wait(&mut bed.tb).unwrap();
            eprintln!("tapped: {}", summary(&r));
            results.push(r);
        }
    }
    bed.assert_never_failed_open();
    let (grpcio, tapped, grpc_js, tonic) = (&results[0], &results[1], &results[2], &results[3]);
    for r in [grpcio, grpc_js, tapped] {
        assert_eq!(
            r.failed_calls(),
            0,
            "no call may fail through the rotations: {}",
            summary(r)
        );
        assert!(r.unary.ok > 50, "the load ran: {}", summary(r));
        assert!(r.large.ok >= 1, "4 MiB calls went through: {}", summary(r));
        assert_eq!(
            r.unary.pods.len(),
            4,
            "request mode spreads the calls over every pod: {}",
            summary(r)
        );
    }
    // tonic is measured, not held to zero (it does not retry calls refused by a GOAWAY).
    assert!(tonic.unary.ok > 0, "tonic ran: {}", summary(tonic));
    let log = tap.log();
    let conns = framelog::http2_conns(&log).len();
    let rotated = assert_two_phase_goaways(&log);
    eprintln!("tapped grpcio client: {conns} connections in {run_for:?}, {rotated} rotated");
    assert!(
        rotated >= 8,
        "a 1 s max age rotates the tapped client's connection about every second \
         ({rotated} rotated of {conns} in {run_for:?})"
    );
    eprintln!("{}", bed.status_text());
}
