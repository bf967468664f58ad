//! Connection mode end to end on loopback: a `ConnectionBalancer` served like the agent serves
//! it, real echo pods (tonic servers with grpc.health.v1), and gRPC clients over h2 that handle
//! a GOAWAY the way grpc-go does (no new stream on that connection, reconnect, one transparent
//! retry of a refused call). Placement, connect-failure retry, rotation on skew after a
//! scale-up, and the rotation of a removed or NOT_SERVING backend's connections, each with zero
//! failed calls.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf as _, Bytes};
use rand::SeedableRng as _;
use rand::rngs::SmallRng;
use skewless_balancer::connection::{ConnectionBalancer, ConnectionConfig, RotationConfig};
use skewless_balancer::{Endpoint, EndpointState};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;

mod support;
use support::{endpoints, pods};

/// A connection-mode balancer serving a loopback port.
type Bed = support::Serving<ConnectionBalancer>;

impl Bed {
    async fn stop(mut self) {
        self.stop_within(Duration::from_secs(30)).await;
    }
}

/// Quick rotation settings for tests: a 200 ms tick, a 1 s hold, no budget to speak of.
fn quick() -> ConnectionConfig {
    ConnectionConfig {
        rotation: RotationConfig {
            hold_time: Duration::from_secs(1),
            max_rotations_per_minute: 600,
            min_connection_age: Duration::from_secs(1),
            ..RotationConfig::default()
        },
        tick: Duration::from_millis(200),
        ..ConnectionConfig::default()
    }
}

async fn bed(config: ConnectionConfig, endpoints: Vec<Endpoint>) -> Bed {
    bed_with(endpoints, |rx| ConnectionBalancer::new(config, rx)).await
}

/// A bed whose balancer draws from a seeded RNG: placements are repeatable when nothing else
/// draws between them (see `connections_are_spread_over_backends_by_load`).
async fn seeded_bed(config: ConnectionConfig, endpoints: Vec<Endpoint>, seed: u64) -> Bed {
    bed_with(endpoints, |rx| {
        ConnectionBalancer::with_rng(config, rx, SmallRng::seed_from_u64(seed))
    })
    .await
}

async fn bed_with(
    endpoints: Vec<Endpoint>,
    balancer: impl FnOnce(watch::Receiver<Vec<Endpoint>>) -> ConnectionBalancer,
) -> Bed {
    support::serve(endpoints, balancer).await
}

/// What one client saw.
#[derive(Debug, Default, Clone)]
struct Report {
    /// Successful calls per pod.
    pods: BTreeMap<String, u64>,
    /// Calls that failed (after the one transparent retry).
    failed: u64,
    /// Calls retried once because their connection refused them (above the GOAWAY's last
    /// stream id, or REFUSED_STREAM).
    retried: u64,
    /// Connections opened.
    connections: u64,
    /// The pod of the last successful call.
    last_pod: Option<String>,
}

/// One unary Echo call; `Ok(None)` when the connection refused it (safe to retry elsewhere).
async fn echo(send: &h2::client::SendRequest<Bytes>) -> Result<Option<String>, String> {
    let mut send = match send.clone().ready().await {
        Ok(send) => send,
        // The connection takes no new stream (GOAWAY): nothing was sent.
        Err(_) => return Ok(None),
    };
    let req = http::Request::post("http://echo/skewless.echo.v1.Echo/Echo")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("user-agent", "grpc-go/1.60.0")
        .body(())
        .expect("request");
    let (resp, mut body) = match send.send_request(req, false) {
        Ok(ok) => ok,
        Err(_) => return Ok(None),
    };
    // EchoRequest { payload: "x" }, in a gRPC frame.
    body.send_data(Bytes::from_static(&[0, 0, 0, 0, 3, 0x0a, 1, b'x']), true)
        .map_err(|e| format!("request body: {e}"))?;
    let resp = match resp.await {
        Ok(resp) => resp,
        Err(e) if refused(&e) => return Ok(None),
        Err(e) => return Err(format!("response: {e}")),
    };
    let mut body = resp.into_body();
    let mut data = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|e| format!("response body: {e}"))?;
        let _ = body.flow_control().release_capacity(chunk.len());
        data.extend_from_slice(&chunk);
    }
    let trailers = body
        .trailers()
        .await
        .map_err(|e| format!("trailers: {e}"))?
        .unwrap_or_default();
    let status = trailers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("?");
    if status != "0" {
        return Err(format!("grpc-status {status}"));
    }
    pod_of(&data)
        .map(Some)
        .ok_or_else(|| "undecodable reply".to_owned())
}

/// The stream was refused without being processed: REFUSED_STREAM, or above a GOAWAY's
/// last-stream-id (grpc-go retries both transparently).
fn refused(e: &h2::Error) -> bool {
    e.reason() == Some(h2::Reason::REFUSED_STREAM) || (e.is_go_away() && e.is_remote())
}

/// The `pod` field (2) of an `EchoReply` in a gRPC frame.
fn pod_of(frame: &[u8]) -> Option<String> {
    let mut msg = frame.get(5..)?;
    while msg.has_remaining() {
        let key = msg.get_u8();
        let len = usize::from(*msg.first()?);
        msg.advance(1);
        let value = msg.get(..len)?;
        if key == 0x12 {
            return String::from_utf8(value.to_vec()).ok();
        }
        msg.advance(len);
    }
    None
}

/// A client calling Echo back to back until `stop`, over one connection at a time.
fn client(addr: SocketAddr, stop: watch::Receiver<bool>) -> JoinHandle<Report> {
    client_after(addr, watch::channel(true).1, stop)
}

/// [`client`] that connects at once but makes its first call only once `go` is true.
fn client_after(
    addr: SocketAddr,
    mut go: watch::Receiver<bool>,
    stop: watch::Receiver<bool>,
) -> JoinHandle<Report> {
    tokio::spawn(async move {
        let mut report = Report::default();
        // Whether the call in hand was refused once already.
        let mut retry = false;
        'connections: while !*stop.borrow() {
            let Ok(tcp) = TcpStream::connect(addr).await else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            report.connections += 1;
            let Ok((send, conn)) = h2::client::handshake(tcp).await else {
                continue;
            };
            tokio::spawn(async move {
                let _ = conn.await;
            });
            let _ = go.wait_for(|go| *go).await;
            while !*stop.borrow() {
                match echo(&send).await {
                    Ok(Some(pod)) => {
                        *report.pods.entry(pod.clone()).or_default() += 1;
                        report.last_pod = Some(pod);
                        retry = false;
                    }
                    Ok(None) if !retry => {
                        // Retried once, on the next connection.
                        report.retried += 1;
                        retry = true;
                        continue 'connections;
                    }
                    Ok(None) | Err(_) => {
                        report.failed += 1;
                        retry = false;
                        continue 'connections;
                    }
                }
            }
        }
        report
    })
}

async fn until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    tokio::time::timeout(limit, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} within {limit:?}"));
}

async fn finish(stop: &watch::Sender<bool>, clients: Vec<JoinHandle<Report>>) -> Vec<Report> {
    stop.send_replace(true);
    let mut reports = Vec::new();
    for c in clients {
        reports.push(
            tokio::time::timeout(Duration::from_secs(20), c)
                .await
                .expect("client ends")
                .expect("client task"),
        );
    }
    reports
}

fn failed(reports: &[Report]) -> u64 {
    reports.iter().map(|r| r.failed).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_spread_over_backends_by_load() {
    // Power of two choices over three backends, one placement after another at equal load,
    // ends 1/4/4 in 1 of 81 runs (the first three fill the empty backends; then each picks the
    // lighter of two at random, and four ties in a row leave one backend at 1): the bounds
    // below hold for this seed, not for every draw (seeds 0 and 608 end 4/4/1 and 1/4/4). With
    // this seed, placement that ignores load (always the first of the two) ends 4/4/1. The seed
    // fixes the draws only if nothing else draws between the placements, so the clients
    // connect one at a time (each accept draws a max-age jitter, then its placement two
    // choices) and call only once all are placed (a skew on the first connections' calls would
    // draw a hold jitter in between).
    let pods = pods(3).await;
    let b = seeded_bed(quick(), endpoints(&pods), 1).await;
    let (stop, stop_rx) = watch::channel(false);
    let (go, go_rx) = watch::channel(false);
    let mut clients = Vec::new();
    for n in 1..=9 {
        clients.push(client_after(b.addr, go_rx.clone(), stop_rx.clone()));
        until("the client placed", Duration::from_secs(20), || {
            b.balancer.stats().connections == n
        })
        .await;
    }
    go.send_replace(true);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stats = b.balancer.stats();
    let reports = finish(&stop, clients).await;
    assert_eq!(failed(&reports), 0, "{reports:?}");
    for s in &stats.backends {
        assert!(
            (2..=4).contains(&s.connections),
            "nine connections over three pods by power of two choices: {stats:?}"
        );
    }
    assert_eq!(stats.backends_receiving, 3, "{stats:?}");
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_connect_is_retried_on_another_backend_before_the_client_sees_anything() {
    let pods = pods(2).await;
    // A listed backend where nothing listens.
    let dead: SocketAddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let mut listed = vec![Endpoint::new(dead, "dead")];
    listed.extend(endpoints(&pods));
    let b = bed(quick(), listed).await;
    let (stop, stop_rx) = watch::channel(false);
    let clients: Vec<_> = (0..12).map(|_| client(b.addr, stop_rx.clone())).collect();
    until("every client relayed", Duration::from_secs(20), || {
        b.balancer.stats().connections == 12
    })
    .await;
    let stats = b.balancer.stats();
    let reports = finish(&stop, clients).await;
    assert_eq!(failed(&reports), 0, "{reports:?}");
    assert!(
        reports.iter().all(|r| r.connections == 1),
        "no client had to reconnect: {reports:?}"
    );
    let dead_stats = &stats.backends[0];
    assert!(dead_stats.connect_failures >= 1, "{stats:?}");
    assert_eq!(dead_stats.connections, 0);
    assert_eq!(dead_stats.state, EndpointState::Ejected, "{stats:?}");
    assert_eq!(stats.no_backend, 0);
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_up_rotates_pinned_connections_onto_the_new_pods_without_failing_calls() {
    let pods = pods(3).await;
    // Seed 001: the clients connected while the Service had one pod.
    let b = bed(quick(), endpoints(&pods[..1])).await;
    let (stop, stop_rx) = watch::channel(false);
    let clients: Vec<_> = (0..6).map(|_| client(b.addr, stop_rx.clone())).collect();
    until("every client relayed", Duration::from_secs(20), || {
        b.balancer.stats().connections == 6
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        b.balancer.stats().rotations.skew,
        0,
        "one pod: nothing to rotate"
    );
    b.endpoints.send_replace(endpoints(&pods));
    until(
        "every pod holds connections",
        Duration::from_secs(30),
        || {
            let s = b.balancer.stats();
            s.backends.len() == 3 && s.backends.iter().all(|s| s.connections >= 1)
        },
    )
    .await;
    // Let the windows see the new placement.
    until(
        "the live skew is under the threshold",
        Duration::from_secs(30),
        || {
            let s = b.balancer.stats();
            s.live_skew > 0.0 && s.live_skew <= 1.5
        },
    )
    .await;
    let stats = b.balancer.stats();
    let reports = finish(&stop, clients).await;
    assert_eq!(
        failed(&reports),
        0,
        "zero failed calls through rotations: {reports:?}"
    );
    assert!(
        (2..=4).contains(&stats.rotations.skew),
        "only as many rotations as needed (6-0-0 to at most 2-2-2: 3-2-1 is at the threshold, \
         not under the plan's band): {stats:?}"
    );
    for pod in ["pod-1", "pod-2"] {
        assert!(
            reports
                .iter()
                .any(|r| r.pods.get(pod).copied().unwrap_or(0) > 0),
            "{pod} receives traffic: {reports:?}"
        );
    }
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_backends_connections_move_to_the_others_without_failing_calls() {
    let pods = pods(2).await;
    let b = bed(quick(), endpoints(&pods)).await;
    let (stop, stop_rx) = watch::channel(false);
    let clients: Vec<_> = (0..6).map(|_| client(b.addr, stop_rx.clone())).collect();
    until("every client relayed", Duration::from_secs(20), || {
        b.balancer.stats().connections == 6
    })
    .await;
    let on_pod1 = b.balancer.stats().backends[1].connections as u64;
    assert!(on_pod1 > 0, "placement used both pods");
    b.endpoints.send_replace(endpoints(&pods[..1]));
    // Counted on pod-0 itself: the total also holds rotated connections still draining.
    until("every connection on pod-0", Duration::from_secs(30), || {
        let s = b.balancer.stats();
        s.backends.len() == 1 && s.backends[0].connections == 6
    })
    .await;
    // And calls made there since (a client that just reconnected has not called yet).
    let moved = b.balancer.stats().backends[0].requests;
    until(
        "calls on pod-0 after the move",
        Duration::from_secs(30),
        || b.balancer.stats().backends[0].requests >= moved + 24,
    )
    .await;
    let stats = b.balancer.stats();
    let reports = finish(&stop, clients).await;
    assert_eq!(failed(&reports), 0, "{reports:?}");
    assert_eq!(stats.rotations.backend_removed, on_pod1, "{stats:?}");
    assert!(
        reports
            .iter()
            .all(|r| r.last_pod.as_deref() == Some("pod-0")),
        "{reports:?}"
    );
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_not_serving_backend_gets_no_new_connections_and_its_connections_rotate() {
    let pods = pods(2).await;
    let config = ConnectionConfig {
        health_service: Some(skewless_echo::SERVICE_NAME.to_owned()),
        ..quick()
    };
    let b = bed(config, endpoints(&pods)).await;
    until("both backends serving", Duration::from_secs(20), || {
        b.balancer.stats().ready_backends == 2
    })
    .await;
    let (stop, stop_rx) = watch::channel(false);
    let clients: Vec<_> = (0..6).map(|_| client(b.addr, stop_rx.clone())).collect();
    until("every client relayed", Duration::from_secs(20), || {
        b.balancer.stats().connections == 6
    })
    .await;
    let on_pod1 = b.balancer.stats().backends[1].connections as u64;
    pods[1].control.set_serving(false).await;
    until("pod-1 empty", Duration::from_secs(30), || {
        let s = b.balancer.stats();
        s.connections == 6 && s.backends[1].connections == 0
    })
    .await;
    let stats = b.balancer.stats();
    assert_eq!(stats.backends[1].state, EndpointState::NotServing);
    assert_eq!(stats.rotations.not_serving, on_pod1, "{stats:?}");
    let reports = finish(&stop, clients).await;
    assert_eq!(failed(&reports), 0, "{reports:?}");
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_rotates_every_connection_and_serve_returns() {
    let pods = pods(1).await;
    let b = bed(quick(), endpoints(&pods)).await;
    let (stop, stop_rx) = watch::channel(false);
    let clients: Vec<_> = (0..4).map(|_| client(b.addr, stop_rx.clone())).collect();
    until("every client relayed", Duration::from_secs(20), || {
        b.balancer.stats().connections == 4
    })
    .await;
    let balancer = b.balancer.clone();
    b.stop().await;
    let stats = balancer.stats();
    assert_eq!(stats.rotations.drain, 4, "{stats:?}");
    assert_eq!(stats.connections, 0, "{stats:?}");
    // The clients keep trying to connect to a closed listener; none of their calls failed.
    let reports = finish(&stop, clients).await;
    assert_eq!(failed(&reports), 0, "{reports:?}");
}

/// The relay records every call it carries into the Service's cells (what `/metrics` shows):
/// after the clients stop, the Service's latency histogram holds exactly the calls they made,
/// and none failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_relayed_call_is_timed_once_in_the_services_histogram() {
    let pods = pods(2).await;
    let b = bed(quick(), endpoints(&pods)).await;
    let (stop, stop_rx) = watch::channel(false);
    let clients: Vec<_> = (0..3).map(|_| client(b.addr, stop_rx.clone())).collect();
    until("every client relayed", Duration::from_secs(20), || {
        b.balancer.stats().connections == 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let reports = finish(&stop, clients).await;
    let calls: u64 = reports.iter().flat_map(|r| r.pods.values()).sum();
    assert!(calls > 0, "{reports:?}");
    assert_eq!(failed(&reports), 0, "{reports:?}");
    // A client sees its response's END_STREAM only after the relay has counted the call.
    let m = b.balancer.metrics();
    assert_eq!(
        m.latency.count(),
        calls,
        "every call timed once: {reports:?}"
    );
    assert_eq!(m.failures, [0; 6], "no failed call");
    b.stop().await;
}

/// Connects to the balancer, writes `bytes`, and reads until it closes the connection; how
/// long that took.
async fn hostile(addr: SocketAddr, bytes: Vec<u8>) -> Duration {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let t0 = tokio::time::Instant::now();
    let tcp = TcpStream::connect(addr).await.expect("connects");
    let (mut rd, mut wr) = tcp.into_split();
    // The balancer stops reading mid-flood: the rest of the write may fail.
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&bytes).await;
        wr
    });
    let mut buf = vec![0u8; 64 * 1024];
    tokio::time::timeout(Duration::from_secs(30), async {
        while matches!(rd.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await
    .expect("the balancer closes the hostile connection");
    drop(writer.await.expect("writer"));
    t0.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_are_closed_and_counted_by_reason_and_other_clients_keep_their_calls() {
    use skewless_balancer::metrics::ClientErrorReason;
    use skewless_frame::{Head, Kind, PREFACE, Ping, Settings};
    let pods = pods(1).await;
    let b = bed(quick(), endpoints(&pods)).await;
    let (stop, stop_rx) = watch::channel(false);
    let clients = vec![client(b.addr, stop_rx)];
    until("the good client relayed", Duration::from_secs(20), || {
        b.balancer.stats().connections == 1
    })
    .await;

    let mut start = PREFACE.to_vec();
    Settings::encode(false, &[], &mut start);
    let mut pings = start.clone();
    for _ in 0..5_000 {
        Ping {
            ack: false,
            opaque: [7; 8],
        }
        .encode(&mut pings);
    }
    let mut oversized = start.clone();
    oversized.extend(Head::new(Kind::Data, 0, 1, 1 << 20).encode());
    let (silent, http1, flood, big) = tokio::join!(
        hostile(b.addr, Vec::new()),
        hostile(b.addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
        hostile(b.addr, pings),
        hostile(b.addr, oversized),
    );
    assert!(
        silent >= Duration::from_millis(9_900),
        "a silent client is closed at the 10 s handshake timeout, not before: {silent:?}"
    );
    eprintln!(
        "closed after: silent {silent:?}, HTTP/1.1 {http1:?}, PING flood {flood:?}, oversized frame {big:?}"
    );

    let reports = finish(&stop, clients).await;
    assert_eq!(
        failed(&reports),
        0,
        "the good client is unaffected: {reports:?}"
    );
    assert!(
        reports[0].connections == 1,
        "and keeps its connection: {reports:?}"
    );
    let s = b.balancer.metrics();
    let count = |reason: ClientErrorReason| {
        s.client_errors[ClientErrorReason::ALL
            .iter()
            .position(|r| *r == reason)
            .expect("a reason")]
    };
    assert_eq!(
        count(ClientErrorReason::NoPreface),
        1,
        "{:?}",
        s.client_errors
    );
    assert_eq!(
        count(ClientErrorReason::Malformed),
        2,
        "{:?}",
        s.client_errors
    );
    assert_eq!(
        count(ClientErrorReason::PingFlood),
        1,
        "{:?}",
        s.client_errors
    );
    assert_eq!(
        s.client_errors.iter().sum::<u64>(),
        4,
        "{:?}",
        s.client_errors
    );
    b.stop().await;
}
