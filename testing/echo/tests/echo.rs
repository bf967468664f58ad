//! The echo backend's contract: pod name in replies, run-time delay (in-process and through the
//! admin endpoint), and grpc.health.v1.

use std::time::Duration;

use skewless_echo::SpawnedEcho;
use skewless_echo::pb::EchoRequest;
use skewless_echo::pb::echo_client::EchoClient;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

async fn http1(addr: std::net::SocketAddr, request: &str) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect admin");
    s.write_all(request.as_bytes()).await.expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    out
}

#[tokio::test]
async fn replies_name_the_pod_and_wait_the_delay_set_at_run_time() {
    let echo = SpawnedEcho::start("127.0.0.1:0".parse().expect("addr"), "pod-a")
        .await
        .expect("start");
    let mut c = EchoClient::connect(format!("http://{}", echo.addr))
        .await
        .expect("connect");
    let r = c
        .echo(EchoRequest {
            payload: b"hi".to_vec(),
            ..EchoRequest::default()
        })
        .await
        .expect("echo")
        .into_inner();
    assert_eq!(r.pod, "pod-a");
    assert_eq!(r.payload, b"hi");

    // The admin endpoint sets the delay every call then waits.
    let admin = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let admin_addr = admin.local_addr().expect("addr");
    tokio::spawn(skewless_echo::admin::serve(
        admin,
        echo.control.clone(),
        std::future::pending(),
    ));
    let resp = http1(
        admin_addr,
        "PUT /delay/150 HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 204"), "{resp}");
    assert_eq!(echo.control.delay(), Duration::from_millis(150));
    let started = tokio::time::Instant::now();
    c.echo(EchoRequest::default()).await.expect("echo");
    assert!(
        started.elapsed() >= Duration::from_millis(150),
        "the call waited the pod's delay"
    );
    let resp = http1(
        admin_addr,
        "GET /delay HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.ends_with("150\n"), "{resp}");
    echo.stop().await.expect("graceful stop");
}

#[tokio::test]
async fn health_reports_serving_and_follows_the_control() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let echo = SpawnedEcho::start("127.0.0.1:0".parse().expect("addr"), "pod-h")
        .await
        .expect("start");
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", echo.addr))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut h = HealthClient::new(channel);
    let check = |service: &str| HealthCheckRequest {
        service: service.to_owned(),
    };
    let s = h
        .check(check(skewless_echo::SERVICE_NAME))
        .await
        .expect("check")
        .into_inner();
    assert_eq!(s.status(), ServingStatus::Serving);
    echo.control.set_serving(false).await;
    let s = h.check(check("")).await.expect("check").into_inner();
    assert_eq!(s.status(), ServingStatus::NotServing);
    echo.stop().await.expect("graceful stop");
}

#[tokio::test]
async fn server_stream_spaces_its_replies_by_the_interval() {
    let echo = SpawnedEcho::start("127.0.0.1:0".parse().expect("addr"), "pod-s")
        .await
        .expect("start");
    let mut c = EchoClient::connect(format!("http://{}", echo.addr))
        .await
        .expect("connect");
    let started = tokio::time::Instant::now();
    let mut stream = c
        .server_stream(EchoRequest {
            count: 3,
            interval_ms: 150,
            ..EchoRequest::default()
        })
        .await
        .expect("server stream")
        .into_inner();
    let mut n = 0;
    while let Some(reply) = stream.message().await.expect("stream ends with OK") {
        assert_eq!(reply.pod, "pod-s");
        n += 1;
    }
    assert_eq!(n, 3, "count replies, then OK");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "two intervals of 150 ms lie between three replies: {:?}",
        started.elapsed()
    );
}

/// Reads frames from `tcp` until a GOAWAY arrives; returns it and the frame after it.
async fn read_until_goaway(tcp: &mut TcpStream) -> (u32, u32, Option<skewless_frame::Kind>) {
    use skewless_frame::{Frames, GoAway, Kind, MAX_MAX_FRAME_SIZE};
    let mut buf = Vec::new();
    let mut goaway = None;
    loop {
        let mut chunk = [0u8; 16384];
        let n = tcp.read(&mut chunk).await.expect("read");
        assert!(
            n > 0,
            "the server closed before a GOAWAY and the frame after it"
        );
        buf.extend_from_slice(&chunk[..n]);
        let mut frames = Frames::new(&buf, MAX_MAX_FRAME_SIZE);
        for frame in frames.by_ref() {
            let (head, payload) = frame.expect("valid frames");
            match goaway {
                None if head.kind == Kind::GoAway => {
                    let g = GoAway::decode(&head, payload).expect("valid GOAWAY");
                    goaway = Some((g.last_stream_id, g.error_code.0));
                }
                Some((last, code)) => return (last, code, Some(head.kind)),
                None => {}
            }
        }
        let consumed = buf.len() - frames.rest().len();
        buf.drain(..consumed);
    }
}

#[tokio::test]
async fn max_connection_age_sends_the_graceful_two_phase_goaway() {
    use skewless_frame::{ErrorCode, Kind, MAX_STREAM_ID, PREFACE, Settings};
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (control_tx, _control_rx) = tokio::sync::oneshot::channel();
    let options = skewless_echo::ServeOptions {
        max_connection_age: Some(Duration::from_millis(300)),
        ..skewless_echo::ServeOptions::default()
    };
    let server = tokio::spawn(async move {
        skewless_echo::serve_with(
            listener,
            "pod-g",
            options,
            control_tx,
            std::future::pending(),
        )
        .await
    });
    let mut tcp = TcpStream::connect(addr).await.expect("connect");
    let mut hello = PREFACE.to_vec();
    Settings::encode(false, &[], &mut hello);
    tcp.write_all(&hello).await.expect("preface");
    let (last, code, next) =
        tokio::time::timeout(Duration::from_secs(5), read_until_goaway(&mut tcp))
            .await
            .expect("a GOAWAY within 5 s of a 300 ms max age");
    assert_eq!(
        (last, code),
        (MAX_STREAM_ID, ErrorCode::NO_ERROR.0),
        "the first GOAWAY refuses nothing"
    );
    assert_eq!(next, Some(Kind::Ping), "a PING follows the first GOAWAY");
    server.abort();
}
