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
