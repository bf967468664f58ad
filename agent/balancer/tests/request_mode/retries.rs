//! Retries: only when safe, on another endpoint, bounded; upstream restarts cost no call.
//! Every test runs on both data paths.

use super::*;

on_both_paths!(
    upstream_graceful_restart_fails_no_calls,
    refused_streams_are_retried_on_another_endpoint,
    retries_are_bounded_when_every_endpoint_refuses,
    only_methods_marked_retryable_are_retried_after_a_processing_failure,
    retryable_methods_added_live_are_retried_from_the_next_call,
    every_call_and_every_failure_is_counted_by_reason,
    a_servers_goaway_costs_no_call_of_a_one_endpoint_service,
);

async fn upstream_graceful_restart_fails_no_calls<P: DataPath>() {
    let mut pods = pods(2).await;
    let b = balancer_on::<P>(Config::default(), endpoints(&pods)).await;
    let c = client(b.addr).await;
    let stop_at = tokio::time::Instant::now() + Duration::from_millis(2000);
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (Vec::new(), Vec::new());
            while tokio::time::Instant::now() < stop_at {
                match c.echo(req(b"r")).await {
                    Ok(r) => ok.push(r.into_inner().pod),
                    Err(status) => failed.push(status),
                }
            }
            (ok, failed)
        }));
    }
    // Restart pod-0 twice under load: graceful GOAWAY, then a new server on the same port.
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let old = pods.remove(0);
        let addr = old.addr;
        old.stop().await.expect("graceful stop");
        let new = SpawnedEcho::start(addr, "pod-0")
            .await
            .expect("restart on the same port");
        pods.insert(0, new);
    }
    let (mut ok, mut failed) = (Vec::new(), Vec::new());
    for t in tasks {
        let (o, f) = t.await.expect("task");
        ok.extend(o);
        failed.extend(f);
    }
    assert!(
        failed.is_empty(),
        "no call may fail across upstream GOAWAY/restart: {:?}",
        &failed[..failed.len().min(3)]
    );
    assert!(ok.len() > 100, "load ran: {}", ok.len());
    // The restarted pod is reconnected (connect backoff) and back in rotation within seconds.
    for _ in 0..100 {
        let st = b.balancer.stats();
        if st
            .iter()
            .any(|s| s.name == "pod-0" && s.state == skewless_balancer::EndpointState::Active)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A slow first reply from the fresh server can raise its peak-EWMA estimate; while the
    // load is sequential it then wins its turn again once the estimate has decayed, within
    // the issue's 5 s recovery window.
    let mut c = c.clone();
    let mut back = false;
    for _ in 0..250 {
        if c.echo(req(b"r")).await.expect("echo").into_inner().pod == "pod-0" {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        back,
        "the restarted pod is used again: {:#?}",
        b.balancer.stats()
    );
    b.stop().await;
}

/// An HTTP/2 upstream that refuses every stream (RST_STREAM REFUSED_STREAM), as a server at
/// its limit does; it counts the streams it refused.
async fn refusing_upstream() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    resetting_upstream(h2::Reason::REFUSED_STREAM).await
}

/// An HTTP/2 upstream that resets every stream with `reason`; it counts the streams.
async fn resetting_upstream(
    reason: h2::Reason,
) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = refused.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(stream).await else {
                    return;
                };
                while let Some(Ok((_req, mut respond))) = conn.accept().await {
                    count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    respond.send_reset(reason);
                }
            });
        }
    });
    (addr, refused)
}

async fn refused_streams_are_retried_on_another_endpoint<P: DataPath>() {
    let (refusing, refused) = refusing_upstream().await;
    let pods = pods(1).await;
    let mut eps = endpoints(&pods);
    eps.push(Endpoint::new(refusing, "refusing"));
    let config = Config::default();
    let threshold = config.picker.failure_threshold;
    let b = balancer_on::<P>(config, eps).await;
    let mut c = client(b.addr).await;
    // More calls than the retry budget could cover if the refusing endpoint kept getting
    // first attempts (it answers at once and holds nothing in flight, so it looks cheap):
    // refusals count as failures, so it is ejected and the budget lasts.
    for _ in 0..60 {
        let r = c
            .echo(req(b"r"))
            .await
            .expect("a refused call is retried and succeeds");
        assert_eq!(r.into_inner().pod, "pod-0");
    }
    let refused = refused.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        refused > 0,
        "the refusing endpoint was tried (else this test proves nothing)"
    );
    // Ejected after `threshold` refusals in a row; a slow machine may let a few probes
    // through (one per probe interval once the ejection is over).
    assert!(
        refused <= threshold as usize + 5,
        "refusals eject the endpoint: it refused {refused} of 60 calls"
    );
    assert!(b.balancer.counters().retries > 0, "retries are counted");
    b.stop().await;
}

async fn retries_are_bounded_when_every_endpoint_refuses<P: DataPath>() {
    let (a, refused_a) = refusing_upstream().await;
    let (b_addr, refused_b) = refusing_upstream().await;
    // A small fixed allowance (1 retry per second over a 10 s window), so 30 calls can
    // exhaust it: the share of the traffic (0.2 per call) is what remains.
    let budget = RetryBudgetConfig {
        min_per_second: 1,
        ..RetryBudgetConfig::default()
    };
    let config = Config {
        retry_budget: budget.clone(),
        ..Config::default()
    };
    let b = balancer_on::<P>(
        config,
        vec![Endpoint::new(a, "a"), Endpoint::new(b_addr, "b")],
    )
    .await;
    let mut c = client(b.addr).await;
    let calls = 30;
    for _ in 0..calls {
        let status = c.echo(req(b"r")).await.expect_err("nobody serves");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    }
    let attempts = refused_a.load(std::sync::atomic::Ordering::Relaxed)
        + refused_b.load(std::sync::atomic::Ordering::Relaxed);
    // Budget: 10 retries of allowance (1/s over 10 s), +0.2 per call, one per retry.
    let allowance = budget.min_per_second as usize * budget.window.as_secs() as usize;
    assert!(
        attempts <= calls + allowance + calls / 5 + 1,
        "retries stay within the budget: {attempts} attempts for {calls} calls"
    );
    assert!(attempts > calls, "some calls were retried: {attempts}");
    let counters = b.balancer.counters();
    assert_eq!(
        counters.local_unavailable, 0,
        "upstream failures are not local ones"
    );
    assert!(counters.upstream_failures >= calls as u64, "{counters:?}");
    assert!(
        counters.retries_refused_by_budget > 0,
        "the budget said no: {counters:?}"
    );
    b.stop().await;
}

async fn only_methods_marked_retryable_are_retried_after_a_processing_failure<P: DataPath>() {
    let pods = pods(1).await;
    let run = |retryable: Vec<String>| {
        let mut eps = endpoints(&pods);
        async move {
            // INTERNAL_ERROR: the upstream may have run the call, so only an idempotent method
            // may be sent again.
            let (broken, hits) = resetting_upstream(h2::Reason::INTERNAL_ERROR).await;
            eps.push(Endpoint::new(broken, "broken"));
            let config = Config {
                retryable_methods: retryable,
                ..Config::default()
            };
            let b = balancer_on::<P>(config, eps).await;
            let mut c = client(b.addr).await;
            let mut failed = Vec::new();
            // At least 8 calls, and on until the broken endpoint has taken one: it serves only
            // once its connection is up and has answered a PING, and 8 quick calls were once
            // all over before that (1 run in 40). Bounded at 200 calls.
            for i in 0..200 {
                if i >= 8 && hits.load(std::sync::atomic::Ordering::Relaxed) > 0 {
                    break;
                }
                if let Err(status) = c.echo(req(b"i")).await {
                    failed.push(status);
                }
            }
            b.stop().await;
            (failed, hits.load(std::sync::atomic::Ordering::Relaxed))
        }
    };
    let (failed, hits) = run(Vec::new()).await;
    let failed = failed.len();
    assert!(
        hits > 0 && failed == hits,
        "not retryable: every call the broken endpoint took failed ({failed}/{hits})"
    );
    let (failed, hits) = run(vec!["/skewless.echo.v1.Echo/".to_owned()]).await;
    assert!(hits > 0, "the broken endpoint was tried");
    assert!(
        failed.is_empty(),
        "a retryable method is retried elsewhere: {failed:?}"
    );
}

async fn retryable_methods_added_live_are_retried_from_the_next_call<P: DataPath>() {
    // Never ejected, so the broken endpoint keeps being picked in both phases (else whether it
    // is tried after the change depends on how many calls it took before).
    let (_pods, hits, config, b) = beside_a_broken_endpoint::<P>().await;
    let mut c = client(b.addr).await;
    let hit = || hits.load(std::sync::atomic::Ordering::Relaxed);
    let mut failed = 0;
    for _ in 0..8 {
        failed += usize::from(c.echo(req(b"i")).await.is_err());
    }
    let before = hit();
    assert!(
        before > 0 && failed == before,
        "not retryable yet: every call the broken endpoint took failed ({failed}/{before})"
    );

    b.balancer.reconfigure(Config {
        retryable_methods: vec!["/skewless.echo.v1.Echo/Echo".to_owned()],
        ..config
    });
    let mut failed = Vec::new();
    for _ in 0..8 {
        if let Err(status) = c.echo(req(b"i")).await {
            failed.push(status);
        }
    }
    assert!(hit() > before, "the broken endpoint was tried again");
    assert!(
        failed.is_empty(),
        "once retryable, a call the broken endpoint reset is retried elsewhere: {failed:?}"
    );
    b.stop().await;
}

/// The Service's numbers follow the calls: every call's duration is recorded however it
/// ended, and every failed call is counted once, by its reason (a stream the backend reset is
/// `reset`; a Service without endpoints is `unavailable`).
async fn every_call_and_every_failure_is_counted_by_reason<P: DataPath>() {
    use skewless_balancer::metrics::FailureReason;
    let failures = |b: &P, reason: FailureReason| {
        let i = FailureReason::ALL.iter().position(|r| *r == reason);
        b.snapshot().failures[i.expect("a reason")]
    };
    // The broken endpoint keeps taking calls; not retryable.
    let (_pods, hits, _, b) = beside_a_broken_endpoint::<P>().await;
    let mut c = client(b.addr).await;
    // Bounded: 40 calls, enough for both endpoints to take some.
    let mut failed = 0;
    for _ in 0..40 {
        failed += u64::from(c.echo(req(b"m")).await.is_err());
    }
    let hits = hits.load(std::sync::atomic::Ordering::Relaxed) as u64;
    assert!(
        failed > 0 && failed == hits,
        "the broken endpoint's calls failed ({failed}/{hits})"
    );
    // The last call's stream may end a moment after the client has its answer.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while b.balancer.snapshot().latency.count() < 40 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        b.balancer.snapshot().latency.count(),
        40,
        "every call's duration is recorded"
    );
    assert_eq!(
        failures(&b.balancer, FailureReason::Reset),
        failed,
        "{:?}",
        b.balancer.snapshot().failures
    );
    b.endpoints.send_replace(Vec::new());
    tokio::time::sleep(Duration::from_millis(50)).await;
    let status = c.echo(req(b"m")).await.expect_err("no endpoints");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(
        failures(&b.balancer, FailureReason::Unavailable),
        1,
        "{:?}",
        b.balancer.snapshot().failures
    );
    b.stop().await;
}

/// A balancer on path `P` over one pod and an endpoint that resets every stream with
/// INTERNAL_ERROR (the upstream may have run the call, so only a retryable method is retried),
/// which is never ejected; with the pod, the count of the broken endpoint's streams, and the
/// configuration.
async fn beside_a_broken_endpoint<P: DataPath>() -> (
    Vec<SpawnedEcho>,
    Arc<std::sync::atomic::AtomicUsize>,
    Config,
    support::Serving<P>,
) {
    let pods = pods(1).await;
    let (broken, hits) = resetting_upstream(h2::Reason::INTERNAL_ERROR).await;
    let mut eps = endpoints(&pods);
    eps.push(Endpoint::new(broken, "broken"));
    let mut config = Config::default();
    config.picker.failure_threshold = u32::MAX;
    let b = balancer_on::<P>(config.clone(), eps).await;
    (pods, hits, config, b)
}

/// An HTTP/2 upstream whose first call on each connection takes 500 ms and sends a graceful
/// GOAWAY as it starts (a server at its max connection age, finishing what it has); other
/// calls are answered at once. Answers are empty gRPC replies; it counts its connections.
async fn goaway_after_first_call_upstream() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    support::counting_upstream(|stream| async move {
        let Ok(mut conn) = h2::server::handshake(stream).await else {
            return;
        };
        let mut first = true;
        while let Some(Ok((_request, mut respond))) = conn.accept().await {
            let slow = std::mem::replace(&mut first, false);
            if slow {
                conn.graceful_shutdown();
            }
            tokio::spawn(async move {
                if slow {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                let head = http::Response::builder()
                    .header("content-type", "application/grpc")
                    .body(())
                    .expect("head");
                let Ok(mut body) = respond.send_response(head, false) else {
                    return;
                };
                let _ = body.send_data(Bytes::from_static(&[0; 5]), false);
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                let _ = body.send_trailers(trailers);
            });
        }
    })
    .await
}

/// A Service with one endpoint whose server sends a graceful GOAWAY (its max connection age)
/// while a call is in flight: the call finishes on the old connection, and a call made
/// meanwhile goes on a new one instead of failing for want of another endpoint.
async fn a_servers_goaway_costs_no_call_of_a_one_endpoint_service<P: DataPath>() {
    let (addr, connections) = goaway_after_first_call_upstream().await;
    let b = balancer_on::<P>(Config::default(), vec![Endpoint::new(addr, "aging")]).await;
    let c = client(b.addr).await;
    let slow = {
        let mut c = c.clone();
        tokio::spawn(async move { c.echo(req(b"slow")).await })
    };
    // The GOAWAY is in by then (sent as the slow call arrived).
    tokio::time::sleep(Duration::from_millis(150)).await;
    let mut c2 = c.clone();
    c2.echo(req(b"meanwhile"))
        .await
        .expect("a call made after the GOAWAY goes on a new connection");
    slow.await
        .expect("task")
        .expect("the call in flight finishes on the old connection");
    assert!(
        connections.load(std::sync::atomic::Ordering::Relaxed) >= 2,
        "a new connection took the old one's place"
    );
    b.stop().await;
}
