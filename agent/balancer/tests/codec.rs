//! Request mode on the frame codec (`CodecBalancer`, experimental): what its data path does
//! today, with real tonic clients and real echo servers over loopback (and raw frames where a
//! test must break the protocol). Bounded to a few seconds and a few hundred calls each.

#[path = "support/mod.rs"]
mod support;

use std::net::SocketAddr;
use std::time::Duration;

use skewless_balancer::{CodecBalancer, Config, Endpoint};
use skewless_echo::pb::EchoRequest;
use skewless_echo::pb::echo_client::EchoClient;
use skewless_frame::{ErrorCode, GoAway, Kind, MAX_STREAM_ID, Ping, RstStream, flags};
use support::{Serving, endpoints, frame, hello, next_frame, pods, serve};
use tokio::io::AsyncWriteExt as _;
use tonic::transport::Channel;

/// A codec balancer serving on loopback over `pods`.
async fn codec_balancer(pods: &[skewless_echo::SpawnedEcho]) -> Serving<CodecBalancer> {
    serve(endpoints(pods), |rx| {
        CodecBalancer::new(Config::default(), rx)
    })
    .await
}

async fn client(addr: SocketAddr) -> EchoClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        // A hung call fails its test instead of hanging the suite.
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("client connects to the balancer");
    EchoClient::new(channel)
}

fn req(payload: &[u8]) -> EchoRequest {
    EchoRequest {
        payload: payload.to_vec(),
        ..EchoRequest::default()
    }
}

/// Waits (5 s at most) until the balancer serves a call: it connects to the pods in the
/// background, and a call that finds no connection up yet fails at once.
async fn until_ready(c: &mut EchoClient<Channel>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while tokio::time::Instant::now() < deadline {
        let call = tokio::time::timeout(Duration::from_secs(1), c.echo(req(b"ready?")));
        if let Ok(Ok(_)) = call.await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the codec balancer served no call within 5 s");
}

/// An upstream that takes request streams but never reads their bodies nor answers: its
/// stream windows stay at the 65,535 bytes of RFC 9113.
async fn stalled_upstream() -> std::net::SocketAddr {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(|_req: http::Request<hyper::body::Incoming>| {
                        std::future::pending::<
                            Result<
                                http::Response<http_body_util::Empty<bytes::Bytes>>,
                                std::convert::Infallible,
                            >,
                        >()
                    });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .initial_stream_window_size(65_535)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// A codec balancer over the one upstream at `up`, and a raw client connection to it that has
/// sent its preface and SETTINGS (the balancer lives as long as what is returned).
async fn raw_client_over(
    up: SocketAddr,
    name: &str,
) -> (Serving<CodecBalancer>, tokio::net::TcpStream) {
    let b = serve(vec![Endpoint::new(up, name)], |rx| {
        CodecBalancer::new(Config::default(), rx)
    })
    .await;
    let mut io = tokio::net::TcpStream::connect(b.addr)
        .await
        .expect("connect");
    io.write_all(&hello()).await.expect("hello");
    (b, io)
}

/// Opens streams on `io` (after its hello) until one goes upstream, and returns its id.
async fn a_stream_upstream(io: &mut tokio::net::TcpStream) -> u32 {
    // POST /, a static-table header block, without END_STREAM: a request whose body follows.
    // Until the upstream connection is up it is answered at once (trailers-only UNAVAILABLE)
    // and the next stream tries again; once one goes upstream, nothing comes back.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut stream = 1u32;
    loop {
        io.write_all(&frame(
            Kind::Headers,
            flags::END_HEADERS,
            stream,
            &[0x83, 0x86, 0x84],
        ))
        .await
        .expect("headers");
        loop {
            match tokio::time::timeout(Duration::from_millis(300), next_frame(io)).await {
                Err(_) => return stream,
                Ok((head, _)) if head.kind == Kind::Headers && head.stream_id == stream => break,
                Ok(_) => {}
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the upstream is not up within 5 s"
        );
        stream += 2;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_overruns_its_stream_window_gets_a_flow_control_error() {
    let up = stalled_upstream().await;
    let (_b, mut io) = raw_client_over(up, "stalled").await;
    let stream = a_stream_upstream(&mut io).await;
    // The upstream takes 65,535 bytes and no more; the balancer holds what the client sends
    // beyond, up to the 1 MiB stream window it gave the client, and gives nothing back while
    // it holds it. 65 frames of 16 KiB are 16 KiB over.
    let chunk = vec![0u8; 16 * 1024];
    for _ in 0..65 {
        io.write_all(&frame(Kind::Data, 0, stream, &chunk))
            .await
            .expect("data");
    }
    let reset = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let (head, payload) = next_frame(&mut io).await;
            if head.kind == Kind::RstStream && head.stream_id == stream {
                return RstStream::decode(&head, &payload)
                    .expect("RST_STREAM")
                    .error_code;
            }
            assert!(
                !(head.kind == Kind::WindowUpdate && head.stream_id == stream),
                "no window comes back for bytes the balancer still holds"
            );
        }
    })
    .await
    .expect("the overrun stream is reset within 5 s");
    assert_eq!(reset, ErrorCode::FLOW_CONTROL_ERROR);
}

/// DATA or trailers after the client ended a stream that is still open (half-closed remote),
/// and DATA on a closed stream, are stream errors, STREAM_CLOSED (RFC 9113 section 5.1): the
/// stream is reset, the connection serves on. (h2 makes the first two a connection error.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_after_the_client_ended_a_stream_reset_it_with_stream_closed() {
    let up = stalled_upstream().await;
    let (_b, mut io) = raw_client_over(up, "stalled").await;
    let first = a_stream_upstream(&mut io).await;
    // Its body ends, then more DATA comes.
    let mut out = frame(Kind::Data, flags::END_STREAM, first, b"end");
    out.extend_from_slice(&frame(Kind::Data, 0, first, b"more"));
    // A second request, its trailers, then trailers again.
    let second = first + 2;
    out.extend_from_slice(&frame(
        Kind::Headers,
        flags::END_HEADERS,
        second,
        &[0x83, 0x86, 0x84],
    ));
    // `te: trailers`, twice.
    let trailers = [
        0x40, 2, b't', b'e', 8, b't', b'r', b'a', b'i', b'l', b'e', b'r', b's',
    ];
    for _ in 0..2 {
        out.extend_from_slice(&frame(
            Kind::Headers,
            flags::END_HEADERS | flags::END_STREAM,
            second,
            &trailers,
        ));
    }
    // DATA on a stream the client let close unused (it opened a higher one): reset too.
    let skipped = second + 2;
    out.extend_from_slice(&frame(
        Kind::Headers,
        flags::END_HEADERS | flags::END_STREAM,
        skipped + 2,
        &[0x83, 0x86, 0x84],
    ));
    out.extend_from_slice(&frame(Kind::Data, 0, skipped, b"late"));
    let mut ping = Vec::new();
    Ping {
        ack: false,
        opaque: *b"still up",
    }
    .encode(&mut ping);
    out.extend_from_slice(&ping);
    io.write_all(&out).await.expect("frames");
    let mut resets = std::collections::BTreeMap::new();
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let (head, payload) = next_frame(&mut io).await;
            match head.kind {
                Kind::RstStream => {
                    let rst = RstStream::decode(&head, &payload).expect("RST_STREAM");
                    resets.insert(rst.stream_id, rst.error_code);
                }
                Kind::Ping if head.is_ack() => return,
                Kind::GoAway => panic!("a stream error is no connection error ({resets:?})"),
                _ => {}
            }
        }
    })
    .await
    .expect("the PING is answered within 5 s");
    assert_eq!(
        resets,
        [
            (first, ErrorCode::STREAM_CLOSED),
            (second, ErrorCode::STREAM_CLOSED),
            (skipped, ErrorCode::STREAM_CLOSED),
        ]
        .into(),
        "the three streams reset with STREAM_CLOSED, nothing else"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_lets_a_call_in_flight_finish_then_stops_the_codec_path() {
    let pods = pods(1).await;
    pods[0].control.set_delay(Duration::from_millis(300));
    let mut b = codec_balancer(&pods).await;
    let mut c = client(b.addr).await;
    until_ready(&mut c).await;
    let mut caller = c.clone();
    let call = tokio::spawn(async move { caller.echo(req(b"d")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The client keeps its connection; the drain grace is 10 s: the balancer must close the
    // connection once its call is over, not then.
    b.stop_within(Duration::from_secs(5)).await;
    drop(c);
    let r = call.await.expect("task");
    assert!(
        r.is_ok(),
        "a call in flight when the drain starts completes: {r:?}"
    );
    assert!(
        tokio::net::TcpStream::connect(b.addr).await.is_err(),
        "no new connections after the drain"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_age_winds_a_codec_connection_down_with_two_goaways() {
    let pods = pods(1).await;
    let config = Config {
        max_connection_age: Some(Duration::from_millis(200)),
        ..Config::default()
    };
    let b = serve(endpoints(&pods), |rx| CodecBalancer::new(config, rx)).await;
    let mut io = tokio::net::TcpStream::connect(b.addr)
        .await
        .expect("connect");
    io.write_all(&hello()).await.expect("hello");
    let go_away = |payload: &[u8]| {
        let head = skewless_frame::Head::new(Kind::GoAway, 0, 0, payload.len() as u32);
        let g = GoAway::decode(&head, payload).expect("GOAWAY");
        (g.last_stream_id, g.error_code)
    };
    let within = Duration::from_secs(5);
    // First: GOAWAY with the highest stream id, then a PING (the balancer's SETTINGS before
    // them acknowledged, as clients do).
    let first = tokio::time::timeout(within, async {
        loop {
            let (head, payload) = next_frame(&mut io).await;
            if head.kind == Kind::Settings && !head.is_ack() {
                io.write_all(&support::settings_ack())
                    .await
                    .expect("SETTINGS ACK");
            }
            if head.kind == Kind::GoAway {
                return go_away(&payload);
            }
        }
    })
    .await
    .expect("a GOAWAY at the max age");
    assert_eq!(first, (MAX_STREAM_ID, ErrorCode::NO_ERROR));
    let (head, payload) = next_frame(&mut io).await;
    assert!(
        head.kind == Kind::Ping && !head.is_ack(),
        "a PING follows the first GOAWAY: {head:?}"
    );
    let ack = |head: &skewless_frame::Head, payload: &[u8]| {
        support::ping(true, Ping::decode(head, payload).expect("PING").opaque)
    };
    io.write_all(&ack(&head, &payload)).await.expect("PING ACK");
    // Then the settling check (the client is quiet: it has no stream): an empty SETTINGS, and
    // once it is acknowledged a PING.
    let (head, payload) = tokio::time::timeout(within, next_frame(&mut io))
        .await
        .expect("the settling SETTINGS");
    assert!(
        head.kind == Kind::Settings && !head.is_ack() && payload.is_empty(),
        "an empty SETTINGS: {head:?}"
    );
    io.write_all(&support::settings_ack())
        .await
        .expect("SETTINGS ACK");
    let (head, payload) = tokio::time::timeout(within, next_frame(&mut io))
        .await
        .expect("the settling PING");
    assert!(
        head.kind == Kind::Ping && !head.is_ack(),
        "a PING: {head:?}"
    );
    io.write_all(&ack(&head, &payload)).await.expect("PING ACK");
    // Then GOAWAY with the last stream id taken (none), and the close.
    let (head, payload) = tokio::time::timeout(within, next_frame(&mut io))
        .await
        .expect("the second GOAWAY");
    assert_eq!(head.kind, Kind::GoAway);
    assert_eq!(go_away(&payload), (0, ErrorCode::NO_ERROR));
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(
        within,
        tokio::io::AsyncReadExt::read_to_end(&mut io, &mut rest),
    )
    .await
    .expect("the connection closes with no stream left");
    assert!(closed.is_ok() && rest.is_empty(), "{closed:?} {rest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waits_for_an_endpoint_that_is_still_connecting_on_the_codec_path() {
    // The pod's port is known, the pod starts 200 ms after the call: the call waits for the
    // balancer's connection to it instead of failing at once.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    let config = Config {
        ready_timeout: Duration::from_secs(3),
        ..Config::default()
    };
    let b = serve(vec![Endpoint::new(addr, "late")], |rx| {
        CodecBalancer::new(config, rx)
    })
    .await;
    let mut c = client(b.addr).await;
    let call = tokio::spawn(async move { c.echo(req(b"waited")).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _pod = skewless_echo::SpawnedEcho::start(addr, "late")
        .await
        .expect("the pod starts");
    let reply = call
        .await
        .expect("task")
        .expect("the call waits for the endpoint and succeeds")
        .into_inner();
    assert_eq!(reply.payload, b"waited", "with its request body");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_grpc_timeout_gets_deadline_exceeded_from_the_codec_path() {
    // An upstream that never answers (nor keeps a timer of its own); the client (raw, no
    // deadline of its own) asks for 200 ms: the balancer answers DEADLINE_EXCEEDED itself, at
    // the deadline.
    let up = stalled_upstream().await;
    let b = serve(vec![Endpoint::new(up, "stalled")], |rx| {
        CodecBalancer::new(Config::default(), rx)
    })
    .await;
    let t0 = tokio::time::Instant::now();
    let resp = tokio::time::timeout(
        Duration::from_secs(3),
        support::raw_client(b.addr)
            .await
            .send_request(support::grpc_request(b.addr, Some("200m"))),
    )
    .await
    .expect("an answer before the upstream's (never)")
    .expect("an answer");
    let waited = t0.elapsed();
    assert_eq!(
        resp.headers().get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"4"[..]),
        "DEADLINE_EXCEEDED, trailers only: {:?}",
        resp.headers()
    );
    assert!(
        resp.headers()
            .get("grpc-message")
            .is_some_and(|m| m.as_bytes().starts_with(b"skewless")),
        "from the balancer: {:?}",
        resp.headers()
    );
    assert!(
        waited >= Duration::from_millis(190) && waited < Duration::from_secs(2),
        "at the deadline: {waited:?}"
    );
}

/// How [`scripted_upstream`] answers a request.
#[derive(Clone, Copy)]
enum Answer {
    /// RST_STREAM with REFUSED_STREAM.
    Reset,
    /// GOAWAY with last stream id 0 (a pod shutting down), the connection left open.
    GoAway,
    /// Response headers with a field name that is not a token (an h2-based client refuses
    /// it with its whole connection).
    Malformed,
}

/// An HTTP/2 server that refuses every request stream (it provably processed nothing), as a
/// pod that is shutting down may.
async fn scripted_upstream(how: Answer) -> std::net::SocketAddr {
    use tokio::io::AsyncReadExt as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut io, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut magic = [0u8; 24];
                if io.read_exact(&mut magic).await.is_err()
                    || io.write_all(&support::empty_settings()).await.is_err()
                {
                    return;
                }
                loop {
                    let (head, payload) = next_frame(&mut io).await;
                    let answer = match head.kind {
                        Kind::Settings if !head.is_ack() => support::settings_ack(),
                        // The balancer's connect ends with a PING.
                        Kind::Ping if !head.is_ack() => {
                            support::ping(true, payload.try_into().expect("8 bytes"))
                        }
                        Kind::Headers => match how {
                            Answer::Reset => frame(
                                Kind::RstStream,
                                0,
                                head.stream_id,
                                &ErrorCode::REFUSED_STREAM.0.to_be_bytes(),
                            ),
                            Answer::GoAway => support::go_away(0, ErrorCode::NO_ERROR),
                            Answer::Malformed => {
                                let mut block = Vec::new();
                                let mut encoder = httlib_hpack::Encoder::default();
                                for (n, v) in [
                                    (&b":status"[..], &b"200"[..]),
                                    (b"content-type", b"application/grpc"),
                                    (b"grpc-status", b"0"),
                                    (b"bad name", b"1"),
                                ] {
                                    encoder
                                        .encode((n.to_vec(), v.to_vec(), 0), &mut block)
                                        .expect("a literal encodes");
                                }
                                frame(
                                    Kind::Headers,
                                    flags::END_HEADERS | flags::END_STREAM,
                                    head.stream_id,
                                    &block,
                                )
                            }
                        },
                        _ => continue,
                    };
                    if io.write_all(&answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_an_endpoint_refuses_goes_to_another_on_the_codec_path() {
    refused_requests_go_to_another_endpoint(Answer::Reset).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_above_an_endpoints_goaway_goes_to_another_on_the_codec_path() {
    refused_requests_go_to_another_endpoint(Answer::GoAway).await;
}

/// One pod serves, one endpoint refuses every stream `how`: every call still succeeds, each
/// one the refuser took sent on to the pod.
async fn refused_requests_go_to_another_endpoint(how: Answer) {
    let pods = pods(1).await;
    let mut endpoints = endpoints(&pods);
    endpoints.push(Endpoint::new(scripted_upstream(how).await, "refuser"));
    let b = serve(endpoints, |rx| CodecBalancer::new(Config::default(), rx)).await;
    let mut c = client(b.addr).await;
    for i in 0..60u32 {
        let payload = i.to_be_bytes();
        let reply = c
            .echo(req(&payload))
            .await
            .unwrap_or_else(|s| panic!("call {i} fails: {s:?}"))
            .into_inner();
        assert_eq!(reply.payload, payload, "with its own body");
        assert_eq!(reply.pod, "pod-0");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_grpc_js_and_tonic_run_every_call_kind_through_the_codec_path() {
    // The clients' harness (testing/clients) against a codec balancer over two pods: unary
    // calls, 4 MiB calls, a server stream and a bidi stream per client, none failing.
    use skewless_clients::{ClientKind, ClientSpec, Harness};
    let pods = pods(2).await;
    let b = codec_balancer(&pods).await;
    let harness = tokio::task::spawn_blocking(Harness::new)
        .await
        .expect("task")
        .expect("the harness needs `cargo xtask setup` (venv, npm packages)");
    for kind in ClientKind::ALL {
        let spec = ClientSpec {
            concurrency: 8,
            large_calls: 2,
            stream: Some(Duration::from_millis(600)),
            bidi: Some(Duration::from_millis(600)),
            ..ClientSpec::unary(b.addr.to_string(), 200)
        };
        let h = harness.clone();
        let r = tokio::task::spawn_blocking(move || h.run_local(kind, &spec))
            .await
            .expect("task")
            .unwrap_or_else(|e| panic!("{kind}: {e:?}"));
        assert_eq!(r.failed_calls(), 0, "{kind}: {r:?}");
        assert_eq!(r.unary.ok, 200, "{kind}: every unary call succeeds: {r:?}");
        assert_eq!(r.unary.pods.len(), 2, "{kind}: over both pods: {r:?}");
        assert_eq!(r.large.ok, 2, "{kind}: both 4 MiB calls come back whole");
        assert!(
            r.server_stream.as_ref().is_some_and(|s| s.complete()),
            "{kind}: the server stream ends OK with every reply: {r:?}"
        );
        assert!(
            r.bidi.as_ref().is_some_and(|s| s.complete()),
            "{kind}: every bidi message is answered: {r:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_sent_after_a_wait_carries_the_budget_that_is_left() {
    // The endpoint starts 300 ms after a call with grpc-timeout 5S: what it receives is what
    // is left of the 5 s, not 5 s.
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let b = serve(vec![Endpoint::new(addr, "late")], |rx| {
        CodecBalancer::new(Config::default(), rx)
    })
    .await;
    let call = tokio::spawn(async move {
        support::raw_client(b.addr)
            .await
            .send_request(support::grpc_request(b.addr, Some("5S")))
            .await
            .map(|r| r.status())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (tx, mut timeouts) = tokio::sync::mpsc::unbounded_channel();
    let listener = tokio::net::TcpListener::bind(addr).await.expect("rebind");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let _ = tx.send(req.headers().get("grpc-timeout").cloned());
                        async move {
                            let mut resp =
                                http::Response::new(http_body_util::Empty::<bytes::Bytes>::new());
                            resp.headers_mut()
                                .insert("grpc-status", http::HeaderValue::from_static("0"));
                            Ok::<_, std::convert::Infallible>(resp)
                        }
                    });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    let forwarded = tokio::time::timeout(Duration::from_secs(5), timeouts.recv())
        .await
        .expect("the request reaches the endpoint once it is up")
        .expect("a request")
        .expect("with a grpc-timeout");
    let forwarded = skewless_balancer::grpc::parse_timeout(&forwarded).expect("valid");
    assert!(
        forwarded <= Duration::from_millis(4_750),
        "what is left of 5 s after a 300 ms wait, got {forwarded:?}"
    );
    assert_eq!(call.await.expect("task").expect("answered"), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_makes_no_room_for_its_reply_is_reset_after_the_stalled_reader_timeout() {
    // A raw client with 64 KiB windows asks for a 1 MB reply and never reads it: the
    // balancer holds what does not fit, and after the 1 s timeout (checked every 250 ms)
    // resets the stream both ways and counts a stalled reader.
    use http_body_util::BodyExt as _;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use prost::Message as _;
    let pods = pods(1).await;
    let config = Config {
        stalled_reader_timeout: Some(Duration::from_secs(1)),
        ..Config::default()
    };
    let b = serve(endpoints(&pods), |rx| CodecBalancer::new(config, rx)).await;
    let mut c = client(b.addr).await;
    until_ready(&mut c).await;
    let tcp = tokio::net::TcpStream::connect(b.addr)
        .await
        .expect("connect");
    let (mut send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .handshake(TokioIo::new(tcp))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let message = EchoRequest {
        reply_size: 1_000_000,
        ..EchoRequest::default()
    }
    .encode_to_vec();
    let mut body = vec![0u8];
    body.extend_from_slice(&u32::try_from(message.len()).expect("small").to_be_bytes());
    body.extend_from_slice(&message);
    let request = http::Request::post(format!("http://{}/skewless.echo.v1.Echo/Echo", b.addr))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .expect("request");
    let resp = send.send_request(request).await.expect("response headers");
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let mut body = resp.into_body();
    let ended = loop {
        match body.frame().await {
            Some(Ok(_)) => {}
            Some(Err(e)) => break Some(e),
            None => break None,
        }
    };
    let error = ended.expect("the reply is cut, not whole");
    let reason = std::error::Error::source(&error)
        .and_then(|e| e.downcast_ref::<h2::Error>())
        .and_then(h2::Error::reason);
    assert_eq!(reason, Some(h2::Reason::CANCEL), "{error:?}");
    let stalled = skewless_balancer::metrics::FailureReason::ALL
        .iter()
        .position(|r| *r == skewless_balancer::metrics::FailureReason::StalledReader)
        .expect("a reason");
    assert_eq!(b.balancer.metrics().failures[stalled], 1, "counted once");
}

/// An HTTP/2 upstream that answers every call with a trailers-only UNAVAILABLE while `failing`
/// holds true, and with an empty reply otherwise; it counts the calls it answers with a reply.
async fn flaky_upstream() -> (
    SocketAddr,
    tokio::sync::watch::Sender<bool>,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (failing, rx) = tokio::sync::watch::channel(true);
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (rx, count) = (rx.clone(), count.clone());
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(stream).await else {
                    return;
                };
                while let Some(Ok((_request, mut respond))) = conn.accept().await {
                    let head = http::Response::builder().header("content-type", "application/grpc");
                    if *rx.borrow() {
                        let head = head.header("grpc-status", "14").body(()).expect("head");
                        let _ = respond.send_response(head, true);
                        continue;
                    }
                    count.fetch_add(1, Ordering::Relaxed);
                    let Ok(mut body) = respond.send_response(head.body(()).expect("head"), false)
                    else {
                        continue;
                    };
                    let _ = body.send_data(bytes::Bytes::from_static(&[0; 5]), false);
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                    let _ = body.send_trailers(trailers);
                }
            });
        }
    });
    (addr, failing, served)
}

/// An endpoint ejected for failing calls, whose connection stays up, gets calls again once
/// it serves: when its ejection is over it is PINGed, and the answer lets it be probed with
/// calls, then brought back. Without the PING it would wait for a new connection, which a
/// connection that stays up never gives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ejected_endpoint_that_answers_its_ping_serves_again_on_the_codec_path() {
    ejected_endpoint_serves_again(Config::default()).await;
}

/// The same when the connection has spent the PINGs a server allows without sending data
/// (idle PINGs every 100 ms spend them while it is ejected): the proof is a new connection,
/// opened once the old one carries no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ejected_endpoint_whose_pings_are_spent_is_proven_by_a_new_connection() {
    let mut config = Config::default();
    config.liveness.idle_ping_interval = Duration::from_millis(100);
    ejected_endpoint_serves_again(config).await;
}

async fn ejected_endpoint_serves_again(config: Config) {
    use std::sync::atomic::Ordering;
    let (flaky, failing, served) = flaky_upstream().await;
    let pods = pods(1).await;
    let mut eps = endpoints(&pods);
    eps.push(Endpoint::new(flaky, "flaky"));
    let b = serve(eps, |rx| CodecBalancer::new(config, rx)).await;
    let mut c = client(b.addr).await;
    until_ready(&mut c).await;
    // Bounded: 200 calls, enough for the failure threshold of 5 to eject it.
    let mut failed = 0;
    for _ in 0..200 {
        if c.echo(req(b"f")).await.is_err() {
            failed += 1;
        }
    }
    assert!(
        failed > 0,
        "calls reached the failing endpoint (else this proves nothing)"
    );
    failing.send_replace(false);
    // Its ejection (1 s) ends meanwhile; calls for up to 5 s (bounded: 20,000).
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut n = 0;
    while tokio::time::Instant::now() < until && n < 20_000 && served.load(Ordering::Relaxed) < 5 {
        c.echo(req(b"f")).await.expect("both endpoints serve");
        n += 1;
    }
    assert!(
        served.load(Ordering::Relaxed) >= 5,
        "the endpoint serves again after its ejection: {} calls in {n}",
        served.load(Ordering::Relaxed)
    );
}

/// A pod whose response carries a field an h2-based client refuses with its whole connection
/// (a name that is not a token): its call fails (RST_STREAM INTERNAL_ERROR), the field never
/// reaches the client, and the client's connection serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_response_fails_its_call_not_the_client_connection() {
    let up = scripted_upstream(Answer::Malformed).await;
    let (_b, mut io) = raw_client_over(up, "malformed").await;
    let mut decoder = httlib_hpack::Decoder::default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut stream = 1u32;
    // Requests until one reaches the pod (before its connection is up, the balancer answers
    // UNAVAILABLE itself).
    let reset = 'calls: loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no request reached the pod within 5 s"
        );
        io.write_all(&frame(
            Kind::Headers,
            flags::END_HEADERS | flags::END_STREAM,
            stream,
            &[0x83, 0x86, 0x84],
        ))
        .await
        .expect("request");
        loop {
            let (head, payload) = next_frame(&mut io).await;
            match head.kind {
                Kind::Headers => {
                    let mut block = payload.clone();
                    let mut fields = Vec::new();
                    decoder.decode(&mut block, &mut fields).expect("decodes");
                    assert!(
                        fields.iter().all(|(n, _, _)| n != b"bad name"),
                        "the malformed field reached the client: {fields:?}"
                    );
                    if head.is_end_stream() && head.stream_id == stream {
                        break;
                    }
                }
                Kind::RstStream if head.stream_id == stream => {
                    break 'calls RstStream::decode(&head, &payload)
                        .expect("RST_STREAM")
                        .error_code;
                }
                Kind::GoAway => panic!("the client connection is closed"),
                _ => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        stream += 2;
    };
    assert_eq!(reset, ErrorCode::INTERNAL_ERROR);
    let mut ping = Vec::new();
    Ping {
        ack: false,
        opaque: *b"still up",
    }
    .encode(&mut ping);
    io.write_all(&ping).await.expect("ping");
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let (head, _) = next_frame(&mut io).await;
            assert_ne!(head.kind, Kind::GoAway, "the client connection is closed");
            if head.kind == Kind::Ping && head.is_ack() {
                return;
            }
        }
    })
    .await
    .expect("the connection answers its PING");
}
