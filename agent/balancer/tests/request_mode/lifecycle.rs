//! Client connections: drain, max connection age, workers, rotated and broken connections.

use super::*;

on_both_paths!(
    shutdown_drains_in_flight_calls_then_stops,
    max_connection_age_rotates_client_connections_and_fails_no_call_it_received,
    max_connection_age_set_live_rotates_open_client_connections,
    what_a_client_sends_after_its_connection_is_rotated_is_read_not_reset,
    window_updates_for_streams_the_final_goaway_refused_cost_no_call,
    a_stream_written_after_the_goaways_ping_ack_is_taken_by_the_final_goaway,
    broken_client_connections_are_closed_without_disturbing_other_clients,
    malformed_requests_are_reset_and_their_connection_serves_on,
    a_client_that_allows_no_hpack_table_is_answered_without_one,
);

async fn shutdown_drains_in_flight_calls_then_stops<P: DataPath>() {
    let pods = pods(1).await;
    pods[0].control.set_delay(Duration::from_millis(300));
    let b = balancer_on::<P>(Config::default(), endpoints(&pods)).await;
    let mut c = client(b.addr).await;
    let call = tokio::spawn(async move { c.echo(req(b"d")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let addr = b.addr;
    b.stop().await;
    let r = call.await.expect("task");
    assert!(
        r.is_ok(),
        "a call in flight when draining starts completes: {r:?}"
    );
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "no new connections after the drain"
    );
}

async fn max_connection_age_rotates_client_connections_and_fails_no_call_it_received<
    P: DataPath,
>() {
    let pods = pods(2).await;
    let config = Config {
        max_connection_age: Some(Duration::from_millis(200)),
        ..Config::default()
    };
    let b = balancer_on::<P>(config, endpoints(&pods)).await;
    // Count the client connections the balancer accepts: a counting TCP relay in front of it.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let relay_addr = listener.local_addr().expect("addr");
    let counted = relay(listener, b.addr);
    let accepted = counted.accepted.clone();
    let c = client(relay_addr).await;
    let stop_at = tokio::time::Instant::now() + Duration::from_millis(1000);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut failed = Vec::new();
            while tokio::time::Instant::now() < stop_at {
                if let Err(status) = c.echo(req(b"a")).await {
                    failed.push(status);
                }
            }
            failed
        }));
    }
    let mut failed = Vec::new();
    for t in tasks {
        failed.extend(t.await.expect("task"));
    }
    // tonic's Channel does not transparently retry calls the server provably did not process
    // (grpc-go and grpc-java do): a call that its connection never sent ("connection closed",
    // "connection was not ready")
    // or that was above the GOAWAY's last stream id (a remote NO_ERROR GOAWAY) fails in this
    // client. Every other failure is the balancer's.
    let unprocessed = |s: &tonic::Status| {
        let d = format!("{s:?}");
        (s.code() == Code::Cancelled
            && (d.contains("connection closed") || d.contains("connection was not ready")))
            || d.contains("GoAway(b\"\", NO_ERROR, Remote)")
    };
    let ours: Vec<_> = failed.iter().filter(|s| !unprocessed(s)).collect();
    assert!(
        ours.is_empty(),
        "rotation fails no call that reached the balancer: {:?}",
        ours.first()
    );
    assert!(
        failed.len() <= 8 * 5,
        "only calls racing a GOAWAY fail in tonic: {}",
        failed.len()
    );
    let n = accepted.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        n >= 3,
        "a 200 ms max age over 1 s makes the client reconnect: {n} connections"
    );
    b.stop().await;
}

async fn max_connection_age_set_live_rotates_open_client_connections<P: DataPath>() {
    let pods = pods(1).await;
    let b = balancer_on::<P>(Config::default(), endpoints(&pods)).await;
    // Count the client connections the balancer accepts: a counting TCP relay in front of it.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let relay_addr = listener.local_addr().expect("addr");
    let counted = relay(listener, b.addr);
    let accepted = counted.accepted.clone();
    let mut c = client(relay_addr).await;
    let calls_for = |c: &mut EchoClient<Channel>, d: Duration| {
        let mut c = c.clone();
        async move {
            let stop_at = tokio::time::Instant::now() + d;
            while tokio::time::Instant::now() < stop_at {
                // One caller, a call every 10 ms: a call racing our GOAWAY can fail in tonic
                // (see max_connection_age_rotates_...), which this test does not count.
                let _ = c.echo(req(b"a")).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    calls_for(&mut c, Duration::from_millis(500)).await;
    let before = accepted.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(before, 1, "no max age: one client connection");
    b.balancer.reconfigure(Config {
        max_connection_age: Some(Duration::from_millis(200)),
        ..Config::default()
    });
    calls_for(&mut c, Duration::from_millis(1000)).await;
    let after = accepted.load(std::sync::atomic::Ordering::Relaxed);
    // At least one rotation (>= 3 on an idle machine; a busy one makes the calls, and so the
    // reconnects, sparse).
    assert!(
        after >= 2,
        "a 200 ms max age set on the live balancer rotates the open connection: {after} connections"
    );
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_serve_one_port_with_a_balancer_each_and_stop_on_request() {
    let pods = pods(2).await;
    let workers = skewless_balancer::Workers::start(2, "e2e-worker").expect("workers");
    let (_tx, rx) = watch::channel(endpoints(&pods));
    let (stop_tx, stop_rx) = watch::channel(false);
    let (failed_tx, mut failed) = mpsc::unbounded_channel();
    let served = workers
        .serve(
            "127.0.0.1:0".parse().unwrap(),
            || Balancer::new(Config::default(), rx.clone()),
            &stop_rx,
            |_| true,
            move |error| {
                let _ = failed_tx.send(error.to_string());
            },
        )
        .expect("serve");
    assert_eq!(served.balancers.len(), 2, "one balancer per worker");
    // Separate connections land on either worker (the kernel hashes them): every one of them
    // is served, and the workers' statistics add up to every call.
    for _ in 0..8 {
        let mut c = client(served.addr).await;
        for _ in 0..5 {
            c.echo(req(b"w")).await.expect("served by a worker");
        }
    }
    let stats =
        skewless_balancer::EndpointStats::merge_workers(served.balancers.iter().map(|b| b.stats()));
    assert_eq!(
        stats.iter().map(|e| e.requests).sum::<u64>(),
        40,
        "{stats:?}"
    );
    stop_tx.send(true).unwrap();
    for task in served.tasks {
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("a worker's balancer drains and ends on stop")
            .expect("task");
    }
    assert!(failed.try_recv().is_err(), "no accept loop failed");
    for p in pods {
        p.stop().await.expect("stop");
    }
}

async fn what_a_client_sends_after_its_connection_is_rotated_is_read_not_reset<P: DataPath>() {
    // A client whose last frames cross the balancer's final GOAWAY (grpcio opens streams until
    // it has read it) must not meet a reset: on its next write it would fail its streams
    // ("Stream removed") before reading the GOAWAY that says they may be retried.
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let config = Config {
        max_connection_age: Some(Duration::from_millis(200)),
        ..Config::default()
    };
    let b = balancer_on::<P>(config, Vec::new()).await;
    let mut tcp = tokio::net::TcpStream::connect(b.addr)
        .await
        .expect("connect");
    tcp.write_all(PREFACE).await.expect("preface");
    tcp.write_all(&empty_settings()).await.expect("settings");
    // Answer the balancer's SETTINGS and PING as a client does, until its FIN.
    let (mut got, mut pos, mut go_aways) = (Vec::new(), 0, Vec::new());
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let n = tcp.read(&mut buf).await.expect("read before the FIN");
            if n == 0 {
                return;
            }
            got.extend_from_slice(&buf[..n]);
            let mut frames = Frames::new(&got[pos..], MAX_MAX_FRAME_SIZE);
            let mut answer = Vec::new();
            for (head, payload) in frames.by_ref().map_while(Result::ok) {
                match head.kind {
                    Kind::Settings if !head.is_ack() => Settings::encode(true, &[], &mut answer),
                    Kind::Ping if !head.is_ack() => {
                        let ping = Ping::decode(&head, payload).expect("ping");
                        Ping { ack: true, ..ping }.encode(&mut answer);
                    }
                    Kind::GoAway => {
                        go_aways.push(
                            GoAway::decode(&head, payload)
                                .expect("goaway")
                                .last_stream_id,
                        );
                    }
                    _ => {}
                }
            }
            pos = got.len() - frames.rest().len();
            tcp.write_all(&answer).await.expect("answer");
        }
    })
    .await;
    assert!(closed.is_ok(), "the 200 ms max age closes the connection");
    assert_eq!(
        go_aways,
        [MAX_STREAM_ID, 0],
        "a two-phase GOAWAY, then the FIN"
    );
    // Frames the client wrote before it read the final GOAWAY arrive after the FIN.
    let mut late = Vec::new();
    Ping {
        ack: false,
        opaque: *b"latebyte",
    }
    .encode(&mut late);
    tcp.write_all(&late).await.expect("the first late write");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = tcp.write_all(&late).await;
    let read = tcp.read(&mut buf).await;
    assert!(
        second.is_ok() && matches!(read, Ok(0)),
        "the balancer reads what arrives after its FIN instead of resetting the connection: \
         second late write {second:?}, read {read:?}"
    );
    b.stop().await;
}

/// What a raw client saw of a connection wound down by its max age (see [`wound_down`]).
#[derive(Debug, Default)]
struct WoundDown {
    /// Every GOAWAY: last stream id and error code.
    go_aways: Vec<(u32, ErrorCode)>,
    /// Streams answered to their end (a HEADERS frame with END_STREAM).
    finished: Vec<u32>,
    /// Streams reset, with the code.
    reset: Vec<(u32, ErrorCode)>,
}

/// The request a raw client sends in [`wound_down`]: HEADERS and an empty EchoRequest, ended.
fn echo_request(stream: u32) -> Vec<u8> {
    let block = header_block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/skewless.echo.v1.Echo/Echo"),
        (":authority", "x"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]);
    let mut out = Vec::new();
    put_headers(&mut out, stream, skewless_frame::flags::END_HEADERS, &block);
    out.extend(support::frame(
        Kind::Data,
        skewless_frame::flags::END_STREAM,
        stream,
        &[0; 5],
    ));
    out
}

/// A raw client on data path `P` with a 200 ms max age, over one pod that answers in 600 ms:
/// it calls on stream 1, and answers the first PING (the wind-down's) with what `at_ping`
/// makes of the ACK, one write per element; every later SETTINGS and PING it acknowledges at
/// once. On the final GOAWAY it writes what `at_final` makes of its last stream id. Returns
/// what it saw until the balancer closed the connection (within 5 s).
async fn wound_down<P: DataPath>(
    at_ping: impl FnOnce(Vec<u8>) -> Vec<Vec<u8>>,
    at_final: impl FnOnce(u32) -> Vec<u8>,
) -> WoundDown {
    use tokio::io::AsyncWriteExt as _;
    let pods = pods(1).await;
    // The call in flight is answered well after the max age starts the wind-down.
    pods[0].control.set_delay(Duration::from_millis(600));
    let config = Config {
        max_connection_age: Some(Duration::from_millis(200)),
        ..Config::default()
    };
    let b = balancer_on::<P>(config, endpoints(&pods)).await;
    let mut tcp = tokio::net::TcpStream::connect(b.addr)
        .await
        .expect("connect");
    let mut out = support::hello();
    out.extend(echo_request(1));
    tcp.write_all(&out).await.expect("the first call");
    let (mut at_ping, mut at_final) = (Some(at_ping), Some(at_final));
    let mut seen = WoundDown::default();
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            // Until the balancer closes the connection.
            let Some((head, payload)) = support::frame_or_end(&mut tcp).await else {
                return;
            };
            let mut writes = Vec::new();
            match head.kind {
                Kind::Settings if !head.is_ack() => writes.push(support::settings_ack()),
                Kind::Ping if !head.is_ack() => {
                    let ack =
                        support::ping(true, Ping::decode(&head, &payload).expect("PING").opaque);
                    match at_ping.take() {
                        Some(f) => writes = f(ack),
                        None => writes.push(ack),
                    }
                }
                Kind::GoAway => {
                    let g = GoAway::decode(&head, &payload).expect("GOAWAY");
                    seen.go_aways.push((g.last_stream_id, g.error_code));
                    if g.last_stream_id != MAX_STREAM_ID
                        && let Some(f) = at_final.take()
                    {
                        writes.push(f(g.last_stream_id));
                    }
                }
                Kind::RstStream => {
                    let code = skewless_frame::RstStream::decode(&head, &payload)
                        .expect("RST_STREAM")
                        .error_code;
                    seen.reset.push((head.stream_id, code));
                }
                Kind::Headers if head.is_end_stream() => seen.finished.push(head.stream_id),
                _ => {}
            }
            for write in writes {
                if tcp.write_all(&write).await.is_err() {
                    return;
                }
                // Each its own write, as a client that writes its PING ACK apart does.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the balancer closes the connection: {seen:?}"
    );
    b.stop().await;
    seen
}

/// A client whose streams cross the balancer's final GOAWAY: it opens a stream above the
/// final GOAWAY's last stream and sends a WINDOW_UPDATE for it (grpc-core does, for a large
/// message, when its frames cross the GOAWAY; here they follow it, to the same effect). RFC
/// 9113 sections 6.8 and 5.1 say both are ignored; the stream in flight before them must
/// finish.
async fn window_updates_for_streams_the_final_goaway_refused_cost_no_call<P: DataPath>() {
    let seen = wound_down::<P>(
        |ack| vec![ack],
        |last| {
            let mut write = echo_request(last + 2);
            write.extend(support::frame(
                Kind::WindowUpdate,
                0,
                last + 2,
                &65_535u32.to_be_bytes(),
            ));
            write
        },
    )
    .await;
    assert!(
        seen.finished.contains(&1) && seen.reset.iter().all(|(s, _)| *s != 1),
        "the call in flight finishes: {seen:?}"
    );
    assert_eq!(
        seen.go_aways,
        [
            (MAX_STREAM_ID, ErrorCode::NO_ERROR),
            (1, ErrorCode::NO_ERROR)
        ],
        "a two-phase GOAWAY that takes stream 1, and no connection error"
    );
}

/// A client that writes a stream it created before it read GOAWAY(2^31-1) only after its PING
/// ACK, in a write of its own (grpc-core writes no stream frame in a write that carries a PING
/// ACK): the final GOAWAY waits until the client has written everything it queued, and takes
/// that stream (see `crate::settle`).
async fn a_stream_written_after_the_goaways_ping_ack_is_taken_by_the_final_goaway<P: DataPath>() {
    let seen = wound_down::<P>(|ack| vec![ack, echo_request(3)], |_| Vec::new()).await;
    assert_eq!(
        seen.go_aways,
        [
            (MAX_STREAM_ID, ErrorCode::NO_ERROR),
            (3, ErrorCode::NO_ERROR)
        ],
        "the final GOAWAY takes stream 3: {seen:?}"
    );
    let mut finished = seen.finished.clone();
    finished.sort_unstable();
    assert_eq!(finished, [1, 3], "both calls are answered: {seen:?}");
    assert!(seen.reset.is_empty(), "{seen:?}");
}

/// Connects to `addr`, writes `chunks`, and reads until the balancer closes the connection
/// (asserted within 5 s); returns what the balancer sent.
async fn exchange(addr: SocketAddr, chunks: &[&[u8]]) -> Vec<u8> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    for chunk in chunks {
        tcp.write_all(chunk).await.expect("write");
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the balancer closes a broken connection");
    got
}

async fn broken_client_connections_are_closed_without_disturbing_other_clients<P: DataPath>() {
    let pods = pods(2).await;
    let b = balancer_on::<P>(Config::default(), endpoints(&pods)).await;
    let c = client(b.addr).await;
    // A healthy client keeps calling throughout (bounded: 4 callers, at most 10 s).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut callers = Vec::new();
    for _ in 0..4 {
        let (mut c, stop) = (c.clone(), stop.clone());
        callers.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, Vec::new());
            let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && tokio::time::Instant::now() < give_up
            {
                match c.echo(req(b"ok")).await {
                    Ok(_) => ok += 1,
                    Err(status) => failed.push(status),
                }
            }
            (ok, failed)
        }));
    }

    // Not HTTP/2 at all: an HTTP/1.1 request instead of the preface.
    exchange(b.addr, &[b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"]).await;
    // The preface, then a frame that breaks the protocol (DATA on stream 0): the balancer
    // answers GOAWAY(PROTOCOL_ERROR) and closes.
    let mut data_on_stream_0 = Head::new(Kind::Data, 0, 0, 3).encode().to_vec();
    data_on_stream_0.extend_from_slice(b"bad");
    let settings = empty_settings();
    let answer = exchange(b.addr, &[PREFACE, &settings, &data_on_stream_0]).await;
    assert!(
        has_go_away(&answer, h2::Reason::PROTOCOL_ERROR),
        "GOAWAY(PROTOCOL_ERROR) before the close: {answer:?}"
    );
    // DATA on a stream the client never opened (idle): the same.
    let mut data_on_idle = Head::new(Kind::Data, 0, 3, 3).encode().to_vec();
    data_on_idle.extend_from_slice(b"bad");
    let answer = exchange(b.addr, &[PREFACE, &settings, &data_on_idle]).await;
    assert!(
        has_go_away(&answer, h2::Reason::PROTOCOL_ERROR),
        "GOAWAY(PROTOCOL_ERROR) for DATA on an idle stream: {answer:?}"
    );
    // RST_STREAM and WINDOW_UPDATE on an idle stream: the same (RFC 9113 section 5.1).
    let mut rst_on_idle = Head::new(Kind::RstStream, 0, 5, 4).encode().to_vec();
    rst_on_idle.extend_from_slice(&8u32.to_be_bytes());
    let mut window_on_idle = Head::new(Kind::WindowUpdate, 0, 7, 4).encode().to_vec();
    window_on_idle.extend_from_slice(&100u32.to_be_bytes());
    // A request on stream 5, then a header block on stream 3, which the client never opened
    // and can no longer open.
    let end = skewless_frame::flags::END_HEADERS | skewless_frame::flags::END_STREAM;
    let request = header_block(&[(":method", "POST"), (":path", "/x")]);
    let mut going_back = support::frame(Kind::Headers, end, 5, &request);
    going_back.extend_from_slice(&support::frame(Kind::Headers, end, 3, &request));
    // Two SETTINGS ACKs: the balancer sent one SETTINGS, so the second acknowledges none.
    let mut acks = Head::new(Kind::Settings, skewless_frame::flags::ACK, 0, 0)
        .encode()
        .to_vec();
    acks.extend_from_slice(&Head::new(Kind::Settings, skewless_frame::flags::ACK, 0, 0).encode());
    for (what, frame) in [
        ("RST_STREAM on an idle stream", rst_on_idle),
        ("WINDOW_UPDATE on an idle stream", window_on_idle),
        ("a SETTINGS ACK of nothing", acks),
        ("a stream id going back", going_back),
        (
            "a GOAWAY on a stream",
            support::frame(Kind::GoAway, 0, 3, &[0; 8]),
        ),
        (
            "a PRIORITY on stream 0",
            support::frame(Kind::Priority, 0, 0, &[0, 0, 0, 1, 16]),
        ),
        (
            "a HEADERS on an even stream",
            support::frame(
                Kind::Headers,
                skewless_frame::flags::END_HEADERS | skewless_frame::flags::END_STREAM,
                2,
                &header_block(&[(":method", "POST"), (":path", "/x")]),
            ),
        ),
    ] {
        let answer = exchange(b.addr, &[PREFACE, &settings, &frame]).await;
        assert!(
            has_go_away(&answer, h2::Reason::PROTOCOL_ERROR),
            "GOAWAY(PROTOCOL_ERROR) for {what}: {answer:?}"
        );
    }
    // A WINDOW_UPDATE that takes the connection's window beyond 2^31-1 (RFC 9113 section
    // 6.9.1).
    let overflow = support::frame(Kind::WindowUpdate, 0, 0, &0x7fff_ffffu32.to_be_bytes());
    let answer = exchange(b.addr, &[PREFACE, &settings, &overflow]).await;
    assert!(
        has_go_away(&answer, h2::Reason::FLOW_CONTROL_ERROR),
        "GOAWAY(FLOW_CONTROL_ERROR) for a window beyond 2^31-1: {answer:?}"
    );
    // Random bytes after a valid preface and SETTINGS.
    exchange(b.addr, &[PREFACE, &settings, &[0xff; 64]]).await;

    // The healthy calls go on for a while past the broken connections.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut ok = 0;
    for caller in callers {
        let (n, failed) = caller.await.expect("caller");
        assert!(failed.is_empty(), "no healthy call failed: {failed:?}");
        ok += n;
    }
    assert!(ok > 0, "the healthy client's calls went through");
    // And the balancer still takes new clients.
    let mut fresh = client(b.addr).await;
    fresh
        .echo(req(b"after"))
        .await
        .expect("a new client is served");
    b.stop().await;
}

/// A header block in HPACK literals (no table state), for requests a real client would not
/// send.
fn header_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut encoder = httlib_hpack::Encoder::default();
    let mut block = Vec::new();
    for (name, value) in fields {
        encoder
            .encode(
                (name.as_bytes().to_vec(), value.as_bytes().to_vec(), 0),
                &mut block,
            )
            .expect("a literal encodes");
    }
    block
}

/// Appends a HEADERS frame on `stream` with `flags` carrying `block` to `out`.
fn put_headers(out: &mut Vec<u8>, stream: u32, flags: u8, block: &[u8]) {
    let len = u32::try_from(block.len()).expect("a small block");
    out.extend_from_slice(&Head::new(Kind::Headers, flags, stream, len).encode());
    out.extend_from_slice(block);
}

/// Malformed requests (RFC 9113 section 8.1.1) are stream errors: each is reset with
/// PROTOCOL_ERROR, nothing reaches a pod, and the connection serves the next request.
async fn malformed_requests_are_reset_and_their_connection_serves_on<P: DataPath>() {
    use tokio::io::AsyncWriteExt as _;
    let pods = pods(1).await;
    let b = balancer_on::<P>(Config::default(), endpoints(&pods)).await;
    let request = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/skewless.echo.v1.Echo/Nope"),
        (":authority", "x"),
    ];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut f = request.to_vec();
        f.extend_from_slice(extra);
        f
    };
    let mut malformed: Vec<(&str, Vec<(&str, &str)>)> = vec![
        (
            "no :path",
            request
                .iter()
                .copied()
                .filter(|(n, _)| *n != ":path")
                .collect(),
        ),
        (
            "no :scheme",
            request
                .iter()
                .copied()
                .filter(|(n, _)| *n != ":scheme")
                .collect(),
        ),
        ("repeated pseudo-header", with(&[(":method", "GET")])),
        (
            "pseudo-header after a regular field",
            vec![
                (":method", "POST"),
                ("content-type", "application/grpc"),
                (":path", "/x"),
            ],
        ),
        (
            "connection-specific field",
            with(&[("connection", "keep-alive")]),
        ),
        ("te other than trailers", with(&[("te", "gzip")])),
    ];
    if P::CODEC {
        // h2 closes the connection for an unknown pseudo-header (stricter than RFC 9113
        // section 8.3, which makes it a malformed request) and takes uppercase names.
        malformed.push(("unknown pseudo-header", with(&[(":colour", "red")])));
        malformed.push(("uppercase field name", with(&[("Content-Type", "x")])));
        // Fields RFC 9113 section 8.2.1 makes malformed, which h2's header types refuse with
        // the whole connection.
        malformed.push(("empty field name", with(&[("", "x")])));
        malformed.push(("space in a field name", with(&[("x y", "1")])));
        malformed.push(("colon in a field name", with(&[("x:y", "1")])));
        malformed.push(("CR in a field value", with(&[("x-v", "a\rb")])));
        malformed.push(("NUL in a field value", with(&[("x-v", "a\0b")])));
        // Fields h2-based servers (the pods here are tonic) refuse with their whole
        // connection: forwarded, they would cost every call on it.
        malformed.push(("a field name that is not a token", with(&[("x(y)", "1")])));
        malformed.push(("a control in a field value", with(&[("x-v", "a\u{1}b")])));
        let mut bad_path = request.to_vec();
        bad_path[2] = (":path", "/a b");
        malformed.push(("a space in :path", bad_path));
        let mut bad_method = request.to_vec();
        bad_method[0] = (":method", "PO ST");
        malformed.push(("a :method that is not a token", bad_method));
    }
    let mut tcp = tokio::net::TcpStream::connect(b.addr)
        .await
        .expect("connect");
    let mut out = support::hello();
    let mut stream = 1u32;
    for (_, fields) in &malformed {
        let block = header_block(fields);
        put_headers(
            &mut out,
            stream,
            skewless_frame::flags::END_HEADERS | skewless_frame::flags::END_STREAM,
            &block,
        );
        stream += 2;
    }
    if P::CODEC {
        // Trailers with a pseudo-header: a malformed request, reset (RFC 9113 section 8.1;
        // h2 takes them).
        let block = header_block(&with(&[("content-type", "application/grpc")]));
        put_headers(&mut out, stream, skewless_frame::flags::END_HEADERS, &block);
        let trailers = header_block(&[(":path", "/again")]);
        put_headers(
            &mut out,
            stream,
            skewless_frame::flags::END_HEADERS | skewless_frame::flags::END_STREAM,
            &trailers,
        );
        malformed.push(("a pseudo-header in the trailers", Vec::new()));
        stream += 2;
    }
    // Trailers without END_STREAM: a malformed request (RFC 9113 section 8.1).
    let block = header_block(&with(&[("content-type", "application/grpc")]));
    put_headers(&mut out, stream, skewless_frame::flags::END_HEADERS, &block);
    let trailers = header_block(&[("grpc-status", "0")]);
    put_headers(
        &mut out,
        stream,
        skewless_frame::flags::END_HEADERS,
        &trailers,
    );
    malformed.push(("trailers without END_STREAM", Vec::new()));
    stream += 2;
    let good = stream;
    let block = header_block(&with(&[
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]));
    put_headers(
        &mut out,
        good,
        skewless_frame::flags::END_HEADERS | skewless_frame::flags::END_STREAM,
        &block,
    );
    tcp.write_all(&out).await.expect("write");
    let mut reset = std::collections::BTreeMap::new();
    let answered = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let (head, payload) = support::next_frame(&mut tcp).await;
            match head.kind {
                Kind::RstStream => {
                    let rst =
                        skewless_frame::RstStream::decode(&head, &payload).expect("RST_STREAM");
                    reset.insert(rst.stream_id, rst.error_code);
                }
                Kind::Headers if head.stream_id == good => return,
                Kind::GoAway => panic!(
                    "a malformed request is no connection error: {:?} after resets {reset:?}",
                    skewless_frame::GoAway::decode(&head, &payload)
                        .map(|g| (g.last_stream_id, g.error_code))
                ),
                _ => {}
            }
        }
    })
    .await;
    assert!(
        answered.is_ok(),
        "the well-formed request is answered: resets {reset:?}"
    );
    for (i, (why, _)) in malformed.iter().enumerate() {
        let id = 1 + 2 * i as u32;
        assert_eq!(
            reset.get(&id),
            Some(&ErrorCode::PROTOCOL_ERROR),
            "{why}: reset with PROTOCOL_ERROR ({reset:?})"
        );
    }
    drop(tcp);
    b.stop().await;
}

/// A client whose SETTINGS_HEADER_TABLE_SIZE is 0 (its decoder keeps no dynamic table): the
/// balancer's header blocks start with a size update to 0 and never use the table (RFC 7541
/// section 4.2), so a decoder with no table decodes every one of them.
async fn a_client_that_allows_no_hpack_table_is_answered_without_one<P: DataPath>() {
    use tokio::io::AsyncWriteExt as _;
    let pods = pods(1).await;
    let b = balancer_on::<P>(Config::default(), endpoints(&pods)).await;
    let mut tcp = tokio::net::TcpStream::connect(b.addr)
        .await
        .expect("connect");
    let mut out = PREFACE.to_vec();
    // SETTINGS_HEADER_TABLE_SIZE (0x1) = 0.
    out.extend_from_slice(&support::frame(Kind::Settings, 0, 0, &[0, 1, 0, 0, 0, 0]));
    tcp.write_all(&out).await.expect("hello");
    let request = header_block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/skewless.echo.v1.Echo/Nope"),
        (":authority", "x"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]);
    let mut decoder = httlib_hpack::Decoder::with_dynamic_size(0);
    let mut blocks = 0;
    let mut settings_acked = false;
    // Three calls one after another: the second and third would find the first's fields in a
    // table, were there one.
    for stream in [1u32, 3, 5] {
        let end = skewless_frame::flags::END_HEADERS | skewless_frame::flags::END_STREAM;
        tcp.write_all(&support::frame(Kind::Headers, end, stream, &request))
            .await
            .expect("request");
        loop {
            let (head, payload) = support::next_frame(&mut tcp).await;
            match head.kind {
                Kind::Settings if !head.is_ack() && !settings_acked => {
                    settings_acked = true;
                    tcp.write_all(&support::frame(
                        Kind::Settings,
                        skewless_frame::flags::ACK,
                        0,
                        &[],
                    ))
                    .await
                    .expect("ack");
                }
                Kind::GoAway => panic!("the connection is refused: {payload:?}"),
                Kind::Headers => {
                    assert!(head.is_end_headers(), "one frame per block here");
                    let mut block = payload.clone();
                    let mut fields = Vec::new();
                    decoder
                        .decode(&mut block, &mut fields)
                        .expect("the block decodes without a dynamic table");
                    blocks += 1;
                    if head.is_end_stream() && head.stream_id == stream {
                        break;
                    }
                }
                Kind::RstStream if head.stream_id == stream => break,
                _ => {}
            }
        }
    }
    assert!(blocks >= 3, "three answers decoded: {blocks}");
    drop(tcp);
    b.stop().await;
}
