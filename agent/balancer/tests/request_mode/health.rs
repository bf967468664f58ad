//! Active health checking (`grpc.health.v1`), switched on, off and changed live.

use super::*;

on_both_paths!(
    endpoint_turning_not_serving_gets_no_new_calls_100ms_later,
    servers_without_a_health_service_count_as_serving,
    health_service_set_and_cleared_live_applies_without_failing_calls,
    health_checks_switched_off_while_an_endpoint_reconnects_leave_it_serving,
);

async fn endpoint_turning_not_serving_gets_no_new_calls_100ms_later<P: DataPath>() {
    let pods = pods(2).await;
    let config = Config {
        health_service: Some(skewless_echo::SERVICE_NAME.to_owned()),
        ..Config::default()
    };
    let b = balancer_on::<P>(config, endpoints(&pods)).await;
    let mut c = client(b.addr).await;
    let mut names = Vec::new();
    for _ in 0..20 {
        names.push(c.echo(req(b"h")).await.expect("echo").into_inner().pod);
    }
    assert!(
        tally(&names, 2).iter().all(|n| *n > 0),
        "both serve at first: {names:?}"
    );

    pods[1].control.set_serving(false).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..40 {
        let pod = c.echo(req(b"h")).await.expect("echo").into_inner().pod;
        assert_eq!(
            pod, "pod-0",
            "a NOT_SERVING endpoint gets no new call 100 ms later"
        );
    }

    pods[1].control.set_serving(true).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut back = false;
    for _ in 0..40 {
        if c.echo(req(b"h")).await.expect("echo").into_inner().pod == "pod-1" {
            back = true;
            break;
        }
    }
    assert!(
        back,
        "SERVING again brings it back: {:?}",
        b.balancer.stats()
    );
    b.stop().await;
}

async fn servers_without_a_health_service_count_as_serving<P: DataPath>() {
    // A server with no health service answers the Watch with UNIMPLEMENTED (trailers-only);
    // gRFC A17 counts it as serving, so calls must reach it.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(|req: http::Request<Incoming>| async move {
                        let status = if req.uri().path().starts_with("/grpc.health.v1.Health/") {
                            "12"
                        } else {
                            "0"
                        };
                        let resp = http::Response::builder()
                            .header("content-type", "application/grpc")
                            .header("grpc-status", status)
                            .body(http_body_util::Empty::<Bytes>::new())
                            .expect("response");
                        Ok::<_, Infallible>(resp)
                    });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    let config = Config {
        health_service: Some(String::new()),
        ..Config::default()
    };
    let b = balancer_on::<P>(config, vec![Endpoint::new(addr, "no-health")]).await;
    let mut send = raw_client(b.addr).await;
    let resp = send
        .send_request(grpc_request(b.addr, Some("2S")))
        .await
        .expect("response");
    assert_eq!(
        resp.headers()["grpc-status"],
        "0",
        "the call reached the upstream"
    );
    b.stop().await;
}

/// One caller's calls: when each was sent, when it ended, and which pod answered or how it
/// failed.
type Calls = Vec<(
    tokio::time::Instant,
    tokio::time::Instant,
    Result<String, tonic::Status>,
)>;

/// Set to stop a load; it stops by itself after 20 s.
type Stop = Arc<std::sync::atomic::AtomicBool>;

fn running(stop: &Stop, started: tokio::time::Instant) -> bool {
    !stop.load(std::sync::atomic::Ordering::Relaxed) && started.elapsed() < Duration::from_secs(20)
}

/// Unary calls from `tasks` concurrent callers until `stop`.
fn unary_load(
    c: &EchoClient<Channel>,
    tasks: usize,
    stop: &Stop,
) -> Vec<tokio::task::JoinHandle<Calls>> {
    let started = tokio::time::Instant::now();
    (0..tasks)
        .map(|_| {
            let (mut c, stop) = (c.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while running(&stop, started) {
                    let sent = tokio::time::Instant::now();
                    let r = c.echo(req(b"l")).await.map(|r| r.into_inner().pod);
                    seen.push((sent, tokio::time::Instant::now(), r));
                }
                seen
            })
        })
        .collect()
}

/// A bidi stream that stays open until `stop`, one message every 20 ms; the replies it got.
fn open_stream(
    c: &EchoClient<Channel>,
    stop: &Stop,
) -> tokio::task::JoinHandle<Result<usize, tonic::Status>> {
    let started = tokio::time::Instant::now();
    let (mut c, stop) = (c.clone(), stop.clone());
    tokio::spawn(async move {
        let (tx, rx) = mpsc::channel(1);
        let mut replies = c
            .bidi(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        let mut got = 0;
        while running(&stop, started) {
            tx.send(req(b"s")).await.expect("stream open");
            replies
                .message()
                .await?
                .ok_or_else(|| tonic::Status::internal("stream ended early"))?;
            got += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(tx);
        while replies.message().await?.is_some() {}
        Ok(got)
    })
}

/// Waits (up to 5 s) until the balancer reports endpoint `i` in `state`; returns when it did.
async fn until_state(
    b: &impl DataPath,
    i: usize,
    state: skewless_balancer::EndpointState,
) -> tokio::time::Instant {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if b.stats()[i].state == state {
            return tokio::time::Instant::now();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "endpoint {i} reaches {state:?} within 5 s: {:?}",
            b.stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn health_service_set_and_cleared_live_applies_without_failing_calls<P: DataPath>() {
    use skewless_balancer::EndpointState::{Active, NotServing};
    let pods = pods(3).await;
    // pod-2 reports NOT_SERVING all along; without health checking it still gets its share.
    pods[2].control.set_serving(false).await;
    let b = balancer_on::<P>(Config::default(), endpoints(&pods)).await;
    let c = client(b.addr).await;
    let stop = Stop::default();
    let stream = open_stream(&c, &stop);
    let load = unary_load(&c, 4, &stop);
    let phase = Duration::from_millis(600);
    let start = tokio::time::Instant::now();

    tokio::time::sleep(phase).await;
    let on_at = tokio::time::Instant::now();
    b.balancer.reconfigure(Config {
        health_service: Some(skewless_echo::SERVICE_NAME.to_owned()),
        ..Config::default()
    });
    // The new watch reports within moments; from then on the pod gets no call.
    let out_at = until_state(&*b.balancer, 2, NotServing).await;
    tokio::time::sleep(phase).await;
    let off_at = tokio::time::Instant::now();
    b.balancer.reconfigure(Config::default());
    let back_at = until_state(&*b.balancer, 2, Active).await;
    tokio::time::sleep(phase).await;
    let stop_at = tokio::time::Instant::now();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);

    let mut all = Vec::new();
    for t in load {
        all.extend(t.await.expect("task"));
    }
    let replies = stream.await.expect("task");
    let failed: Vec<_> = all
        .iter()
        .filter_map(|(_, _, r)| r.as_ref().err())
        .collect();
    assert!(
        failed.is_empty(),
        "no call fails across the changes: {} of {}, e.g. {:?}",
        failed.len(),
        all.len(),
        failed.first()
    );
    // It only ends (Ok) after `stop`, so it was open across both changes.
    assert!(
        replies.as_ref().is_ok_and(|n| *n >= 5),
        "a stream open across both changes goes on: {replies:?}"
    );
    // Calls sent after `from` and done before `to`: so picked between the two (a call sent
    // before a change may be picked after it on a busy machine).
    let window = |from: tokio::time::Instant, to: tokio::time::Instant| {
        let names: Vec<String> = all
            .iter()
            .filter(|(sent, done, _)| *sent >= from && *done < to)
            .filter_map(|(_, _, r)| r.as_ref().ok().cloned())
            .collect();
        tally(&names, 3)
    };
    let before = window(start, on_at);
    let during = window(out_at, off_at);
    let after = window(back_at, stop_at);
    println!(
        "health on -> NotServing {:?}, off -> Active {:?}; pod-0..2 calls: before {before:?}, health on {during:?}, health off {after:?}",
        out_at - on_at,
        back_at - off_at
    );
    assert!(
        before[2] > 0,
        "without health checking the NOT_SERVING pod gets calls: {before:?}"
    );
    assert!(
        during[2] == 0 && during[0] > 0 && during[1] > 0,
        "once health checking reports it NOT_SERVING, it gets no call: {during:?}"
    );
    assert!(
        after[2] > 0,
        "switched off again, it gets calls again: {after:?}"
    );
    b.stop().await;
}

async fn health_checks_switched_off_while_an_endpoint_reconnects_leave_it_serving<P: DataPath>() {
    use skewless_balancer::EndpointState::{Active, Connecting, NotServing};
    let pods = pods(2).await;
    pods[1].control.set_serving(false).await;
    // pod-1 is reached through a relay, so the test can make it go away and come back at the
    // same address.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let via = listener.local_addr().expect("addr");
    let up = relay(listener, pods[1].addr);
    let b = balancer_on::<P>(
        Config {
            health_service: Some(skewless_echo::SERVICE_NAME.to_owned()),
            ..Config::default()
        },
        vec![
            Endpoint::new(pods[0].addr, "pod-0"),
            Endpoint::new(via, "pod-1"),
        ],
    )
    .await;
    until_state(&*b.balancer, 1, NotServing).await;
    // pod-1 goes away, health checks are switched off while the balancer reconnects to it,
    // then it is back.
    drop(up);
    until_state(&*b.balancer, 1, Connecting).await;
    b.balancer.reconfigure(Config::default());
    let _up = relay(
        TcpListener::bind(via).await.expect("rebind the relay"),
        pods[1].addr,
    );
    until_state(&*b.balancer, 1, Active).await;
    let mut c = client(b.addr).await;
    let mut names = Vec::new();
    for _ in 0..20 {
        names.push(c.echo(req(b"h")).await.expect("echo").into_inner().pod);
    }
    assert!(
        names.iter().any(|p| p == "pod-1"),
        "without health checks the reconnected pod serves: {names:?}"
    );
    b.stop().await;
}
