//! The harness's contract, on loopback against the in-process tonic echo server: every
//! client (grpcio, grpc-js, tonic) runs the same load and reports it in one typed result.
//! Needs the venv and the npm packages (`cargo xtask setup`); no privileges.

use std::time::Duration;

use skewless_clients::{ClientKind, ClientSpec, Harness};
use skewless_echo::SpawnedEcho;

fn harness() -> Harness {
    Harness::new().expect("the harness needs `cargo xtask setup` (venv, npm packages)")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_client_reports_pods_streams_and_large_messages_in_one_result() {
    let echo = SpawnedEcho::start("127.0.0.1:0".parse().unwrap(), "pod-l")
        .await
        .unwrap();
    let h = tokio::task::spawn_blocking(harness).await.unwrap();
    for kind in ClientKind::ALL {
        let spec = ClientSpec {
            concurrency: 8,
            large_calls: 2,
            stream: Some(Duration::from_millis(600)),
            bidi: Some(Duration::from_millis(600)),
            ..ClientSpec::unary(echo.addr.to_string(), 100)
        };
        let h = h.clone();
        let r = tokio::task::spawn_blocking(move || h.run_local(kind, &spec))
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{kind}: {e:?}"));
        assert_eq!(r.client, kind.name());
        assert!(!r.version.is_empty(), "{kind} reports its version");
        assert_eq!(r.unary.ok, 100, "{kind}: every unary call succeeds: {r:?}");
        assert_eq!(r.unary.pods.get("pod-l"), Some(&100), "{kind}: {r:?}");
        assert_eq!(
            r.unary
                .per_second
                .iter()
                .flat_map(|s| s.values())
                .sum::<u64>(),
            100,
            "{kind}: the per-second tallies add up"
        );
        assert!(r.unary.first_seen_s.contains_key("pod-l"), "{kind}: {r:?}");
        assert_eq!(
            r.large.ok, 2,
            "{kind}: both 4 MiB calls come back whole: {r:?}"
        );
        let ss = r.server_stream.as_ref().expect("server stream ran");
        assert!(
            ss.complete(),
            "{kind}: the server stream ends OK with every reply: {ss:?}"
        );
        assert_eq!(ss.expected, 12, "{kind}: 600 ms at a reply per 50 ms");
        let bidi = r.bidi.as_ref().expect("bidi ran");
        assert!(
            bidi.complete(),
            "{kind}: every bidi message is answered: {bidi:?}"
        );
        assert_eq!(r.failed_calls(), 0, "{kind}: {r:?}");
        eprintln!("{kind} {}: {r:?}", r.version);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_client_reports_each_failure_with_its_status() {
    // A port nothing listens on: every call fails, and says why.
    let unused = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = unused.local_addr().unwrap().to_string();
    drop(unused);
    let h = tokio::task::spawn_blocking(harness).await.unwrap();
    for kind in ClientKind::ALL {
        let spec = ClientSpec {
            timeout: Duration::from_secs(2),
            ..ClientSpec::unary(target.clone(), 10)
        };
        let h = h.clone();
        let r = tokio::task::spawn_blocking(move || h.run_local(kind, &spec))
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{kind}: {e:?}"));
        assert_eq!(r.unary.ok, 0, "{kind}: {r:?}");
        assert_eq!(
            r.unary.failed.get("UNAVAILABLE"),
            Some(&10),
            "{kind}: every call fails UNAVAILABLE and is counted: {r:?}"
        );
        assert_eq!(r.unary.failures.len(), 10, "{kind}: each failure is listed");
    }
}

/// A tap process on loopback, killed (by PID) and its log removed when dropped.
struct LocalTap {
    child: std::process::Child,
    log: std::path::PathBuf,
    addr: std::net::SocketAddr,
}

impl LocalTap {
    fn start(h: &Harness, upstream: std::net::SocketAddr, withhold: Withhold) -> Self {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = free.local_addr().unwrap();
        drop(free);
        let log = std::env::temp_dir().join(format!(
            "skewless-tap-{}-{}.jsonl",
            std::process::id(),
            addr.port()
        ));
        let argv = h.tap_argv(addr, upstream, withhold, &log);
        let child = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(std::time::Instant::now() < deadline, "the tap listens");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, log, addr }
    }

    /// The log, complete (every connection ended both ways; call it when the client is done).
    fn log(&self) -> Vec<LogLine> {
        framelog::read_log_when_closed(&self.log, Duration::from_secs(30)).unwrap()
    }
}

impl Drop for LocalTap {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

use skewless_clients::framelog::{self, Dir, LogLine, Withhold};

/// An echo server whose connections get a graceful GOAWAY at `age`.
async fn aging_echo(age: Duration) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, _rx) = tokio::sync::oneshot::channel();
    let options = skewless_echo::ServeOptions {
        max_connection_age: Some(age),
        ..skewless_echo::ServeOptions::default()
    };
    tokio::spawn(async move {
        skewless_echo::serve_with(listener, "pod-a", options, tx, std::future::pending()).await
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tap_records_a_servers_two_phase_goaway_as_the_client_sees_it() {
    let upstream = aging_echo(Duration::from_millis(400)).await;
    let h = tokio::task::spawn_blocking(harness).await.unwrap();
    let tap = LocalTap::start(&h, upstream, Withhold::default());
    let spec = ClientSpec {
        duration: Some(Duration::from_millis(1500)),
        ..ClientSpec::unary(tap.addr.to_string(), 100_000)
    };
    let h2 = h.clone();
    let r = tokio::task::spawn_blocking(move || h2.run_local(ClientKind::Grpcio, &spec))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        r.failed_calls(),
        0,
        "grpcio follows a server's max age: {r:?}"
    );
    let log = tap.log();
    let conns = framelog::http2_conns(&log);
    let down = framelog::frames(&log, conns[0], Dir::ToClient);
    let kinds: Vec<&str> = down.iter().map(|f| f.kind.as_str()).collect();
    let first = down
        .iter()
        .position(|f| f.kind == "GOAWAY")
        .unwrap_or_else(|| panic!("the first connection got a GOAWAY: {kinds:?}"));
    assert_eq!(
        down[first].goaway.as_ref().map(|g| (g.0, g.1)),
        Some((skewless_frame::MAX_STREAM_ID, 0)),
        "first GOAWAY(2^31-1, NO_ERROR)"
    );
    let ping = down[first..]
        .iter()
        .find(|f| f.kind == "PING")
        .and_then(|f| f.ping.clone())
        .expect("a PING follows the first GOAWAY");
    assert!(!ping.0, "the server's PING is not an ACK");
    let up = framelog::frames(&log, conns[0], Dir::ToServer);
    assert!(
        up.iter()
            .any(|f| f.ping.as_ref() == Some(&(true, ping.1.clone()))),
        "the client ACKs the server's PING with its opaque data"
    );
    let last = down[first + 1..]
        .iter()
        .find_map(|f| f.goaway.clone())
        .expect("a final GOAWAY follows");
    assert!(
        last.0 < skewless_frame::MAX_STREAM_ID && last.0 % 2 == 1,
        "the final GOAWAY names the last client stream: {last:?}"
    );
    assert!(conns.len() >= 2, "the client reconnected after the GOAWAY");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tap_withholds_goaway_and_ping_from_the_client_when_told() {
    let upstream = aging_echo(Duration::from_millis(300)).await;
    let h = tokio::task::spawn_blocking(harness).await.unwrap();
    let tap = LocalTap::start(
        &h,
        upstream,
        Withhold {
            goaway: true,
            ping: true,
        },
    );
    let spec = ClientSpec {
        duration: Some(Duration::from_millis(1200)),
        timeout: Duration::from_secs(2),
        ..ClientSpec::unary(tap.addr.to_string(), 100_000)
    };
    let h2 = h.clone();
    tokio::task::spawn_blocking(move || h2.run_local(ClientKind::Tonic, &spec))
        .await
        .unwrap()
        .unwrap();
    let log = tap.log();
    let conn = framelog::http2_conns(&log)[0];
    let down = framelog::frames(&log, conn, Dir::ToClient);
    assert!(
        down.iter().any(|f| f.kind == "GOAWAY" && f.dropped),
        "the GOAWAY is logged as withheld"
    );
    assert!(
        down.iter()
            .filter(|f| f.kind == "GOAWAY" || (f.kind == "PING" && f.flags & 1 == 0))
            .all(|f| f.dropped),
        "no GOAWAY and no server PING reaches the client"
    );
    let up = framelog::frames(&log, conn, Dir::ToServer);
    assert!(
        !up.iter().any(|f| f.kind == "PING" && f.flags & 1 == 1),
        "a client that never saw the PING never ACKs it"
    );
}
