//! A rotation on the wire: the two GOAWAYs and their PINGs, the quiesce of lazy clients, refused streams, GOAWAYs from either side.

use super::*;

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn rotation_is_goaway_max_and_ping_then_settings_and_a_quiet_ping_then_the_final_goaway_then_fin()
 {
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::Skew);
    assert_eq!(
        b.client.expect_go_away().await,
        MAX_STREAM_ID,
        "first GOAWAY refuses nothing"
    );
    let ours = b.client.expect_ping().await;
    assert!(!ours.ack);
    assert_eq!(b.handle.stats().rotating(), Some(RotationReason::Skew));
    b.client.send(&ping(true, ours.opaque)).await;
    // Stream 1 is ended by the client: it has nothing left to send, so the relay checks that
    // nothing it created is still unwritten: an empty SETTINGS (its ACK comes in a write that
    // also carries every queued stream), then, on the ACK, a PING (its ACK comes in a later
    // write), then the final GOAWAY.
    let (head, _) = b.client.expect(Kind::Settings).await;
    assert!(!head.has(flags::ACK) && head.len == 0, "an empty SETTINGS");
    b.client.send(&settings_ack()).await;
    let quiet = b.client.expect_ping().await;
    assert_eq!((quiet.ack, quiet.opaque), (false, QUIET_PING));
    b.client.send(&ping(true, quiet.opaque)).await;
    assert_eq!(
        b.client.expect_go_away().await,
        1,
        "final GOAWAY: the highest stream opened"
    );
    // The stream opened before the final GOAWAY finishes at the backend.
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    b.client.expect_eof().await;
    // The backend saw no GOAWAY, not our PING's ACK and not our SETTINGS' ACK: nothing after
    // the request, then FIN.
    b.backend.expect_eof().await;
    assert_eq!(b.handle.stats().open_streams(), 0);
    let end = b.task.await.expect("task").expect("clean end");
    assert_eq!(end, RelayEnd::Rotated(RotationReason::Skew));
}

/// Issue 13's wire sequence with a stream opened between the two GOAWAYs: GOAWAY(2^31-1) and
/// the relay's own PING come first, in that order; a stream the client opens before it ACKs
/// is relayed like any other, the final GOAWAY (after the quiet PINGs) names it, both streams
/// finish at the backend;
/// the backend sees neither a GOAWAY nor the ACK; the relay ends with FIN once both are done.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stream_opened_between_the_goaways_is_relayed_named_by_the_final_one_and_finished() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::Skew);
    assert_eq!(b.client.expect_go_away().await, MAX_STREAM_ID);
    let ours = b.client.expect_ping().await;
    assert_eq!(
        ours,
        Ping {
            ack: false,
            opaque: *b"skwl\x00rot"
        },
        "the PING right after the first GOAWAY is ours, with opaque data no gRPC server uses"
    );
    // GOAWAY(2^31-1) refuses nothing: the client may still open stream 3 before it ACKs.
    let mut req = headers(3, flags::END_HEADERS);
    req.extend(frame(Kind::Data, flags::END_STREAM, 3, b"late"));
    b.client.send(&req).await;
    let (h, _) = b.backend.expect(Kind::Headers).await;
    assert_eq!(h.stream_id, 3, "relayed to the backend as usual");
    b.backend.expect(Kind::Data).await;
    assert_eq!(b.handle.stats().requests(), 2);
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(
        settle_until_the_final_go_away(&mut b.client).await,
        3,
        "the final GOAWAY names the highest stream the client opened"
    );
    assert_eq!(b.handle.stats().refused(), 0, "nothing was refused");
    // Both streams finish at the backend, in any order, while the connection stays up.
    b.backend.send(&response(3)).await;
    expect_response(&mut b.client, 3).await;
    b.client.expect_silence().await;
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    // Then FIN both ways; the backend never got anything after the two requests (no GOAWAY,
    // not our PING's ACK).
    let end = b.ends_cleanly().await;
    assert_eq!(end, RelayEnd::Rotated(RotationReason::Skew));
}

/// The opaque data of the relay's quiesce PING (a lazy client's rotation starts with it).
const QUIESCE_PING: [u8; 8] = *b"skwl\x00qui";

/// A header block as grpc-js's first request carries it, HPACK-encoded with literals only (no
/// dynamic table): `:method POST`, `:scheme http`, `:path`, `:authority` and grpc-js's
/// `user-agent`, the one the relay looks for.
fn grpc_js_request_block() -> Vec<u8> {
    let mut block = vec![0x83, 0x86];
    for (prefix, value) in [
        (&[0x04][..], &b"/skewless.echo.v1.Echo/Echo"[..]),
        (&[0x01][..], &b"echo"[..]),
        (&[0x0f, 0x2b][..], &b"grpc-node-js/1.14.7"[..]),
    ] {
        block.extend_from_slice(prefix);
        block.push(u8::try_from(value.len()).expect("short"));
        block.extend_from_slice(value);
    }
    block
}

/// [`open_bed`] for a grpc-js client: its first request carries grpc-js's user-agent, and the
/// relay has recognised it as one that writes its requests lazily.
async fn open_grpc_js_bed(settings: RelaySettings) -> Bed {
    let mut b = bed_with(settings, RelayHandle::new());
    client_hello(&mut b).await;
    b.backend.send(&empty_settings()).await;
    b.client.expect(Kind::Settings).await;
    b.client.send(&settings_ack()).await;
    b.backend.expect(Kind::Settings).await;
    let mut req = frame(
        Kind::Headers,
        flags::END_HEADERS,
        1,
        &grpc_js_request_block(),
    );
    req.extend(frame(Kind::Data, flags::END_STREAM, 1, b"ping"));
    b.client.send(&req).await;
    b.backend.expect(Kind::Headers).await;
    b.backend.expect(Kind::Data).await;
    while !b.handle.stats().user_agent_known() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        b.handle.stats().lazy_requests(),
        "grpc-js's user-agent is recognised"
    );
    assert!(!b.handle.stats().unrotatable());
    b
}

/// nghttp2 (under grpc-js) writes a request's HEADERS only at its next send and refuses every
/// request not yet written once it has read any GOAWAY: a call started in reaction to a
/// response read just before GOAWAY(2^31-1) fails unless it fits grpc-js's retry buffer. So a
/// grpc-js rotation starts with a quiesce: the relay's own PING, and nothing of the backend's
/// until its ACK (which Node writes in the same send as the HEADERS it queued meanwhile);
/// then GOAWAY(2^31-1) and our PING go first, ahead of every frame held.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_grpc_js_rotation_holds_the_backends_frames_behind_a_ping_until_its_ack() {
    let mut b = open_grpc_js_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::MaxAge);
    let hold = b.client.expect_ping().await;
    assert_eq!(
        (hold.ack, hold.opaque),
        (false, QUIESCE_PING),
        "a grpc-js rotation starts with the quiesce PING, no GOAWAY yet"
    );
    assert_eq!(b.handle.stats().rotating(), Some(RotationReason::MaxAge));
    // The backend answers stream 1: held until the ACK, so it cannot start another call.
    b.backend.send(&response(1)).await;
    b.client.expect_silence().await;
    // The client's next send: the ACK first, then the request it had queued (stream 3).
    let mut write = ping(true, QUIESCE_PING);
    write.extend(headers(3, flags::END_HEADERS));
    write.extend(frame(Kind::Data, flags::END_STREAM, 3, b"queued"));
    b.client.send(&write).await;
    let (h, _) = b.backend.expect(Kind::Headers).await;
    assert_eq!(h.stream_id, 3, "the ACK is swallowed, stream 3 relayed");
    b.backend.expect(Kind::Data).await;
    assert_eq!(
        b.client.expect_go_away().await,
        MAX_STREAM_ID,
        "on the ACK: GOAWAY(2^31-1) before anything held"
    );
    let ours = b.client.expect_ping().await;
    assert_eq!((ours.ack, ours.opaque), (false, *b"skwl\x00rot"));
    expect_response(&mut b.client, 1).await;
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 3);
    b.backend.send(&response(3)).await;
    expect_response(&mut b.client, 3).await;
    b.client.expect_eof().await;
    b.backend.expect_eof().await;
    assert_eq!(b.handle.stats().refused(), 0);
    let end = b.task.await.expect("task").expect("clean end");
    assert_eq!(end, RelayEnd::Rotated(RotationReason::MaxAge));
}

/// A client whose user-agent is not known yet (here: no request so far) may be a lazy one:
/// its rotation starts with the quiesce too.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_client_whose_user_agent_is_not_known_is_quiesced_too() {
    let mut b = bed(RelaySettings::default());
    client_hello(&mut b).await;
    b.backend.send(&empty_settings()).await;
    b.client.expect(Kind::Settings).await;
    assert!(!b.handle.stats().user_agent_known());
    b.handle.rotate(RotationReason::Drain);
    assert_eq!(b.client.expect_ping().await.opaque, QUIESCE_PING);
    b.client.send(&ping(true, QUIESCE_PING)).await;
    assert_eq!(b.client.expect_go_away().await, MAX_STREAM_ID);
    assert_eq!(b.client.expect_ping().await.opaque, *b"skwl\x00rot");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_quiesce_without_an_ack_ends_after_a_second_with_the_first_goaway() {
    let mut b = open_grpc_js_bed(RelaySettings::default()).await;
    let started = Instant::now();
    b.handle.rotate(RotationReason::Skew);
    assert_eq!(b.client.expect_ping().await.opaque, QUIESCE_PING);
    b.backend.send(&response(1)).await;
    // The client never answers: after the quiesce timeout the rotation goes on as for any client.
    assert_eq!(b.client.expect_go_away().await, MAX_STREAM_ID);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_millis(1100),
        "the quiesce ends at its timeout: {waited:?}"
    );
    let ours = b.client.expect_ping().await;
    assert_eq!(ours.opaque, *b"skwl\x00rot");
    expect_response(&mut b.client, 1).await;
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    let end = b.ends_cleanly().await;
    assert_eq!(end, RelayEnd::Rotated(RotationReason::Skew));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn other_pings_and_acks_pass_through_both_ways_even_during_a_rotation() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.client.send(&ping(false, *b"keepaliv")).await;
    assert_eq!(b.backend.expect_ping().await.opaque, *b"keepaliv");
    b.backend.send(&ping(true, *b"keepaliv")).await;
    assert_eq!(
        b.client.expect_ping().await,
        Ping {
            ack: true,
            opaque: *b"keepaliv"
        }
    );
    b.backend.send(&ping(false, *b"servping")).await;
    assert_eq!(b.client.expect_ping().await.opaque, *b"servping");
    b.client.send(&ping(true, *b"servping")).await;
    assert!(b.backend.expect_ping().await.ack);

    b.handle.rotate(RotationReason::MaxAge);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    // A keepalive PING interleaved with the rotation, answered by the backend.
    b.client.send(&ping(false, *b"interlvd")).await;
    assert_eq!(b.backend.expect_ping().await.opaque, *b"interlvd");
    b.backend.send(&ping(true, *b"interlvd")).await;
    assert_eq!(b.client.expect_ping().await.opaque, *b"interlvd");
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    b.ends_cleanly().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn without_an_ack_the_final_goaway_follows_the_ping_timeout_at_most_half_the_grace() {
    // (PING timeout, drain grace, when the final GOAWAY comes). The defaults are 10 s and
    // 10 s: the final GOAWAY must not wait for the grace to end (the client's streams would
    // only get its resets), it comes at half the grace, and a stream that finishes after it
    // finishes normally.
    for (ping_timeout, grace, at) in [(7, 30, 7), (10, 10, 5)] {
        let settings = RelaySettings {
            ping_timeout: Duration::from_secs(ping_timeout),
            drain_grace: Duration::from_secs(grace),
            ..RelaySettings::default()
        };
        let mut b = open_bed(settings).await;
        let started = Instant::now();
        b.handle.rotate(RotationReason::Skew);
        b.client.expect_go_away().await;
        b.client.expect_ping().await;
        // The client never answers.
        assert_eq!(b.client.expect_go_away().await, 1);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(at) && waited < Duration::from_secs(at + 1),
            "PING timeout {ping_timeout} s, grace {grace} s: the final GOAWAY comes at \
             {at} s, not {waited:?}"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        b.backend.send(&response(1)).await;
        expect_response(&mut b.client, 1).await;
        let end = b.ends_cleanly().await;
        assert_eq!(
            end,
            RelayEnd::Rotated(RotationReason::Skew),
            "the stream finished, nothing was reset"
        );
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn streams_opened_after_the_final_goaway_are_refused_keeping_hpack_and_windows_in_step() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::Skew);
    b.client.expect_go_away().await;
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    // A client that ignores the GOAWAY: a new stream with a 100-byte body.
    let mut late = headers(3, flags::END_HEADERS);
    late.extend(frame(Kind::Data, flags::END_STREAM, 3, &[7; 100]));
    b.client.send(&late).await;
    // The backend's HPACK decoder sees the HEADERS, then the stream is cancelled; the DATA
    // never reaches it.
    let (h, _) = b.backend.expect(Kind::Headers).await;
    assert_eq!(h.stream_id, 3);
    let rst = b.backend.expect_rst().await;
    assert_eq!((rst.stream_id, rst.error_code), (3, ErrorCode::CANCEL));
    // The client learns the stream was not processed, and gets its window back.
    let rst = b.client.expect_rst().await;
    assert_eq!(
        (rst.stream_id, rst.error_code),
        (3, ErrorCode::REFUSED_STREAM)
    );
    let (head, payload) = b.client.expect(Kind::WindowUpdate).await;
    let wu = WindowUpdate::decode(&head, &payload).expect("WINDOW_UPDATE");
    assert_eq!(
        (wu.stream_id, wu.increment),
        (0, 100),
        "the dropped DATA is credited back"
    );
    assert_eq!(b.handle.stats().refused(), 1);
    assert_eq!(
        b.handle.stats().requests(),
        1,
        "a refused stream is no request"
    );
    // The backend's answer to the refused stream: headers pass (HPACK), DATA is dropped and
    // credited back to the backend.
    let mut answer = headers(3, flags::END_HEADERS);
    answer.extend(frame(Kind::Data, 0, 3, &[1; 40]));
    b.backend.send(&answer).await;
    b.client.expect(Kind::Headers).await;
    let (head, payload) = b.backend.expect(Kind::WindowUpdate).await;
    let wu = WindowUpdate::decode(&head, &payload).expect("WINDOW_UPDATE");
    assert_eq!((wu.stream_id, wu.increment), (0, 40));
    // The stream opened before the GOAWAY still finishes, then the connection ends.
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    b.ends_cleanly().await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn backend_goaways_are_forwarded_and_no_goaway_to_the_client_ever_raises_the_last_id() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::Skew);
    assert_eq!(b.client.expect_go_away().await, MAX_STREAM_ID);
    let ours = b.client.expect_ping().await;
    // The backend's own max connection age, mid-rotation.
    b.backend.send(&go_away(1)).await;
    assert_eq!(b.client.expect_go_away().await, 1, "forwarded");
    assert!(b.handle.stats().backend_go_away());
    b.client.send(&ping(true, ours.opaque)).await;
    // Our final GOAWAY would say 1 again: not sent. A later backend GOAWAY(2^31-1) would
    // raise it: forwarded with the lower id.
    b.backend.send(&go_away(MAX_STREAM_ID)).await;
    assert_eq!(
        b.client.expect_go_away().await,
        1,
        "lowered to what was already sent"
    );
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    b.ends_cleanly().await;
}

/// A backend that closes during a rotation once every stream is done (an h2 server closes
/// after its last stream once a GOAWAY reached it), before the relay's final GOAWAY: the
/// connection ends as rotated, as when the relay closes both sides itself. The rotation asked
/// for the end and nothing was lost; which side closes first is timing.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_that_closes_mid_rotation_with_every_stream_done_ends_it_as_rotated() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    rotate_and_ack(&mut b, RotationReason::Skew).await;
    b.backend.io.shutdown().await.expect("shutdown");
    // The settling's own frames may come first; then FIN.
    while let Some((head, _)) = b.client.next().await {
        assert!(
            matches!(head.kind, Kind::Settings | Kind::Ping),
            "only the settling's frames before FIN, got {head:?}"
        );
    }
    b.client.io.shutdown().await.expect("shutdown");
    b.backend.expect_eof().await;
    assert_eq!(
        b.task.await.expect("task").expect("clean end"),
        RelayEnd::Rotated(RotationReason::Skew)
    );
}

/// A client that answers the rotation's GOAWAY with a GOAWAY of its own (Node's http2 closes
/// its session on a NO_ERROR GOAWAY, and its close() sends one): the relay does not forward
/// it, so the backend (an h2 server closes once its last stream ends after a GOAWAY) is
/// closed by the relay, with FIN, once the streams are done and delivered. Outside a
/// rotation a client's GOAWAY goes to the backend as every other frame.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_clients_goaway_in_answer_to_a_rotation_is_not_forwarded_to_the_backend() {
    let mut b = open_bed(RelaySettings::default()).await;
    b.handle.rotate(RotationReason::MaxAge);
    assert_eq!(b.client.expect_go_away().await, MAX_STREAM_ID);
    b.client.send(&go_away(0)).await;
    let ours = b.client.expect_ping().await;
    b.client.send(&ping(true, ours.opaque)).await;
    assert_eq!(settle_until_the_final_go_away(&mut b.client).await, 1);
    b.backend.send(&response(1)).await;
    expect_response(&mut b.client, 1).await;
    // The backend gets nothing after the request (no GOAWAY), then FIN.
    let end = b.ends_cleanly().await;
    assert_eq!(end, RelayEnd::Rotated(RotationReason::MaxAge));

    let mut b = open_bed(RelaySettings::default()).await;
    b.client.send(&go_away(0)).await;
    assert_eq!(
        b.backend.expect_go_away().await,
        0,
        "outside a rotation the client's GOAWAY is forwarded"
    );
}
