//! Settling: the final GOAWAY waits until the client has shown it has no stream left to write.

use super::*;

/// The backend answers streams 1 and 3; both reach the client, then FIN both ways (the
/// backend got nothing more: no GOAWAY, none of our ACKs) and the rotation's end.
async fn finish_1_and_3(mut b: Bed, reason: RotationReason) {
    b.backend.send(&response(1)).await;
    b.backend.send(&response(3)).await;
    expect_response(&mut b.client, 1).await;
    expect_response(&mut b.client, 3).await;
    let end = b.ends_cleanly().await;
    assert_eq!(end, RelayEnd::Rotated(reason));
}

/// Stream 3's request, created by the client before it read the first GOAWAY.
fn stream_3() -> Vec<u8> {
    let mut req = headers(3, flags::END_HEADERS);
    req.extend(frame(
        Kind::Data,
        flags::END_STREAM,
        3,
        b"created before the GOAWAY",
    ));
    req
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stream_the_client_writes_after_its_ping_ack_is_relayed_and_under_the_final_goaway() {
    // grpc-core writes a PING ACK ahead of the streams queued in the same write: a stream it
    // created before it read GOAWAY(2^31-1) can reach the relay after the ACK, in a later
    // read. The final GOAWAY must not be below it (the client would fail or retry a call it
    // had sent: grpc-core fails one larger than its 256 KiB retry buffer).
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::MaxAge);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
    // The relay acts on the ACK before the rest of the client's write arrives.
    tokio::time::sleep(Duration::from_millis(1)).await;
    let mut late = headers(3, flags::END_HEADERS);
    late.extend(frame(
        Kind::Data,
        flags::END_STREAM,
        3,
        b"sent before the GOAWAY",
    ));
    b.client.send(&late).await;
    let (h, _) = b.backend.expect(Kind::Headers).await;
    assert_eq!(h.stream_id, 3);
    let (d, _) = b.backend.expect(Kind::Data).await;
    assert_eq!(
        d.stream_id, 3,
        "stream 3 is relayed to the backend, not cancelled"
    );
    assert_eq!(
        settle_until_the_final_go_away(&mut b.client).await,
        3,
        "the final GOAWAY covers every stream the client sent"
    );
    assert_eq!(b.handle.stats().refused(), 0);
    assert_eq!(b.handle.stats().requests(), 2);
    b.backend.send(&response(1)).await;
    b.backend.send(&response(3)).await;
    expect_response(&mut b.client, 1).await;
    expect_response(&mut b.client, 3).await;
    let end = b.ends_cleanly().await;
    assert_eq!(end, RelayEnd::Rotated(RotationReason::MaxAge));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stream_the_client_writes_after_the_settings_ack_is_still_under_the_final_goaway() {
    // A stream that comes between the SETTINGS ACK and the quiet PING's ACK (a client that
    // writes them apart): the check starts over and the final GOAWAY covers it.
    let mut b = open_bed(RelaySettings::default()).await;
    rotate_and_ack(&mut b, RotationReason::MaxAge).await;
    b.client.expect(Kind::Settings).await;
    b.client.send(&settings_ack()).await;
    let quiet = b.client.expect_ping().await;
    assert_eq!(quiet.opaque, QUIET_PING);
    b.client.send(&stream_3()).await;
    b.backend.expect(Kind::Headers).await;
    let (d, _) = b.backend.expect(Kind::Data).await;
    assert_eq!(
        d.stream_id, 3,
        "stream 3 is relayed to the backend, not cancelled"
    );
    b.client.send(&ping(true, quiet.opaque)).await;
    assert_eq!(
        settle_until_the_final_go_away(&mut b.client).await,
        3,
        "the final GOAWAY covers every stream the client sent"
    );
    assert_eq!(b.handle.stats().refused(), 0);
    finish_1_and_3(b, RotationReason::MaxAge).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stream_grpc_core_queues_behind_its_ping_acks_is_under_the_final_goaway() {
    // grpc-core writes a stream's frames only in a write with no PING ACK in it. Stream 3 was
    // created before the client read GOAWAY(2^31-1); the client answers every PING at once,
    // each ACK in a write of its own, so however many PINGs the relay sends, stream 3 stays
    // unwritten; only a write without an ACK (the SETTINGS ACK's) carries it. A final GOAWAY
    // before that names 1 and fails the call (a 4 MiB one, beyond the 256 KiB retry buffer).
    let mut b = open_bed(RelaySettings::default()).await;
    rotate_and_ack(&mut b, RotationReason::MaxAge).await;
    assert_eq!(
        settle_as_grpc_core(&mut b.client, stream_3()).await,
        3,
        "the final GOAWAY covers the stream the client had queued"
    );
    let (h, _) = b.backend.expect(Kind::Headers).await;
    assert_eq!(h.stream_id, 3, "stream 3 is relayed to the backend");
    b.backend.expect(Kind::Data).await;
    assert_eq!(b.handle.stats().refused(), 0);
    finish_1_and_3(b, RotationReason::MaxAge).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_settings_ack_written_with_a_ping_ack_proves_nothing_and_the_check_starts_over() {
    // The client reads the backend's PING and our SETTINGS before it writes: grpc-core puts
    // both ACKs in one write, cut to the ACKs, and stream 3 stays queued. That SETTINGS ACK
    // must not count: the relay asks again.
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::MaxAge);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.backend.send(&ping(false, *b"backend!")).await;
    assert_eq!(b.client.expect_ping().await.opaque, *b"backend!");
    b.client.send(&ping(true, ours.opaque)).await;
    b.client.expect(Kind::Settings).await;
    let mut write = ping(true, *b"backend!");
    write.extend(settings_ack());
    b.client.send(&write).await;
    let ack = b.backend.expect_ping().await;
    assert_eq!((ack.ack, ack.opaque), (true, *b"backend!"), "forwarded");
    assert_eq!(
        settle_as_grpc_core(&mut b.client, stream_3()).await,
        3,
        "the final GOAWAY covers the stream the client had queued"
    );
    assert_eq!(b.handle.stats().refused(), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_relays_settings_ack_is_swallowed_and_the_backends_are_forwarded_in_order() {
    // The backend sends SETTINGS mid-rotation, just before ours: the client acknowledges in
    // the order it read them. Its first ACK is the backend's (forwarded at once), the second
    // ours (swallowed: an unsolicited ACK is a connection error for the backend).
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::MaxAge);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.backend.send(&empty_settings()).await;
    let (head, _) = b.client.expect(Kind::Settings).await;
    assert!(!head.has(flags::ACK), "the backend's SETTINGS");
    b.client.send(&ping(true, ours.opaque)).await;
    let (head, _) = b.client.expect(Kind::Settings).await;
    assert!(!head.has(flags::ACK), "the relay's SETTINGS");
    b.client.send(&settings_ack()).await;
    let (ack, _) = b.backend.expect(Kind::Settings).await;
    assert!(
        ack.has(flags::ACK),
        "the first ACK answers the backend's SETTINGS"
    );
    b.client.expect_silence().await;
    b.client.send(&settings_ack()).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    b.client.expect_eof().await;
    b.backend.expect_eof().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_final_goaway_waits_for_the_client_to_end_its_streams_at_most_half_the_grace() {
    let settings = RelaySettings {
        drain_grace: Duration::from_secs(16),
        ..RelaySettings::default()
    };
    let mut b = open_bed(settings).await;
    // Stream 3: the client is still sending its request.
    b.client.send(&headers(3, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    let started = Instant::now();
    b.handle.rotate(RotationReason::Skew);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
    b.client.expect_silence().await;
    // The request ends: now the relay checks the client is quiet.
    b.client
        .send(&frame(Kind::Data, flags::END_STREAM, 3, b"end"))
        .await;
    b.backend.expect(Kind::Data).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 3);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "as soon as it is quiet"
    );

    // A client that never goes quiet (a request body that never ends).
    let mut b = open_bed(RelaySettings {
        drain_grace: Duration::from_secs(16),
        ..RelaySettings::default()
    })
    .await;
    b.client.send(&headers(3, flags::END_HEADERS)).await;
    b.backend.expect(Kind::Headers).await;
    let started = Instant::now();
    b.handle.rotate(RotationReason::Skew);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(b.client.expect_go_away().await, 3);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(8) && waited < Duration::from_secs(9),
        "the final GOAWAY comes halfway through the 16 s grace: {waited:?}"
    );
}
