//! Privileged: real gRPC clients (grpcio, @grpc/grpc-js, tonic) through the real VIP, the
//! eBPF redirect and the real `skewless agent` in request mode (and a connection-mode smoke
//! test; the connection-mode suite is `connection_mode`), against tonic echo backends
//! in testbed pods. Run with `cargo xtask test` (as root; the venv and npm packages come from
//! `cargo xtask setup`). Every load is bounded in count and time; the testbed removes
//! everything on drop.

mod client_bed;

use std::time::Duration;

use client_bed::{
    Backends, ClientBed, PodTap, assert_connection_mode,
    assert_no_stream_sent_above_the_final_goaway,
    assert_rotation_load_failed_no_call_but_a_known_race, assert_two_phase_goaways,
    bad_input_closes_only_that_connection, rotation_load, summary,
};
use skewless_clients::{
    ClientKind, ClientSpec,
    framelog::{self, Withhold},
};
use skewless_testbed::Place;

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn request_mode_one_second_max_age_rotates_real_clients_without_failing_a_call() {
    // The two-phase GOAWAY of the request-mode balancer, every ~1 s per client connection:
    // what connection mode's rotation does on the wire, already real today.
    let clients = ["grpcio", "grpc-js", "tonic", "tapped"];
    let mut bed = ClientBed::new(40, 4, &clients, Backends::default());
    bed.configure("request", &[("max-connection-age", "1s")], 4);
    bed.start_agent();
    let target = bed.target();
    let run_for = Duration::from_secs(15);
    // Streams stay open across rotations (their own connection's GOAWAY comes after ~1 s, and
    // the other connections' meanwhile), and end inside the balancer's drain grace (10 s)
    // with room for a client that starts them late on a busy machine.
    let streams = Duration::from_secs(5);
    let tap = PodTap::start(&mut bed, "tapped", Withhold::default());
    // One client at a time (the tapped one beside the first): on a 2-core machine three
    // clients at 200 in flight at once starve each other, and a call slowed past the drain
    // grace is cut whoever rotates.
    let tapped_spec = ClientSpec {
        concurrency: 4,
        ..rotation_load(&tap.addr.to_string(), run_for, 4, streams)
    };
    let mut tapped = Some(
        bed.harness
            .spawn(
                &mut bed.tb,
                Place::Pod("tapped"),
                ClientKind::Grpcio,
                &tapped_spec,
            )
            .unwrap(),
    );
    let mut results = Vec::new();
    for (pod, kind) in [
        ("grpcio", ClientKind::Grpcio),
        ("grpc-js", ClientKind::GrpcJs),
        ("tonic", ClientKind::Tonic),
    ] {
        let spec = rotation_load(&target, run_for, 200, streams);
        let r = bed
            .harness
            .run(&mut bed.tb, Place::Pod(pod), kind, &spec)
            .unwrap();
        eprintln!("{}", summary(&r));
        results.push(r);
        if let Some(t) = tapped.take() {
            let r = t.wait(&mut bed.tb).unwrap();
            eprintln!("tapped: {}", summary(&r));
            results.push(r);
        }
    }
    bed.assert_never_failed_open();
    let (grpcio, tapped, grpc_js, tonic) = (&results[0], &results[1], &results[2], &results[3]);
    for r in [grpcio, grpc_js, tapped] {
        assert_rotation_load_failed_no_call_but_a_known_race(r);
        assert_eq!(
            r.unary.pods.len(),
            4,
            "request mode spreads the calls over every pod: {}",
            summary(r)
        );
    }
    // tonic is measured, not held to zero (it does not retry calls refused by a GOAWAY).
    assert!(tonic.unary.ok > 0, "tonic ran: {}", summary(tonic));
    let log = tap.log();
    let conns = framelog::http2_conns(&log).len();
    let rotated = assert_two_phase_goaways(&log);
    // The final GOAWAY waits until the client has written every stream it created.
    let finals = assert_no_stream_sent_above_the_final_goaway(&log);
    eprintln!(
        "tapped grpcio client: {conns} connections in {run_for:?}, {rotated} rotated, \
         {finals} with a final GOAWAY below no stream it sent"
    );
    assert!(
        finals + 2 >= rotated,
        "the rotated connections got their final GOAWAY ({finals} of {rotated})"
    );
    assert!(
        rotated >= 8,
        "a 1 s max age rotates the tapped client's connection about every second \
         ({rotated} rotated of {conns} in {run_for:?})"
    );
    eprintln!("{}", bed.status_text());
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn request_mode_bad_input_closes_only_that_connection() {
    bad_input_closes_only_that_connection(47, "request");
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connection_mode_real_client_through_the_vip_is_answered_by_a_backend_via_the_relay() {
    // The agent wiring of connection mode, end to end: the VIP is redirected to the relay
    // (not left to the DNAT), a real grpcio client's calls are answered by a backend, and
    // the agent's status counts them as relayed on that backend's connection.
    let mut bed = ClientBed::new(60, 2, &["grpcio"], Backends::default());
    bed.configure("connection", &[], 2);
    bed.start_agent();
    assert_connection_mode(&bed);
    let calls = 200;
    let spec = ClientSpec {
        concurrency: 4,
        ..ClientSpec::unary(bed.target(), calls)
    };
    let r = bed
        .harness
        .run(&mut bed.tb, Place::Pod("grpcio"), ClientKind::Grpcio, &spec)
        .unwrap();
    eprintln!("{}", summary(&r));
    assert_eq!(r.failed_calls(), 0, "no call fails: {}", summary(&r));
    assert_eq!(r.unary.ok, calls, "every call is answered: {}", summary(&r));
    assert_eq!(
        r.unary.pods.len(),
        1,
        "one pick_first connection is relayed 1:1 to one backend: {}",
        summary(&r)
    );
    bed.assert_never_failed_open();
    // The balancer takes the relays' counters at its tick (1 s) and when a connection ends.
    let relayed = |status: &serde_json::Value| -> u64 {
        status["services"][0]["endpoints"]
            .as_array()
            .expect("endpoints")
            .iter()
            .map(|e| e["requests"].as_u64().unwrap_or(0))
            .sum()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut status = bed.status();
    while relayed(&status) < calls && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        status = bed.status();
    }
    let service = &status["services"][0];
    assert_eq!(service["mode"], "connection", "{status}");
    assert_eq!(
        service["connection"]["ready_backends"], 2,
        "connection mode reports its rotation view: {status}"
    );
    assert!(
        relayed(&status) >= calls,
        "within two ticks the relay has counted the client's {calls} calls (the redirect was \
         taken, not the DNAT): {status}"
    );
    let text = bed.status_text();
    eprintln!("{text}");
    assert!(
        text.contains("rotations: 0 for skew in the last minute"),
        "skewless status shows the rotation view: {text}"
    );
}
