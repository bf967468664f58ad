//! Hostile and broken clients: malformed frames, floods, too many streams, no preface.

use super::*;

async fn broken(bytes: &[u8]) -> RelayError {
    let mut b = bed(RelaySettings::default());
    b.client.send(bytes).await;
    let err = b
        .task
        .await
        .expect("task")
        .expect_err("the connection is refused");
    // Both sides are closed with FIN.
    let mut rest = Vec::new();
    b.backend
        .io
        .read_to_end(&mut rest)
        .await
        .expect("backend EOF");
    b.client
        .io
        .read_to_end(&mut rest)
        .await
        .expect("client EOF");
    err
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn malformed_frames_and_non_http2_clients_close_their_connection() {
    let err = broken(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::Frame(FrameError::BadPreface))
        ),
        "{err:?}"
    );
    assert!(err.is_client());

    let mut big = PREFACE.to_vec();
    big.extend(empty_settings());
    big.extend(Head::new(Kind::Data, 0, 1, 16_385).encode());
    let err = broken(&big).await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::Frame(FrameError::TooLarge { .. }))
        ),
        "a frame above the backend's advertised SETTINGS_MAX_FRAME_SIZE: {err:?}"
    );

    let mut bad_ping = PREFACE.to_vec();
    bad_ping.extend(frame(Kind::Ping, 0, 0, &[0; 3]));
    let err = broken(&bad_ping).await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::Frame(FrameError::BadLength { .. }))
        ),
        "{err:?}"
    );

    // A GOAWAY shorter than its 8 fixed bytes (found by the property test below: it used to
    // panic the relay's task).
    let mut short_go_away = PREFACE.to_vec();
    short_go_away.extend(frame(Kind::GoAway, 0, 0, &[0; 5]));
    let err = broken(&short_go_away).await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::Frame(FrameError::BadLength { .. }))
        ),
        "{err:?}"
    );

    let mut interleaved = PREFACE.to_vec();
    interleaved.extend(empty_settings());
    interleaved.extend(headers(1, 0));
    interleaved.extend(frame(Kind::Data, 0, 1, b"x"));
    let err = broken(&interleaved).await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::InsideHeaderBlock { .. })
        ),
        "{err:?}"
    );
}

/// Runs the relay between two peers that send `client` (after the preface) and `backend`,
/// rotating after the first `rotate_after` client bytes when set, and reading everything the
/// relay sends; returns how it ended (`None`: with an error), within a bounded (paused) time.
fn run_hostile(client: &[u8], backend: &[u8], rotate_after: Option<usize>) -> Option<RelayEnd> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    rt.block_on(async {
        let b = bed(RelaySettings::default());
        let (c_read, mut c_write) = tokio::io::split(b.client.io);
        let (b_read, mut b_write) = tokio::io::split(b.backend.io);
        let handle = b.handle;
        let client_side = async {
            let _ = c_write.write_all(PREFACE).await;
            let cut = rotate_after.unwrap_or(client.len()).min(client.len());
            let _ = c_write.write_all(&client[..cut]).await;
            if rotate_after.is_some() {
                handle.rotate(RotationReason::Skew);
            }
            let _ = c_write.write_all(&client[cut..]).await;
            let _ = c_write.shutdown().await;
        };
        let backend_side = async {
            let _ = b_write.write_all(backend).await;
            let _ = b_write.shutdown().await;
        };
        let drain = |mut r: tokio::io::ReadHalf<DuplexStream>| async move {
            let mut sink = Vec::new();
            let _ = r.read_to_end(&mut sink).await;
        };
        let ((), (), (), (), end) = tokio::join!(
            client_side,
            backend_side,
            drain(c_read),
            drain(b_read),
            tokio::time::timeout(Duration::from_secs(120), b.task),
        );
        end.expect("the relay always ends")
            .expect("the relay never panics")
            .ok()
    })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    #[test]
    fn any_bytes_from_either_peer_end_the_relay_without_a_panic(
        client in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
        backend in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
        rotate_after in proptest::option::of(0usize..400),
    ) {
        let _ = run_hostile(&client, &backend, rotate_after);
    }

    #[test]
    fn any_frames_from_either_peer_end_the_relay_without_a_panic(
        client in proptest::collection::vec((0u8..12, proptest::prelude::any::<u8>(), 0u32..8, proptest::collection::vec(proptest::prelude::any::<u8>(), 0..24)), 0..24),
        backend in proptest::collection::vec((0u8..12, proptest::prelude::any::<u8>(), 0u32..8, proptest::collection::vec(proptest::prelude::any::<u8>(), 0..24)), 0..24),
        rotate_after in proptest::option::of(0usize..600),
    ) {
        // Valid framing, arbitrary types, flags, streams and payloads: the frame rules are
        // exercised, not only the framing check.
        let wire = |frames: &[(u8, u8, u32, Vec<u8>)]| -> Vec<u8> {
            let mut w = empty_settings();
            for (kind, fl, stream, payload) in frames {
                w.extend(frame(Kind::from(*kind), *fl, *stream, payload));
            }
            w
        };
        let _ = run_hostile(&wire(&client), &wire(&backend), rotate_after);
    }
}

/// Sends `bytes` from the client after [`open_bed`] while both peers read what they get;
/// the relay's error, how many frames of `kind` reached the backend, and the client's last
/// frame (which must be the GOAWAY the relay ended with).
async fn hostile(bytes: Vec<u8>, kind: Kind) -> (RelayError, usize, GoAway<'static>, RelayHandle) {
    let Bed {
        client,
        backend,
        handle,
        task,
    } = open_bed(RelaySettings::default()).await;
    let Peer { io, buf } = client;
    let (mut read, mut write) = tokio::io::split(io);
    // The relay stops reading mid-flood: the rest of the write may fail.
    let writer = tokio::spawn(async move {
        let _ = write.write_all(&bytes).await;
        write
    });
    let backend = tokio::spawn(drain(backend, kind));
    let mut rest = buf.to_vec();
    tokio::time::timeout(STUCK, read.read_to_end(&mut rest))
        .await
        .expect("the relay is stuck")
        .expect("client EOF");
    let err = task
        .await
        .expect("task")
        .expect_err("the client is cut off");
    let (forwarded, _) = backend.await.expect("backend reader");
    drop(writer.await.expect("writer"));
    let frames: Vec<_> = Frames::new(&rest, MAX_MAX_FRAME_SIZE)
        .map(|f| f.expect("whole frames to the client"))
        .map(|(h, p)| (h, p.to_vec()))
        .collect();
    let (head, payload) = frames.last().expect("a GOAWAY before the FIN").clone();
    let g = GoAway::decode(&head, &payload).expect("the last frame is a GOAWAY");
    let g = GoAway {
        last_stream_id: g.last_stream_id,
        error_code: g.error_code,
        debug_data: b"",
    };
    (err, forwarded, g, handle)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn ping_settings_and_rst_stream_floods_are_cut_off_at_their_budget_with_enhance_your_calm() {
    // The budgets (request mode's): 1,000 PINGs, 100 SETTINGS (the client's first included),
    // 10,000 RST_STREAMs; acks and other frames are free. Time stands still (paused), so
    // nothing refills: exactly the burst is relayed, the next frame cuts the client off.
    let pings: Vec<u8> = (0..5_000).flat_map(|_| ping(false, [7; 8])).collect();
    let settings: Vec<u8> = (0..5_000).flat_map(|_| empty_settings()).collect();
    let resets: Vec<u8> = (0..50_000)
        .flat_map(|_| rst(1, ErrorCode::CANCEL))
        .collect();
    for (bytes, kind, flood, relayed) in [
        (pings, Kind::Ping, Flood::Ping, 1_000),
        (settings, Kind::Settings, Flood::Settings, 99),
        (resets, Kind::RstStream, Flood::RstStream, 10_000),
    ] {
        let (err, forwarded, go_away, _) = hostile(bytes, kind).await;
        assert!(
            matches!(err, RelayError::ClientProtocol(ProtocolError::Flood(f)) if f == flood),
            "{err:?}"
        );
        assert_eq!(
            forwarded, relayed,
            "{kind:?}: the budget is relayed, no more"
        );
        assert_eq!(go_away.error_code, ErrorCode::ENHANCE_YOUR_CALM);
        assert_eq!(
            go_away.last_stream_id, 1,
            "the one stream the client opened"
        );
    }
    // Acks cost nothing: 5,000 PING ACKs and SETTINGS ACKs pass.
    let Bed {
        mut client,
        backend,
        task,
        ..
    } = open_bed(RelaySettings::default()).await;
    let backend = tokio::spawn(drain(backend, Kind::Ping));
    let mut acks = Vec::new();
    for _ in 0..5_000 {
        acks.extend(ping(true, [7; 8]));
        Settings::encode(true, &[], &mut acks);
    }
    client.send(&acks).await;
    client.io.shutdown().await.expect("shutdown");
    client.expect_eof().await;
    assert_eq!(backend.await.expect("backend").0, 5_000);
    task.await.expect("task").expect("acks are no flood");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn rapid_reset_is_cut_off_by_the_rst_stream_budget_and_never_holds_streams() {
    // HEADERS then RST_STREAM on 100,000 new streams (CVE-2023-44487's shape).
    let mut bytes = Vec::new();
    for i in 0..100_000u32 {
        let id = 3 + 2 * i;
        bytes.extend(headers(id, flags::END_HEADERS));
        bytes.extend(rst(id, ErrorCode::CANCEL));
    }
    let (err, forwarded, go_away, handle) = hostile(bytes, Kind::Headers).await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::Flood(Flood::RstStream))
        ),
        "{err:?}"
    );
    assert_eq!(
        forwarded, 10_001,
        "10,000 reset streams, and the HEADERS of the one whose reset trips the budget"
    );
    assert_eq!(go_away.error_code, ErrorCode::ENHANCE_YOUR_CALM);
    assert_eq!(
        handle.stats().requests(),
        10_002,
        "stream 1 and the reset ones"
    );
    assert_eq!(handle.stats().open_streams(), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_hundred_thousand_open_streams_are_cut_off_at_max_streams() {
    // A backend that never answers and a client that opens 100,000 streams: the relay tracks
    // `max_streams` (8,192, stream 1 included) and closes the connection at the next one.
    let bytes: Vec<u8> = (0..100_000u32)
        .flat_map(|i| headers(3 + 2 * i, flags::END_HEADERS))
        .collect();
    let (err, forwarded, go_away, handle) = hostile(bytes, Kind::Headers).await;
    assert!(
        matches!(
            err,
            RelayError::ClientProtocol(ProtocolError::TooManyStreams { max: 8192 })
        ),
        "{err:?}"
    );
    assert_eq!(forwarded, 8_191, "the streams tracked besides stream 1");
    assert_eq!(go_away.error_code, ErrorCode::ENHANCE_YOUR_CALM);
    assert_eq!(handle.stats().requests(), 8_192);
    assert_eq!(handle.stats().open_streams(), 0, "abandoned at the close");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_client_that_sends_no_preface_is_closed_after_the_handshake_timeout() {
    for sent in [&b""[..], &PREFACE[..12], &PREFACE[..]] {
        let mut b = bed(RelaySettings::default());
        let t0 = Instant::now();
        b.client.send(sent).await;
        let mut rest = Vec::new();
        tokio::time::timeout(STUCK, b.client.io.read_to_end(&mut rest))
            .await
            .expect("the relay never closes the silent client")
            .expect("client EOF");
        let waited = t0.elapsed();
        assert!(
            waited >= Duration::from_secs(10) && waited < Duration::from_millis(10_100),
            "closed at the 10 s handshake timeout, after {waited:?}"
        );
        assert!(
            rest.is_empty(),
            "no GOAWAY to a client that never spoke HTTP/2"
        );
        b.backend
            .io
            .read_to_end(&mut rest)
            .await
            .expect("backend EOF");
        drop(b.client);
        let err = b.task.await.expect("task").expect_err("closed");
        assert!(
            matches!(err, RelayError::ClientProtocol(ProtocolError::NoPreface(_))),
            "{} preface bytes: {err:?}",
            sent.len()
        );
        assert!(err.is_client());
    }

    // A slow but complete handshake is no offence.
    let mut b = bed(RelaySettings::default());
    tokio::time::sleep(Duration::from_secs(9)).await;
    client_hello(&mut b).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    b.client.send(&headers(1, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    assert!(!b.task.is_finished(), "still relaying after the timeout");
}
