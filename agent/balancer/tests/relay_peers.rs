//! Connection mode's relay between real HTTP/2 peers: h2's client and server (flow control,
//! many streams, large bodies, a rotation with streams in flight), and a real tonic client
//! over loopback TCP (recognised from its user-agent as a client that fails calls on GOAWAY).

use std::time::Duration;

use bytes::Bytes;
use skewless_balancer::metrics::RotationReason;
use skewless_balancer::relay::{RelayEnd, RelayError, RelayHandle, RelaySettings, relay};
use skewless_echo::SpawnedEcho;
use skewless_echo::pb::EchoRequest;
use skewless_echo::pb::echo_client::EchoClient;
use tokio::io::duplex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// An h2 server that answers each request, once `go` is true, with its request body.
fn h2_echo_server(io: tokio::io::DuplexStream, go: watch::Receiver<bool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut conn = h2::server::handshake(io).await.expect("server handshake");
        while let Some(accepted) = conn.accept().await {
            let Ok((req, mut respond)) = accepted else {
                return;
            };
            let mut go = go.clone();
            tokio::spawn(async move {
                let mut body = req.into_body();
                let mut got = Vec::new();
                while let Some(chunk) = body.data().await {
                    let chunk = chunk.expect("request body");
                    let _ = body.flow_control().release_capacity(chunk.len());
                    got.extend_from_slice(&chunk);
                }
                go.wait_for(|go| *go).await.expect("go");
                let mut send = respond
                    .send_response(http::Response::new(()), false)
                    .expect("response");
                send.send_data(Bytes::from(got), true)
                    .expect("response body");
            });
        }
    })
}

struct H2Bed {
    send: h2::client::SendRequest<Bytes>,
    handle: RelayHandle,
    go: watch::Sender<bool>,
    relay: JoinHandle<Result<RelayEnd, RelayError>>,
}

async fn h2_bed() -> H2Bed {
    // Small pipes: the relay has to wait for room, as on a real socket.
    let (client, client_relay) = duplex(16 * 1024);
    let (backend, backend_relay) = duplex(16 * 1024);
    let handle = RelayHandle::new();
    let h = handle.clone();
    let relay = tokio::spawn(async move {
        relay(client_relay, backend_relay, &RelaySettings::default(), h).await
    });
    let (go, go_rx) = watch::channel(false);
    h2_echo_server(backend, go_rx);
    let (send, conn) = h2::client::handshake(client)
        .await
        .expect("client handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    H2Bed {
        send,
        handle,
        go,
        relay,
    }
}

/// Sends a POST with `body`; the response body's future.
async fn call(
    send: &h2::client::SendRequest<Bytes>,
    body: Vec<u8>,
) -> Result<JoinHandle<Result<Vec<u8>, h2::Error>>, h2::Error> {
    let mut send = send.clone().ready().await?;
    let (resp, mut stream) = send.send_request(
        http::Request::post("http://echo/x")
            .body(())
            .expect("request"),
        false,
    )?;
    Ok(tokio::spawn(async move {
        // Send the body within the flow-control window as it opens.
        let mut rest = Bytes::from(body);
        while !rest.is_empty() {
            stream.reserve_capacity(rest.len());
            let n = std::future::poll_fn(|cx| stream.poll_capacity(cx))
                .await
                .expect("capacity")?;
            stream.send_data(rest.split_to(n.min(rest.len())), false)?;
        }
        stream.send_data(Bytes::new(), true)?;
        let mut body = resp.await?.into_body();
        let mut got = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk?;
            let _ = body.flow_control().release_capacity(chunk.len());
            got.extend_from_slice(&chunk);
        }
        Ok(got)
    }))
}

#[tokio::test(flavor = "current_thread")]
async fn h2_peers_carry_concurrent_streams_with_large_bodies_under_flow_control() {
    let b = h2_bed().await;
    b.go.send(true).expect("go");
    let mut calls = Vec::new();
    for i in 0..40u32 {
        // 40 x 200 KB: far above the default 64 KiB windows, so WINDOW_UPDATEs must flow.
        let body: Vec<u8> = (0..200_000u32).map(|j| (i + j) as u8).collect();
        calls.push((body.clone(), call(&b.send, body).await.expect("sent")));
    }
    for (i, (body, call)) in calls.into_iter().enumerate() {
        let got = tokio::time::timeout(Duration::from_secs(20), call)
            .await
            .expect("the call finishes")
            .expect("task")
            .expect("the call succeeds");
        assert!(got == body, "call {i}: the body comes back byte for byte");
    }
    assert_eq!(b.handle.stats().requests(), 40);
    assert_eq!(b.handle.stats().open_streams(), 0);
    drop(b.send);
    let end = tokio::time::timeout(Duration::from_secs(5), b.relay)
        .await
        .expect("the relay ends when the client goes")
        .expect("task")
        .expect("clean end");
    assert_eq!(end, RelayEnd::Closed);
}

#[tokio::test(flavor = "current_thread")]
async fn an_h2_client_rotated_with_streams_in_flight_gets_every_response() {
    let b = h2_bed().await;
    let mut calls = Vec::new();
    for i in 0..10u8 {
        calls.push(call(&b.send, vec![i; 70_000]).await.expect("sent"));
    }
    // Every request is at the backend (the server holds the responses) before the rotation.
    tokio::time::timeout(Duration::from_secs(5), async {
        while b.handle.stats().requests() < 10 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("requests counted");
    b.handle.rotate(RotationReason::BackendRemoved);
    // h2 answers our PING at once: the final GOAWAY follows; the streams go on.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        call(&b.send, vec![1]).await.is_err(),
        "after the GOAWAY the client opens no new stream"
    );
    b.go.send(true).expect("go");
    for (i, call) in calls.into_iter().enumerate() {
        let got = tokio::time::timeout(Duration::from_secs(10), call)
            .await
            .expect("the call finishes")
            .expect("task")
            .expect("a stream opened before the final GOAWAY succeeds");
        assert_eq!(got, vec![i as u8; 70_000]);
    }
    let end = tokio::time::timeout(Duration::from_secs(5), b.relay)
        .await
        .expect("the relay ends after the last stream")
        .expect("task")
        .expect("clean end");
    assert_eq!(end, RelayEnd::Rotated(RotationReason::BackendRemoved));
}

/// A listener that relays every connection to `backend`; hands out each connection's handle.
async fn relaying_listener(
    backend: std::net::SocketAddr,
) -> (std::net::SocketAddr, mpsc::UnboundedReceiver<RelayHandle>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let backend = TcpStream::connect(backend).await.expect("backend");
            let handle = RelayHandle::new();
            let _ = tx.send(handle.clone());
            tokio::spawn(
                async move { relay(client, backend, &RelaySettings::default(), handle).await },
            );
        }
    });
    (addr, rx)
}

async fn user_agent_verdict(handle: &RelayHandle) -> bool {
    tokio::time::timeout(Duration::from_secs(5), async {
        while !handle.stats().user_agent_known() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the first request is decoded");
    handle.stats().unrotatable()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tonic_clients_are_recognised_as_unrotatable_and_others_are_not() {
    let echo = SpawnedEcho::start("127.0.0.1:0".parse().expect("addr"), "pod-0")
        .await
        .expect("echo");
    let (addr, mut handles) = relaying_listener(echo.addr).await;

    let mut tonic_client = EchoClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let reply = tonic_client
        .echo(EchoRequest {
            payload: b"hi".to_vec(),
            ..EchoRequest::default()
        })
        .await
        .expect("a call through the relay");
    assert_eq!(reply.into_inner().pod, "pod-0");
    let handle = handles.recv().await.expect("a relayed connection");
    assert!(
        user_agent_verdict(&handle).await,
        "tonic's user-agent marks it unrotatable"
    );
    assert_eq!(handle.stats().requests(), 1);

    // Another client (h2 with a grpc-go user-agent) is rotatable.
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (send, conn) = h2::client::handshake(tcp).await.expect("handshake");
    tokio::spawn(conn);
    let mut send = send.ready().await.expect("ready");
    let req = http::Request::post(format!("http://{addr}/skewless.echo.v1.Echo/Echo"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("user-agent", "grpc-go/1.60.0")
        .body(())
        .expect("request");
    let (resp, mut body) = send.send_request(req, false).expect("send");
    body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .expect("body");
    let resp = resp.await.expect("response");
    assert_eq!(resp.status(), 200);
    let handle = handles.recv().await.expect("a relayed connection");
    assert!(
        !user_agent_verdict(&handle).await,
        "grpc-go's user-agent is rotatable"
    );
    echo.stop().await.expect("stop");
}
