//! Which endpoint gets the calls: even spread, slow and healed pods, endpoint changes, endpoints that never serve or die silently.

use super::*;

on_both_paths!(
    slow_pod_gets_under_one_percent_of_concurrent_calls,
    endpoint_changes_take_effect,
    a_call_in_flight_on_a_removed_endpoint_completes_there,
    listener_that_never_serves_gets_no_calls,
    healed_pod_gets_its_fair_share_back_within_5s_without_a_herd,
    an_endpoint_that_does_not_speak_http2_gets_no_calls,
    an_endpoint_whose_connections_die_young_is_reconnected_with_backoff,
    a_blackholed_pod_costs_no_call_after_the_first_second_and_returns_within_5s,
);

async fn slow_pod_gets_under_one_percent_of_concurrent_calls<P: DataPath>() {
    let pods = pods(5).await;
    pods[4].control.set_delay(Duration::from_millis(50));
    let b = balancer_on::<P>(Config::default(), endpoints(&pods)).await;
    let c = client(b.addr).await;
    let started = tokio::time::Instant::now();
    // Detection takes a few slow replies; the share is measured after it, as a long benchmark
    // run would see it (the detection burst is bounded separately below).
    let measure_from = started + Duration::from_millis(300);
    let stop_at = started + Duration::from_millis(1800);
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut names = Vec::new();
            loop {
                let sent = tokio::time::Instant::now();
                if sent >= stop_at {
                    break names;
                }
                let pod = c.echo(req(b"p")).await.expect("echo").into_inner().pod;
                names.push((sent >= measure_from, pod, sent.elapsed()));
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("task"));
    }
    let steady: Vec<String> = all
        .iter()
        .filter(|(m, _, _)| *m)
        .map(|(_, p, _)| p.clone())
        .collect();
    let detection: Vec<String> = all
        .iter()
        .filter(|(m, _, _)| !*m)
        .map(|(_, p, _)| p.clone())
        .collect();
    // What the calls took as the client saw them: the scenario is a 50 ms pod among fast ones,
    // and the picker degrades a pod only above twice its peers' latency. On a machine starved
    // of CPU the 32 callers' closed loop queues every call inside this one process (client,
    // balancer and pods), the other pods answer in tens of ms too, and the 50 ms pod is no
    // outlier (seen at load average 9-10: passing runs had the other pods at a median of
    // 40-60 ms, failing ones at 180-280 ms with the 50 ms pod at 290-440 ms, never degraded or
    // degraded late, some fast pod degraded instead).
    let median_ms = |slow: bool| {
        let mut took: Vec<Duration> = all
            .iter()
            .filter(|(m, p, _)| *m && (p == "pod-4") == slow)
            .map(|(_, _, took)| *took)
            .collect();
        took.sort_unstable();
        took.get(took.len() / 2)
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
    };
    let (peers_ms, slow_ms) = (median_ms(false), median_ms(true));
    let t = tally(&steady, 5);
    let share = t[4] as f64 / steady.len() as f64;
    let stats: Vec<_> = b
        .balancer
        .stats()
        .into_iter()
        .map(|s| (s.name, s.state, s.requests, s.probes))
        .collect();
    assert!(
        share < 0.01,
        "the 50 ms pod must get < 1% of calls: {t:?} ({:.2}%) {stats:?}; median call as the \
         client saw it: other pods {peers_ms:.1} ms, the 50 ms pod {slow_ms:.1} ms",
        share * 100.0
    );
    assert!(t[4] > 0, "the slow pod keeps a probe trickle: {t:?}");
    let burst = tally(&detection, 5)[4];
    assert!(
        burst <= 40,
        "detecting the slow pod costs a bounded burst: {burst} calls {stats:?}"
    );
    b.stop().await;
}

/// An endpoint leaves the Service (a scale-down: the pod still runs and finishes what it
/// has) while a call is in flight there: the call completes on it, and new calls go to the
/// endpoints that remain.
async fn a_call_in_flight_on_a_removed_endpoint_completes_there<P: DataPath>() {
    let pods = pods(2).await;
    pods[0].control.set_delay(Duration::from_millis(500));
    let b = balancer_on::<P>(Config::default(), endpoints(&pods[..1])).await;
    let mut c = client(b.addr).await;
    let call = {
        let mut c = c.clone();
        tokio::spawn(async move { c.echo(req(b"in flight")).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    b.endpoints.send_replace(endpoints(&pods[1..]));
    let reply = call
        .await
        .expect("task")
        .expect("the call in flight completes")
        .into_inner();
    assert_eq!(reply.pod, "pod-0");
    let next = c.echo(req(b"after")).await.expect("echo").into_inner();
    assert_eq!(
        next.pod, "pod-1",
        "new calls go to the endpoint that remains"
    );
    b.stop().await;
}

async fn endpoint_changes_take_effect<P: DataPath>() {
    let pods = pods(2).await;
    let b = balancer_on::<P>(Config::default(), endpoints(&pods[..1])).await;
    let mut c = client(b.addr).await;
    assert_eq!(
        c.echo(req(b"e")).await.expect("echo").into_inner().pod,
        "pod-0"
    );
    b.endpoints.send(endpoints(&pods[1..])).expect("publish");
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..10 {
        assert_eq!(
            c.echo(req(b"e")).await.expect("echo").into_inner().pod,
            "pod-1",
            "only the new set is used"
        );
    }
    let stats = b.balancer.stats();
    assert_eq!(
        stats.len(),
        1,
        "removed endpoints leave the stats: {stats:?}"
    );
    assert_eq!(stats[0].name, "pod-1");
    assert!(stats[0].requests >= 10, "{stats:?}");
    b.stop().await;
}

async fn listener_that_never_serves_gets_no_calls<P: DataPath>() {
    // A listener whose backlog accepts TCP but nobody serves HTTP/2 on it (a pod going away).
    let silent = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let silent_addr = silent.local_addr().expect("addr");
    let pods = pods(1).await;
    let mut eps = endpoints(&pods);
    eps.push(Endpoint::new(silent_addr, "silent"));
    let b = balancer_on::<P>(short_drain(), eps).await;
    let mut c = client(b.addr).await;
    for _ in 0..20 {
        let r = tokio::time::timeout(Duration::from_secs(2), c.echo(req(b"s")))
            .await
            .expect("no call hangs on the silent endpoint")
            .expect("every call succeeds");
        assert_eq!(r.into_inner().pod, "pod-0");
    }
    drop(silent);
    b.stop().await;
}

async fn healed_pod_gets_its_fair_share_back_within_5s_without_a_herd<P: DataPath>() {
    const PODS: usize = 5;
    let pods = pods(PODS).await;
    pods[4].control.set_delay(Duration::from_millis(50));
    let b = balancer_on::<P>(Config::default(), endpoints(&pods)).await;
    let c = client(b.addr).await;
    let started = tokio::time::Instant::now();
    // Bounded: 8 callers for at most 20 s (in practice ~1 s slow + 6 s healed).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (mut c, stop) = (c.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let give_up = started + Duration::from_secs(20);
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && tokio::time::Instant::now() < give_up
            {
                let sent = tokio::time::Instant::now();
                let pod = c.echo(req(b"h")).await.expect("echo").into_inner().pod;
                seen.push((sent, pod));
            }
            seen
        }));
    }
    // Slow until the balancer has taken it out of the rotation (a second or less; more when the
    // machine is so busy that every pod's latency is near 50 ms)...
    let deadline = started + Duration::from_secs(10);
    while b.balancer.stats()[4].state != skewless_balancer::EndpointState::Degraded {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the 50 ms pod is degraded within 10 s: {:?}",
            b.balancer.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let degraded_at = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // ... then healed; watched for 6 s in 1 s windows.
    let healed_at = tokio::time::Instant::now();
    pods[4].control.set_delay(Duration::ZERO);
    tokio::time::sleep(Duration::from_secs(6)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("task"));
    }
    let share = |from: tokio::time::Instant, to: tokio::time::Instant| {
        let names: Vec<String> = all
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|(_, p)| p.clone())
            .collect();
        let t = tally(&names, PODS);
        (t[4] as f64 / names.len().max(1) as f64, t)
    };
    let (_, t) = share(degraded_at, healed_at);
    assert!(
        t[4] <= 4,
        "while degraded it gets probes only, one per 200 ms: {t:?}"
    );
    let windows: Vec<(f64, Vec<usize>)> = (0..6)
        .map(|i| {
            let from = healed_at + Duration::from_secs(i);
            share(from, from + Duration::from_secs(1))
        })
        .collect();
    println!(
        "healed pod's share per 1 s window after healing (fair 0.20): {:?}",
        windows
            .iter()
            .map(|(s, _)| format!("{s:.3}"))
            .collect::<Vec<_>>()
    );
    // Generous bounds (a shared 2-core machine): fair is 20%. Seconds 2-5 together, not one
    // window: a single stalled reply (a busy machine) makes any pod's peak-EWMA estimate
    // jump, and that pod, healed or not, gets little for a second or so.
    let (back, t) = share(
        healed_at + Duration::from_secs(2),
        healed_at + Duration::from_secs(5),
    );
    assert!(
        back >= 0.10,
        "2-5 s after healing it is back near its fair share (>= 10%): {back:.3} {t:?} {:?}",
        b.balancer.stats()
    );
    for (i, (s, t)) in windows.iter().take(5).enumerate() {
        assert!(
            *s < 0.40,
            "no herd onto the healed pod: second {i} after healing it got {s:.2}: {t:?}"
        );
    }
    b.stop().await;
}

async fn an_endpoint_that_does_not_speak_http2_gets_no_calls<P: DataPath>() {
    // Accepts TCP and, after 200 ms, answers with bytes that are not HTTP/2 (an HTTP/1.1
    // server, say). A connection published before the server spoke would take calls for those
    // 200 ms and fail them when the garbage arrives.
    let (garbage, accepted) = support::counting_upstream(|mut stream| async move {
        use tokio::io::AsyncWriteExt as _;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let _ = stream
            .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    })
    .await;
    let pods = pods(2).await;
    let mut eps = endpoints(&pods);
    eps.push(Endpoint::new(garbage, "not-http2"));
    let b = balancer_on::<P>(Config::default(), eps).await;
    let mut c = client(b.addr).await;
    // Sequential calls for 600 ms (bounded: at most 20,000).
    let until = tokio::time::Instant::now() + Duration::from_millis(600);
    let mut n = 0u32;
    while tokio::time::Instant::now() < until && n < 20_000 {
        let pod = c
            .echo(req(&n.to_be_bytes()))
            .await
            .unwrap_or_else(|status| panic!("call {n} failed: {status}"))
            .into_inner()
            .pod;
        assert_ne!(pod, "not-http2");
        n += 1;
    }
    assert!(
        accepted.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "the balancer tried the endpoint"
    );
    let stats = b.balancer.stats();
    let broken = stats
        .iter()
        .find(|s| s.name == "not-http2")
        .expect("the endpoint is listed");
    assert_eq!(broken.requests, 0, "no call was sent to it: {broken:?}");
    b.stop().await;
}

/// An endpoint that answers the handshake and closes every connection at once (a server in
/// a crash loop): the balancer reconnects with a growing backoff, not in a tight loop, and the
/// calls go to the pod that serves.
async fn an_endpoint_whose_connections_die_young_is_reconnected_with_backoff<P: DataPath>() {
    use skewless_frame::{Setting, Settings};
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (addr, accepted) = support::counting_upstream(|mut stream| async move {
        let mut settings = Vec::new();
        Settings::encode(false, &[] as &[Setting], &mut settings);
        let _ = stream.write_all(&settings).await;
        // Read what the balancer sent, then close.
        let mut buf = [0u8; 1024];
        let _ = tokio::time::timeout(Duration::from_millis(20), stream.read(&mut buf)).await;
    })
    .await;
    let pods = pods(1).await;
    let mut eps = endpoints(&pods);
    eps.push(Endpoint::new(addr, "crashing"));
    let b = balancer_on::<P>(Config::default(), eps).await;
    let mut c = client(b.addr).await;
    // Calls for 1.5 s (bounded: 20,000).
    let until = tokio::time::Instant::now() + Duration::from_millis(1500);
    let mut n = 0;
    while tokio::time::Instant::now() < until && n < 20_000 {
        let reply = c.echo(req(b"c")).await.expect("the pod serves every call");
        assert_eq!(reply.into_inner().pod, "pod-0");
        n += 1;
    }
    let connects = accepted.load(Ordering::Relaxed);
    // 50 ms doubling: 50 + 100 + 200 + 400 + 800 ms, about 6 connects in 1.5 s.
    assert!(
        (2..=10).contains(&connects),
        "reconnects back off: {connects} connections in 1.5 s"
    );
    b.stop().await;
}

/// Issue 11 §1: five pods, one blackholed both ways while it stays listed, 50 calls in flight
/// with 2 s deadlines. Only calls sent to it in the first second may fail (the ones in flight,
/// and those sent before its connection was found suspect); it gets no call from then on until
/// it answers again, and is back in rotation within 5 s of answering.
async fn a_blackholed_pod_costs_no_call_after_the_first_second_and_returns_within_5s<
    P: DataPath,
>() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::time::Instant;
    const PODS: usize = 5;
    const IN_FLIGHT: usize = 50;
    let pods = pods(PODS).await;
    let mut eps = Vec::new();
    let mut darks = Vec::new();
    for p in &pods {
        let (addr, dark) = support::blackholable(p.addr).await;
        eps.push(Endpoint::new(addr, &p.name));
        darks.push(dark);
    }
    let b = balancer_on::<P>(Config::default(), eps).await;
    let c = client(b.addr).await;
    let started = Instant::now();
    // Bounded: 50 callers for at most 30 s (in practice ~14 s).
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..IN_FLIGHT {
        let (mut c, stop) = (c.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut calls = Vec::new();
            let give_up = started + Duration::from_secs(30);
            while !stop.load(Ordering::Relaxed) && Instant::now() < give_up {
                let sent = Instant::now();
                let mut r = tonic::Request::new(req(b"b"));
                r.set_timeout(Duration::from_secs(2));
                let result = c.echo(r).await.map(|r| r.into_inner().pod);
                calls.push((sent, Instant::now(), result));
            }
            calls
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let dark_at = Instant::now();
    darks[4].send_replace(true);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let requests_at_1s = b.balancer.stats()[4].requests;
    tokio::time::sleep(Duration::from_secs(7)).await;
    let stats_before_lift = b.balancer.stats();
    let lit_at = Instant::now();
    darks[4].send_replace(false);
    // Back: in rotation again (not ejected, not degraded) within 5 s of answering.
    let back_at = loop {
        let s = &b.balancer.stats()[4];
        if s.state == skewless_balancer::EndpointState::Active {
            break Instant::now();
        }
        assert!(
            lit_at.elapsed() < Duration::from_secs(5),
            "the pod is back within 5 s of answering again: {:?}",
            b.balancer.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let mut calls = Vec::new();
    for t in tasks {
        calls.extend(t.await.expect("caller"));
    }
    // Seconds since the blackhole began (negative: before).
    let at = |t: Instant| {
        t.saturating_duration_since(dark_at).as_secs_f64()
            - dark_at.saturating_duration_since(t).as_secs_f64()
    };
    let failed: Vec<_> = calls
        .iter()
        .filter_map(|(sent, ended, r)| r.as_ref().err().map(|s| (at(*sent), at(*ended), s)))
        .collect();
    let after_first_second = dark_at + Duration::from_secs(1);
    let late: Vec<_> = calls
        .iter()
        .filter(|(sent, _, r)| *sent >= after_first_second && r.is_err())
        .map(|(sent, ended, r)| (at(*sent), at(*ended), r.as_ref().err()))
        .collect();
    let served_by_4 = |from: Instant, to: Instant| {
        calls
            .iter()
            .filter(|(_, ended, r)| {
                *ended >= from && *ended < to && r.as_ref().is_ok_and(|p| p == "pod-4")
            })
            .count()
    };
    println!(
        "{} calls; {} failed, all sent within {:.2} s of the blackhole; pod-4 back {:.2} s after \
         answering, {} of its calls in the last 2 s",
        calls.len(),
        failed.len(),
        failed.iter().map(|f| f.0).fold(0.0, f64::max),
        (back_at - lit_at).as_secs_f64(),
        served_by_4(back_at, back_at + Duration::from_secs(2)),
    );
    assert!(
        failed.iter().all(|(_, ended, _)| *ended >= 0.0),
        "nothing fails before the blackhole: {failed:?}"
    );
    assert!(
        late.is_empty(),
        "no call sent after the first second of the blackhole fails: {} of them: {:?}",
        late.len(),
        &late[..late.len().min(10)]
    );
    assert_eq!(
        stats_before_lift[4].requests, requests_at_1s,
        "no call goes to the blackholed pod after the first second, until it answers: {stats_before_lift:?}"
    );
    assert!(
        served_by_4(back_at, back_at + Duration::from_secs(2)) > 0,
        "once back in rotation it serves calls again"
    );
    assert!(
        failed
            .iter()
            .all(|(_, _, s)| s.code() != tonic::Code::Internal),
        "calls the dead connection had not answered end UNAVAILABLE (or at their deadlines), \
         not INTERNAL: {failed:?}"
    );
    b.stop().await;
}
