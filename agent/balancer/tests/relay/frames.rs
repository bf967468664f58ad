//! What the relay does to the frames and streams it carries: header blocks, frame sizes, stream ends and resets, their timing, and how a relayed connection closes.

use super::*;

/// [`open_bed`] whose relay records into a Service's cells, returned with it.
async fn open_metered_bed(settings: RelaySettings) -> (Bed, Arc<ServiceMetrics>) {
    let metrics = Arc::new(ServiceMetrics::default());
    let b = open_bed_with(settings, RelayHandle::with_metrics(metrics.clone())).await;
    (b, metrics)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn nothing_is_injected_inside_a_header_block() {
    let mut b = open_bed(RelaySettings::default()).await;
    // Response headers split over HEADERS and CONTINUATION.
    b.backend.send(&headers(1, 0)).await;
    b.client.expect(Kind::Headers).await;
    b.handle.rotate(RotationReason::Skew);
    b.client.expect_silence().await;
    b.backend
        .send(&frame(Kind::Continuation, flags::END_HEADERS, 1, &[0x88]))
        .await;
    b.client.expect(Kind::Continuation).await;
    assert_eq!(
        b.client.expect_go_away().await,
        MAX_STREAM_ID,
        "only after the block"
    );
    b.client.expect_ping().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn at_the_end_of_the_drain_grace_open_streams_are_reset_both_ways_then_fin() {
    let settings = RelaySettings {
        drain_grace: Duration::from_secs(12),
        ..RelaySettings::default()
    };
    let (mut b, metrics) = open_metered_bed(settings).await;
    let started = Instant::now();
    b.handle.rotate(RotationReason::Drain);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    // The backend never answers stream 1.
    let rst = b.client.expect_rst().await;
    assert_eq!((rst.stream_id, rst.error_code), (1, ErrorCode::CANCEL));
    assert!(
        started.elapsed() >= Duration::from_secs(12),
        "not before the grace"
    );
    let rst = b.backend.expect_rst().await;
    assert_eq!((rst.stream_id, rst.error_code), (1, ErrorCode::CANCEL));
    let end = b.ends_cleanly().await;
    assert_eq!(end, RelayEnd::GraceExpired { reset: 1 });
    let s = metrics.snapshot();
    assert_eq!(s.latency.count(), 1, "the cut stream is timed");
    assert_eq!(s.failures, [0, 0, 1, 0, 0, 0], "and a failed call (reset)");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn end_stream_both_ways_and_resets_close_streams() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    assert_eq!(b.handle.stats().open_streams(), 0, "END_STREAM both ways");
    b.client.send(&headers(3, flags::END_HEADERS)).await;
    b.client.send(&headers(5, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    b.backend.expect(Kind::Headers).await;
    assert_eq!(
        (b.handle.stats().requests(), b.handle.stats().open_streams()),
        (3, 2)
    );
    let mut rst = Vec::new();
    RstStream {
        stream_id: 3,
        error_code: ErrorCode::CANCEL,
    }
    .encode(&mut rst);
    b.client.send(&rst).await;
    b.backend.expect_rst().await;
    assert_eq!(
        b.handle.stats().open_streams(),
        1,
        "a client reset closes the stream"
    );
    rst.clear();
    RstStream {
        stream_id: 5,
        error_code: ErrorCode::INTERNAL_ERROR,
    }
    .encode(&mut rst);
    b.backend.send(&rst).await;
    b.client.expect_rst().await;
    assert_eq!(
        b.handle.stats().open_streams(),
        0,
        "a backend reset closes the stream"
    );
    // A client that closes: FIN goes on to the backend, and back.
    b.client.io.shutdown().await.expect("shutdown");
    b.backend.expect_eof().await;
    b.backend.io.shutdown().await.expect("shutdown");
    b.client.expect_eof().await;
    assert_eq!(
        b.task.await.expect("task").expect("clean end"),
        RelayEnd::Closed
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn frames_up_to_the_advertised_max_frame_size_pass() {
    let mut b = open_bed(RelaySettings::default()).await;
    // The backend allows 1 MiB frames: a 100 KB DATA frame (larger than the relay's buffer)
    // streams through.
    let mut s = Vec::new();
    Settings::encode(
        false,
        &[skewless_frame::Setting {
            id: skewless_frame::SettingId::MAX_FRAME_SIZE,
            value: 1 << 20,
        }],
        &mut s,
    );
    b.backend.send(&s).await;
    b.client.expect(Kind::Settings).await;
    b.client.send(&headers(3, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    let body: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
    let big = frame(Kind::Data, 0, 3, &body);
    let writer = async {
        b.client.send(&big).await;
    };
    let reader = async {
        let (head, payload) = b.backend.expect(Kind::Data).await;
        assert_eq!(head.len, 100_000);
        assert_eq!(payload, body, "the payload is forwarded byte for byte");
    };
    tokio::join!(writer, reader);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_peer_that_never_follows_a_close_is_dropped_after_the_drain_grace() {
    let settings = RelaySettings {
        drain_grace: Duration::from_secs(9),
        ..RelaySettings::default()
    };
    let mut b = open_bed(settings).await;
    let started = Instant::now();
    b.client.io.shutdown().await.expect("shutdown");
    b.backend.expect_eof().await;
    // The backend keeps its side open and never answers.
    let end = tokio::time::timeout(STUCK, b.task)
        .await
        .expect("the relay ends")
        .expect("task")
        .expect("clean end");
    assert_eq!(end, RelayEnd::Closed);
    assert!(
        started.elapsed() >= Duration::from_secs(9),
        "not before the grace"
    );
    b.client.expect_eof().await;
}

/// In a balancer the relay records every stream into the Service's cells: its duration from
/// the client's HEADERS to its end both ways (or its reset), and a reset or refusal by the
/// backend as a failed call; a client's cancellation is no failure.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn streams_are_timed_from_headers_to_their_end_and_backend_resets_are_failures() {
    let (mut b, metrics) = open_metered_bed(RelaySettings::default()).await;
    tokio::time::advance(Duration::from_millis(30)).await;
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    let s = metrics.snapshot();
    assert_eq!(s.latency.count(), 1, "stream 1 is over");
    let bucket = LATENCY_BOUNDS.iter().position(|b| *b == 0.05).unwrap();
    assert_eq!(s.latency.counts[bucket], 1, "30 ms: the (25, 50] ms bucket");

    b.client
        .send(&headers(3, flags::END_HEADERS | flags::END_STREAM))
        .await;
    b.backend.expect(Kind::Headers).await;
    b.backend.send(&rst(3, ErrorCode::REFUSED_STREAM)).await;
    assert_eq!(
        b.client.expect_rst().await.error_code,
        ErrorCode::REFUSED_STREAM
    );

    b.client.send(&headers(5, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    b.backend.send(&rst(5, ErrorCode::INTERNAL_ERROR)).await;
    b.client.expect_rst().await;

    b.client.send(&headers(7, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    b.client.send(&rst(7, ErrorCode::CANCEL)).await;
    b.backend.expect_rst().await;

    let s = metrics.snapshot();
    assert_eq!(s.latency.count(), 4, "every stream is timed once");
    let failed =
        |r: FailureReason| s.failures[FailureReason::ALL.iter().position(|x| *x == r).unwrap()];
    assert_eq!(failed(FailureReason::Refused), 1, "{:?}", s.failures);
    assert_eq!(failed(FailureReason::Reset), 1, "{:?}", s.failures);
    assert_eq!(
        s.failures.iter().sum::<u64>(),
        2,
        "the cancel is no failure"
    );
    assert_eq!(b.handle.stats().open_streams(), 0);
}

/// Streams still open when the relay ends are over too: lost with the backend (it closed
/// first) they are failed calls (`connect`, as in request mode); abandoned by the client
/// they are timed but no failure.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn streams_open_when_the_backend_closes_fail_and_those_the_client_leaves_do_not() {
    let (mut b, metrics) = open_metered_bed(RelaySettings::default()).await;
    b.backend.io.shutdown().await.expect("shutdown");
    b.client.expect_eof().await;
    b.client.io.shutdown().await.expect("shutdown");
    b.backend.expect_eof().await;
    assert_eq!(
        b.task.await.expect("task").expect("clean end"),
        RelayEnd::Closed
    );
    let s = metrics.snapshot();
    assert_eq!(s.latency.count(), 1, "stream 1 is over");
    let connect = FailureReason::ALL
        .iter()
        .position(|r| *r == FailureReason::Connect)
        .unwrap();
    assert_eq!(s.failures[connect], 1, "{:?}", s.failures);
    assert_eq!(s.failures.iter().sum::<u64>(), 1, "{:?}", s.failures);

    let (mut b, metrics) = open_metered_bed(RelaySettings::default()).await;
    b.client.io.shutdown().await.expect("shutdown");
    b.backend.expect_eof().await;
    b.backend.io.shutdown().await.expect("shutdown");
    b.client.expect_eof().await;
    b.task.await.expect("task").expect("clean end");
    let s = metrics.snapshot();
    assert_eq!(s.latency.count(), 1, "stream 1 is over");
    assert_eq!(s.failures, [0; 6], "the client left: no failure");
}

/// A backend that closes its socket right after its last response, while the client reads
/// that response slowly (the 4 MiB grpc-js call of the rotation stress: an h2 backend closes
/// once its last stream has ended when it has received a GOAWAY, and Node's http2 sends one
/// as it closes on the rotation's first GOAWAY). The client's WINDOW_UPDATEs for the rest of
/// the response then meet a closed socket (a reset, on a real one) while the relay still
/// holds that rest. It must still reach the client, whole, then FIN: the call is not lost.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_response_the_backend_sent_before_closing_reaches_a_slow_client_whole_then_fin() {
    let (mut b, metrics) = open_metered_bed(RelaySettings::default()).await;
    rotate_and_ack(&mut b, RotationReason::MaxAge).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    // 1.5 MiB of DATA: more than the client's socket and the relay's buffer hold, so the
    // rest waits in the backend's socket while the client reads nothing.
    let chunk = vec![7u8; 16 * 1024];
    let frames = 96;
    let mut response = headers(1, flags::END_HEADERS);
    for _ in 0..frames {
        response.extend(frame(Kind::Data, 0, 1, &chunk));
    }
    response.extend(headers(1, flags::END_HEADERS | flags::END_STREAM));
    b.backend.send(&response).await;
    let Bed {
        mut client,
        backend,
        task,
        ..
    } = b;
    drop(backend);
    // The client grants the window its reads free; the relay's write of it fails.
    let mut update = Vec::new();
    WindowUpdate {
        stream_id: 0,
        increment: 1 << 20,
    }
    .encode(&mut update);
    client.send(&update).await;
    tokio::time::sleep(Duration::from_millis(1)).await;
    client.expect(Kind::Headers).await;
    let mut data = 0;
    loop {
        let (head, payload) = client
            .next()
            .await
            .unwrap_or_else(|| panic!("EOF after {data} bytes of DATA, before the trailers"));
        match head.kind {
            Kind::Data => data += payload.len(),
            Kind::Headers => {
                assert!(head.is_end_stream(), "the trailers end the stream");
                break;
            }
            _ => panic!("expected DATA or the trailers, got {head:?}"),
        }
    }
    assert_eq!(
        data,
        frames * chunk.len(),
        "every byte of the response arrives"
    );
    client.expect_eof().await;
    client.io.shutdown().await.expect("shutdown");
    let end = task.await.expect("task").expect("a clean end");
    assert_eq!(
        end,
        RelayEnd::Rotated(RotationReason::MaxAge),
        "the backend closed first, with every stream done: the rotation's end"
    );
    let s = metrics.snapshot();
    assert_eq!(s.latency.count(), 1, "stream 1 is over");
    assert_eq!(s.failures, [0; 6], "and did not fail");
}
