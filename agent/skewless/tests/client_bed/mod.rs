//! What the real-client tests (`clients`, `connection_mode`) share: a testbed with tonic echo
//! backends (optionally a frame-logging tap in front of one), client pods and the agent on a
//! services file; taps beside clients; the rotation load; the wire-sequence checks.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of these helpers"
)]

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    time::{Duration, Instant},
};

#[path = "../testbed_agent/mod.rs"]
mod testbed_agent;

use skewless_clients::{
    ClientKind, ClientResult, ClientSpec, Failure, Harness,
    framelog::{self, Dir, LogLine, Withhold},
};
use skewless_testbed::{Place, Testbed};

pub use testbed_agent::ADMIN;
pub const PORT: u16 = 50051;

/// One node; `backends` tonic echo pods (`echo-N`, all running; the Service's endpoints are
/// chosen per test); client pods; the agent on a services file.
pub struct ClientBed {
    pub tb: Testbed,
    pub harness: Harness,
    pub vip: SocketAddrV4,
    pub services: PathBuf,
    /// The log of the tap in front of `echo-0` (with [`Backends::tap_first`]).
    pub backend_log: PathBuf,
    pub backends: Vec<String>,
    pub clients: Vec<String>,
    pub agent: Option<u32>,
}

/// How the echo backends run.
#[derive(Clone, Copy, Default)]
pub struct Backends {
    /// Their own max connection age (they GOAWAY their clients, here: the balancer).
    pub max_age: Option<Duration>,
    /// A frame-logging tap in front of the first backend (`echo-0`): it listens on the
    /// backend's port and the backend on [`BACKEND_BEHIND_TAP`], so the log shows exactly
    /// what the backend receives ([`ClientBed::backend_log`]).
    pub tap_first: bool,
}

/// The port the first backend listens on when a tap stands in front of it.
pub const BACKEND_BEHIND_TAP: u16 = 50052;

impl ClientBed {
    pub fn new(octet: u8, backends: usize, clients: &[&str], opts: Backends) -> Self {
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
        let backend_log =
            std::env::temp_dir().join(format!("skewless-tap-{}-echo-0.jsonl", tb.id()));
        for (i, n) in names.iter().enumerate() {
            let behind_tap = opts.tap_first && i == 0;
            let listen = if behind_tap {
                format!("127.0.0.1:{BACKEND_BEHIND_TAP}")
            } else {
                format!("0.0.0.0:{PORT}")
            };
            tb.spawn(
                Place::Pod(n),
                &[
                    &echo,
                    "--listen",
                    &listen,
                    "--name",
                    n,
                    "--max-connection-age-ms",
                    &age,
                ],
            )
            .unwrap();
            if behind_tap {
                let argv = harness.tap_argv(
                    SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, PORT).into(),
                    SocketAddrV4::new(Ipv4Addr::LOCALHOST, BACKEND_BEHIND_TAP).into(),
                    Withhold::default(),
                    &backend_log,
                );
                let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
                tb.spawn(Place::Pod(n), &argv).unwrap();
            }
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
            backend_log,
            backends: names,
            clients: clients.iter().map(|c| (*c).to_owned()).collect(),
            agent: None,
        }
    }

    /// The Service's endpoints (DNAT and services file alike), mode and annotations.
    pub fn configure(&mut self, mode: &str, annotations: &[(&str, &str)], endpoints: usize) {
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
    pub fn start_agent(&mut self) {
        self.spawn_agent();
        self.wait_status("the agent redirects the Service", |s| {
            s["services"].as_array().is_some_and(|v| !v.is_empty())
        });
    }

    /// Starts the agent for a Service it does not redirect (`observe`: plain L4, the control
    /// of the tests that show a mode's effect) and waits for its admin API.
    pub fn start_agent_unredirected(&mut self) {
        self.spawn_agent();
        self.wait_status("the agent serves its admin API", |s| s.is_object());
    }

    fn wait_status(&self, what: &str, done: impl Fn(&serde_json::Value) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done(&self.status()) {
            assert!(
                Instant::now() < deadline,
                "{what} within 20 s: {}",
                self.status()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn spawn_agent(&mut self) {
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
    }

    pub fn status(&self) -> serde_json::Value {
        testbed_agent::status_json(&self.tb)
    }

    pub fn status_text(&self) -> String {
        testbed_agent::status_text(&self.tb)
    }

    /// The agent's /metrics, as text.
    fn metrics_text(&self) -> String {
        testbed_agent::node_get(&self.tb, &format!("http://{ADMIN}/metrics"))
    }

    /// An unlabelled counter from the agent's /metrics.
    pub fn metric(&self, name: &str) -> f64 {
        let text = self.metrics_text();
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in /metrics: {text}"))
    }

    /// The sum of a labelled counter's series in the agent's /metrics whose labels contain
    /// `label` (e.g. `reason="malformed"`); 0 when there is none.
    pub fn labelled_metric(&self, name: &str, label: &str) -> f64 {
        self.metrics_text()
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
            .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .sum()
    }

    /// Fails the test when the agent's heartbeat went stale during the run: connects were then
    /// sent direct (fail open, by design), so the run did not test the balancer alone. Seen
    /// only on a machine starved of CPU.
    pub fn assert_never_failed_open(&self) {
        let stale = self.metric("skewless_stale_heartbeat_total");
        assert!(
            stale < 1.0,
            "{stale} connect()s went direct because the agent's heartbeat was stale (the \
             machine is starved of CPU): this run did not test the balancer alone"
        );
    }

    /// What the tapped first backend received and sent ([`Backends::tap_first`]).
    /// Complete: read once every connection to it has ended both ways (call it when the
    /// clients are done), or after a minute.
    pub fn backend_log(&self) -> Vec<LogLine> {
        read_tap_log(&self.backend_log, "backend tap").unwrap_or_default()
    }

    pub fn target(&self) -> String {
        self.vip.to_string()
    }
}

impl Drop for ClientBed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.services);
        let _ = std::fs::remove_file(&self.backend_log);
    }
}

/// A frame-logging tap in `pod` on 127.0.0.1:`port` in front of the VIP: the client in that
/// pod dials it, the tap's own connect goes through the VIP and the redirect.
pub struct PodTap {
    pub log: PathBuf,
    pub addr: SocketAddrV4,
}

impl PodTap {
    pub fn start(bed: &mut ClientBed, pod: &str, withhold: Withhold) -> Self {
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

    /// The log, complete: read once every connection the tap opened has ended both ways
    /// (call it when the tapped client is done), or after a minute.
    pub fn log(&self) -> Vec<LogLine> {
        read_tap_log(&self.log, "tap").unwrap()
    }
}

/// A tap's log at `path`, complete: read once every connection the tap opened has ended both
/// ways, or after a minute; prints how long that took (a tap falls behind on a loaded
/// machine), naming the log `what`.
fn read_tap_log(path: &std::path::Path, what: &str) -> std::io::Result<Vec<LogLine>> {
    let asked = Instant::now();
    let log = framelog::read_log_when_closed(path, Duration::from_secs(60))?;
    eprintln!(
        "the {what}'s log ({} lines) was read {:?} after it was asked for",
        log.len(),
        asked.elapsed()
    );
    Ok(log)
}

impl Drop for PodTap {
    /// The log is removed after a passing test and kept after a failing one: it is the
    /// failure's evidence (which frames each side sent, and when).
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("the tap's frame log is kept: {}", self.log.display());
        } else {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// The load of the rotation tests: `in_flight` unary calls (each 250 ms on the server, so
/// every GOAWAY meets `in_flight` open streams while the rate stays bounded on a 2-core
/// machine: 200 in flight are ~800 calls/s), a server stream
/// and a bidi stream held open for `streams`, and 4 MiB calls one after another, for
/// `duration`.
pub fn rotation_load(
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

pub fn summary(r: &ClientResult) -> String {
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

/// The rotation load of `r` ran (unary and 4 MiB calls answered) and no call failed through
/// the rotations: what every client of the rotation tests must show, in both modes.
pub fn assert_rotation_load_failed_no_call(r: &ClientResult) {
    assert_eq!(
        r.failed_calls(),
        0,
        "no call may fail through the rotations: {}",
        summary(r)
    );
    assert!(r.unary.ok > 50, "the load ran: {}", summary(r));
    assert!(r.large.ok >= 1, "4 MiB calls went through: {}", summary(r));
}

/// Why `f`, a failed 4 MiB call of `r`'s client, is a known client-side loss at a GOAWAY that
/// request mode's rotation does not prevent (docs/limits.md), if it is one:
/// - grpcio: grpc-core's pick race. A call picked between the transport reading a GOAWAY (any)
///   and its subchannel hearing of it is cancelled before it is on the wire and, above the
///   256 KiB retry buffer, not retried. No server behaviour prevents it; grpc-core's own
///   server's max age loses calls the same way (docs/connection-mode.md, "What the final
///   GOAWAY cannot help").
/// - grpc-js: nghttp2 refuses a request its application starts while it reads the input that
///   holds the first GOAWAY, and grpc-js retries it only within its 1 MiB retry buffer.
///   Connection mode's quiesce prevents it; request mode has none (seen under full CPU load).
fn known_client_race(r: &ClientResult, f: &Failure) -> Option<&'static str> {
    match r.client.as_str() {
        "grpcio"
            if f.code == "UNAVAILABLE" && f.message.contains("GOAWAY received; Error code: 0") =>
        {
            Some("grpc-core's pick race")
        }
        "grpc-js" if f.code == "UNAVAILABLE" && f.message.contains("Stream refused by server") => {
            Some("nghttp2's refusal at the first GOAWAY (request mode has no quiesce)")
        }
        _ => None,
    }
}

/// As [`assert_rotation_load_failed_no_call`], except that a client may lose one 4 MiB call
/// to a known client-side race (see [`known_client_race`]); every unary call, every stream
/// and every other large call must succeed. Said on stderr when it happens.
pub fn assert_rotation_load_failed_no_call_but_a_known_race(r: &ClientResult) {
    let race = match (r.large.failed_total(), r.large.failures.first()) {
        (1, Some(f)) => known_client_race(r, f),
        _ => None,
    };
    if let Some(race) = race {
        eprintln!(
            "{} {}: one 4 MiB call lost to {race} (allowed): {:?}",
            r.client, r.version, r.large.failures[0]
        );
    }
    assert_eq!(
        r.failed_calls() - u64::from(race.is_some()),
        0,
        "no call may fail through the rotations (one large call lost to a known client race \
         aside): {}",
        summary(r)
    );
    assert!(r.unary.ok > 50, "the load ran: {}", summary(r));
    assert!(r.large.ok >= 1, "4 MiB calls went through: {}", summary(r));
}

/// For a client that follows GOAWAY (a real one through the tap): on every rotated
/// connection, no HEADERS the client sent has a stream id above the final GOAWAY's
/// last-stream-id, and no stream was refused (RST_STREAM(REFUSED_STREAM) to the client).
/// Returns how many connections had a final GOAWAY.
pub fn assert_no_stream_sent_above_the_final_goaway(log: &[LogLine]) -> usize {
    let mut finals = 0;
    for conn in framelog::http2_conns(log) {
        let down = framelog::frames(log, conn, Dir::ToClient);
        let last = down
            .iter()
            .filter_map(|f| f.goaway.as_ref().map(|g| g.0))
            .min()
            .filter(|&l| l < skewless_frame::MAX_STREAM_ID);
        let up = framelog::frames(log, conn, Dir::ToServer);
        if let Some(last) = last {
            finals += 1;
            let above: Vec<u32> = up
                .iter()
                .filter(|f| f.kind == "HEADERS" && f.stream > last)
                .map(|f| f.stream)
                .collect();
            assert!(
                above.is_empty(),
                "connection {conn}: the final GOAWAY ({last}) is below streams the client \
                 sent: {above:?}"
            );
        }
        let rst: Vec<u32> = down
            .iter()
            .filter(|f| f.rst == Some(7))
            .map(|f| f.stream)
            .collect();
        assert!(
            rst.is_empty(),
            "connection {conn}: streams refused (REFUSED_STREAM): {rst:?}"
        );
    }
    finals
}

/// Asserts the wire sequence of every rotated connection in a tap's log, as the client saw
/// it: GOAWAY(2^31-1, NO_ERROR), then a PING, then (after the client's ACK or a timeout) a
/// GOAWAY with the last stream the client opened, never a higher one, and the server's FIN.
/// Returns how many connections were rotated.
pub fn assert_two_phase_goaways(log: &[LogLine]) -> usize {
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

pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Fails unless the agent serves the Service in connection mode (until it does, a
/// `connection` Service stays plain L4 and these tests would test the DNAT).
pub fn assert_connection_mode(bed: &ClientBed) {
    let status = bed.status();
    assert!(
        status["services"]
            .as_array()
            .is_some_and(|s| s.iter().any(|s| s["mode"] == "connection")),
        "the agent must serve the Service in connection mode: {status}"
    );
}

/// Every pod's first reply over all `results`, in seconds since the Unix epoch.
pub fn first_seen(results: &[ClientResult]) -> std::collections::BTreeMap<String, f64> {
    let mut out = std::collections::BTreeMap::<String, f64>::new();
    for r in results {
        for (pod, t) in &r.unary.first_seen_s {
            let at = r.start_unix_s + t;
            let e = out.entry(pod.clone()).or_insert(at);
            *e = e.min(at);
        }
    }
    out
}

/// OK calls per pod over all `results` in the whole seconds of each client's run between
/// `from` and `to` (Unix seconds; `f64::INFINITY`: to the end of the run).
pub fn pods_between(
    results: &[ClientResult],
    from: f64,
    to: f64,
) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    for r in results {
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "seconds of a bounded run (an infinite end saturates)"
        )]
        let (first, last) = (
            (from - r.start_unix_s).ceil().max(0.0) as usize,
            (to - r.start_unix_s).floor().max(0.0) as usize,
        );
        for (pod, n) in r.unary.pods_in(first, last) {
            *out.entry(pod).or_default() += n;
        }
    }
    out
}

/// One grpcio client behind a tap that withholds `withhold` from it, next to an ordinary
/// grpcio client, for `run_for` in `mode` with a max age of `age`. Returns (the withheld
/// client's result, the ordinary one's, the tap's log).
pub fn run_withheld(
    octet: u8,
    mode: &str,
    age: &str,
    withhold: Withhold,
    run_for: Duration,
) -> (ClientResult, ClientResult, Vec<LogLine>, ClientBed) {
    let mut bed = ClientBed::new(octet, 2, &["withheld", "ordinary"], Backends::default());
    bed.configure(mode, &[("max-connection-age", age)], 2);
    bed.start_agent();
    if mode == "connection" {
        assert_connection_mode(&bed);
    }
    let tap = PodTap::start(&mut bed, "withheld", withhold);
    let spec = |target: String| ClientSpec {
        concurrency: 20,
        call_delay: Some(Duration::from_millis(50)),
        duration: Some(run_for),
        ..ClientSpec::unary(target, 10_000_000)
    };
    let withheld = bed
        .harness
        .spawn(
            &mut bed.tb,
            Place::Pod("withheld"),
            ClientKind::Grpcio,
            &spec(tap.addr.to_string()),
        )
        .unwrap();
    let target = bed.target();
    let ordinary = bed
        .harness
        .run(
            &mut bed.tb,
            Place::Pod("ordinary"),
            ClientKind::Grpcio,
            &spec(target),
        )
        .unwrap();
    let withheld = withheld.wait(&mut bed.tb).unwrap();
    eprintln!("withheld {withhold:?}: {}", summary(&withheld));
    eprintln!("ordinary: {}", summary(&ordinary));
    let log = tap.log();
    (withheld, ordinary, log, bed)
}

/// When the server ended `conn` towards the client (its FIN), in ms of the tap's clock.
pub fn server_fin_ms(log: &[LogLine], conn: u64) -> Option<f64> {
    log.iter().find_map(|l| match l {
        LogLine::End {
            conn: c,
            dir: Dir::ToClient,
            reset: false,
            t_ms,
        } if *c == conn => Some(*t_ms),
        _ => None,
    })
}

/// Every kind of broken client against the Service in `mode`, next to an ordinary client:
/// each broken connection is closed (not left open), the ordinary client loses nothing.
pub fn bad_input_closes_only_that_connection(octet: u8, mode: &str) {
    let mut bed = ClientBed::new(octet, 2, &["broken", "ordinary"], Backends::default());
    bed.configure(mode, &[], 2);
    bed.start_agent();
    if mode == "connection" {
        assert_connection_mode(&bed);
    }
    let spec = ClientSpec {
        concurrency: 10,
        call_delay: Some(Duration::from_millis(20)),
        duration: Some(Duration::from_secs(10)),
        stream: Some(Duration::from_secs(8)),
        ..ClientSpec::unary(bed.target(), 10_000_000)
    };
    let ordinary = bed
        .harness
        .spawn(
            &mut bed.tb,
            Place::Pod("ordinary"),
            ClientKind::Grpcio,
            &spec,
        )
        .unwrap();
    let (host, port) = (bed.vip.ip().to_string(), bed.vip.port().to_string());
    for kind in ["http1", "bad-frame", "oversized", "garbage"] {
        let out = bed
            .tb
            .run(
                Place::Pod("broken"),
                &[
                    "python3",
                    skewless_testbed::scripts::RAW_PEER,
                    &host,
                    &port,
                    kind,
                ],
            )
            .unwrap();
        let line = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        eprintln!("{mode}: broken client {kind}: {line}");
        let how = line.split_whitespace().next().unwrap_or("");
        assert!(
            how == "fin" || how == "reset",
            "{mode}: the {kind} connection must be closed, not left open: {line}"
        );
    }
    if mode == "connection" {
        let counted = bed.labelled_metric(
            "skewless_client_protocol_errors_total",
            "reason=\"malformed\"",
        );
        eprintln!("{mode}: broken connections counted as malformed: {counted}");
        assert!(
            counted >= 4.0,
            "{mode}: each broken connection is counted (skewless_client_protocol_errors_total \
             reason=malformed): {counted}"
        );
    }
    let ordinary = ordinary.wait(&mut bed.tb).unwrap();
    eprintln!("{mode}: ordinary: {}", summary(&ordinary));
    assert_eq!(
        ordinary.failed_calls(),
        0,
        "{mode}: broken clients cost the others nothing: {}",
        summary(&ordinary)
    );
    assert!(ordinary.unary.ok > 50, "{}", summary(&ordinary));
}
