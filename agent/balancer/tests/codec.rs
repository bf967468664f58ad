//! Request mode on the frame codec (`CodecBalancer`, experimental): what its minimal data path
//! does today, with real tonic clients and real echo servers over loopback. Bounded to a few
//! seconds and a few hundred calls each.

#[path = "support/mod.rs"]
mod support;

use std::net::SocketAddr;
use std::time::Duration;

use skewless_balancer::{CodecBalancer, Config};
use skewless_echo::pb::EchoRequest;
use skewless_echo::pb::echo_client::EchoClient;
use support::{Serving, endpoints, pods, serve};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_calls_on_the_codec_path_get_their_own_replies_from_every_pod() {
    let pods = pods(3).await;
    let b = codec_balancer(&pods).await;
    let mut c = client(b.addr).await;
    until_ready(&mut c).await;
    let mut seen = std::collections::BTreeMap::new();
    for i in 0..150u32 {
        let payload = format!("call {i}");
        let reply = c
            .echo(req(payload.as_bytes()))
            .await
            .expect("every call succeeds")
            .into_inner();
        assert_eq!(
            reply.payload,
            payload.as_bytes(),
            "each call gets its own reply"
        );
        *seen.entry(reply.pod).or_insert(0u32) += 1;
    }
    assert_eq!(seen.len(), 3, "calls are balanced over every pod: {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_calls_in_flight_on_one_connection_all_succeed() {
    let pods = pods(2).await;
    let b = codec_balancer(&pods).await;
    let mut c = client(b.addr).await;
    until_ready(&mut c).await;
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..200u32 {
        let mut c = c.clone();
        calls.spawn(async move {
            let payload = i.to_be_bytes();
            let reply = c.echo(req(&payload)).await?.into_inner();
            assert_eq!(
                reply.payload, payload,
                "replies are routed to their own stream"
            );
            Ok::<_, tonic::Status>(())
        });
    }
    let mut ok = 0;
    while let Some(done) = calls.join_next().await {
        done.expect("task").expect("call succeeds");
        ok += 1;
    }
    assert_eq!(ok, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stream_passes_through_with_its_trailers() {
    let pods = pods(1).await;
    let b = codec_balancer(&pods).await;
    let mut c = client(b.addr).await;
    until_ready(&mut c).await;
    let mut stream = c
        .server_stream(EchoRequest {
            payload: b"s".to_vec(),
            count: 5,
            ..EchoRequest::default()
        })
        .await
        .expect("server stream starts")
        .into_inner();
    let mut n = 0;
    while let Some(msg) = stream
        .message()
        .await
        .expect("the stream ends with status OK")
    {
        assert_eq!(msg.payload, b"s");
        n += 1;
    }
    assert_eq!(n, 5, "every message of the stream arrives");
    let trailers = stream.trailers().await.expect("trailers").expect("some");
    assert_eq!(
        trailers.get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"0"[..]),
        "the server's grpc-status reaches the client in the trailers"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_endpoint_gives_unavailable() {
    let b = codec_balancer(&[]).await;
    let mut c = client(b.addr).await;
    let status = c.echo(req(b"x")).await.expect_err("nothing to serve it");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
}
