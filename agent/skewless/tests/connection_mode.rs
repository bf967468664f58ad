//! Privileged: connection mode with real gRPC clients (grpcio, @grpc/grpc-js, tonic) through
//! the real VIP, the eBPF redirect and the real `skewless agent` (issue 13 section 4): the
//! scale-up of seed 001, tonic never rotated for skew, the as-even-as-possible cases (one
//! heavy connection over five pods; two equal clients on three pods do not ping-pong); clients
//! and backends that misbehave (a client that ignores GOAWAY, one that never answers the
//! PING, backends that send their own GOAWAY mid-rotation under keepalive PINGs, bad input);
//! the rotation stress. Run with `cargo xtask test` (as root). Every load is bounded in count
//! and time.

mod client_bed;

use std::time::Duration;

use client_bed::{
    Backends, ClientBed, PodTap, assert_connection_mode,
    assert_no_stream_sent_above_the_final_goaway, assert_rotation_load_failed_no_call,
    assert_two_phase_goaways, bad_input_closes_only_that_connection, first_seen, pods_between,
    rotation_load, run_withheld, server_fin_ms, summary, unix_now,
};
use skewless_clients::{
    ClientKind, ClientResult, ClientSpec,
    framelog::{self, Dir, LogLine, Withhold},
};
use skewless_testbed::Place;

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connection_mode_scale_up_from_two_to_ten_pods_reaches_every_pod_and_evens_out() {
    scale_up_from_two_to_ten(42, "connection");
}

/// Seed 001: pick_first clients pinned to 2 pods, the Deployment scaled to 10 mid-run.
/// 20 client connections (4 clients x 5 channels, each channel pick_first on its own
/// connection): fair is 2 per pod once there are 10. With `mode` `observe` (plain L4, no
/// redirect) this fails: the pinned connections never move.
fn scale_up_from_two_to_ten(octet: u8, mode: &str) {
    const HOLD: Duration = Duration::from_secs(5);
    const THRESHOLD: f64 = 1.5;
    let clients = ["grpcio-0", "grpcio-1", "grpc-js-0", "grpc-js-1"];
    let mut bed = ClientBed::new(octet, 10, &clients, Backends::default());
    let tuning = [
        ("skew-threshold", "1.5"),
        ("hold-time", "5s"),
        // Enough to move 16 connections within the test; the default (6) takes ~3 minutes.
        ("max-rotations-per-minute", "120"),
    ];
    bed.configure(mode, &tuning, 2);
    if mode == "observe" {
        bed.start_agent_unredirected();
    } else {
        bed.start_agent();
    }
    if mode == "connection" {
        assert_connection_mode(&bed);
    }
    let run_for = Duration::from_secs(45);
    let spec = ClientSpec {
        channels: 5,
        concurrency: 20,
        call_delay: Some(Duration::from_millis(50)),
        duration: Some(run_for),
        ..ClientSpec::unary(bed.target(), 10_000_000)
    };
    let mut running = Vec::new();
    for c in clients {
        let kind = if c.starts_with("grpcio") {
            ClientKind::Grpcio
        } else {
            ClientKind::GrpcJs
        };
        running.push(
            bed.harness
                .spawn(&mut bed.tb, Place::Pod(c), kind, &spec)
                .unwrap(),
        );
    }
    if mode == "connection" {
        // Seed 001 starts from the clients pinned to 2 pods: under load the Node clients can
        // take seconds to start, and a connection made after the scale-up is placed on the
        // 10 pods at once, which is not the scenario. Then 8 s pinned.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while connection_service(&bed)["connection"]["connections"] != 20 {
            if std::time::Instant::now() >= deadline {
                // Seen once at load average 22: 5 connect()s went direct (fail open).
                bed.assert_never_failed_open();
                panic!(
                    "the 20 client connections are relayed within 30 s: {}",
                    bed.status_text()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    std::thread::sleep(Duration::from_secs(8));
    let scaled_at = unix_now();
    bed.configure(mode, &tuning, 10);
    std::thread::sleep(HOLD + Duration::from_secs(8));
    eprintln!("{}", bed.status_text());
    let results: Vec<ClientResult> = running
        .into_iter()
        .map(|r| r.wait(&mut bed.tb).unwrap())
        .collect();
    for r in &results {
        eprintln!("{}", summary(r));
    }
    if mode != "observe" {
        bed.assert_never_failed_open();
    }
    for r in &results {
        assert_eq!(r.failed_calls(), 0, "no call may fail: {}", summary(r));
    }
    let before = pods_between(&results, 0.0, f64::INFINITY);
    let seen = first_seen(&results);
    eprintln!(
        "scale-up at unix {scaled_at:.2}: first replies after it (s): {:?}",
        seen.iter()
            .map(|(p, t)| (p.clone(), ((t - scaled_at) * 10.0).round() / 10.0))
            .collect::<Vec<_>>()
    );
    let late: Vec<(&String, f64)> = seen
        .iter()
        .map(|(pod, t)| (pod, t - scaled_at))
        .filter(|(_, after)| *after > HOLD.as_secs_f64() + 5.0)
        .collect();
    assert_eq!(
        seen.len(),
        10,
        "every one of the 10 pods receives traffic: {before:?}"
    );
    assert!(
        late.is_empty(),
        "every pod receives traffic within hold-time + 5 s of the scale-up; late: {late:?}"
    );
    // The last 15 s while every client ran, after the rotations settled. Not up to the last
    // client's end: the clients start (and so stop) seconds apart under load, and a window
    // reaching past the first one's end measures which clients were still running, not the
    // placement (seen: 1.70 with grpcio stopped 2 s before grpc-js, whose 5 connections were
    // all on the 2 old pods).
    let end = results
        .iter()
        .map(|r| r.start_unix_s + r.elapsed_s)
        .fold(f64::INFINITY, f64::min);
    let after = pods_between(&results, end - 15.0, end);
    let skew = skewless_clients::skew(&after, 10);
    eprintln!("scale-up: last 15 s of all clients: {after:?}, skew {skew:.2}");
    assert!(
        skew <= THRESHOLD,
        "the post-scale shares end within skew-threshold ({THRESHOLD}) of fair: skew {skew:.2}, \
         {after:?}"
    );
}

/// The connection-mode Service's entry in `/status`.
fn connection_service(bed: &ClientBed) -> serde_json::Value {
    let status = bed.status();
    status["services"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["mode"] == "connection").cloned())
        .unwrap_or_else(|| panic!("a connection-mode Service in /status: {status}"))
}

/// Rotations of the Service in `/status` for `reason`.
fn rotations(svc: &serde_json::Value, reason: &str) -> u64 {
    svc["rotations"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["reason"] == reason))
        .and_then(|r| r["count"].as_u64())
        .unwrap_or_else(|| panic!("rotations for {reason} in {svc}"))
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connection_mode_never_rotates_tonic_for_skew_and_reports_it_unrotatable() {
    // tonic fails every call h2 refuses after a GOAWAY (see GOAWAY-CLIENTS.md): the relay
    // recognises it from the first request's user-agent, and the policy never rotates it for
    // skew. 4 tonic connections pinned to 2 pods, scaled to 4: skewed, and left alone.
    const HOLD: Duration = Duration::from_secs(3);
    let mut bed = ClientBed::new(49, 4, &["tonic"], Backends::default());
    let tuning = [
        ("skew-threshold", "1.5"),
        ("hold-time", "3s"),
        ("max-rotations-per-minute", "120"),
    ];
    bed.configure("connection", &tuning, 2);
    bed.start_agent();
    assert_connection_mode(&bed);
    let spec = ClientSpec {
        channels: 4,
        concurrency: 8,
        call_delay: Some(Duration::from_millis(20)),
        duration: Some(Duration::from_secs(30)),
        ..ClientSpec::unary(bed.target(), 10_000_000)
    };
    let running = bed
        .harness
        .spawn(&mut bed.tb, Place::Pod("tonic"), ClientKind::Tonic, &spec)
        .unwrap();
    // Older than the policy's minimum age (10 s) well before the hold ends.
    std::thread::sleep(Duration::from_secs(8));
    bed.configure("connection", &tuning, 4);
    std::thread::sleep(HOLD + Duration::from_secs(12));
    let svc = connection_service(&bed);
    eprintln!("{}", bed.status_text());
    let r = running.wait(&mut bed.tb).unwrap();
    eprintln!("{}", summary(&r));
    bed.assert_never_failed_open();
    let c = &svc["connection"];
    assert_eq!(
        c["unrotatable_connections"], 4,
        "the 4 tonic connections are reported unrotatable: {svc}"
    );
    assert_eq!(
        rotations(&svc, "skew"),
        0,
        "tonic is never rotated for skew: {svc}"
    );
    assert!(
        c["skew"].as_f64().unwrap_or(0.0) > 1.5,
        "the Service is skewed (2 of 4 pods receive): {svc}"
    );
    assert_eq!(
        c["state"], "as_even_as_possible",
        "no rotatable connection can lower the skew, and status says so: {svc}"
    );
    assert_eq!(c["as_even_as_possible"], true, "{svc}");
    assert_eq!(r.failed_calls(), 0, "no tonic call fails: {}", summary(&r));
    assert!(r.unary.ok > 100, "the load ran: {}", summary(&r));
}

/// `clients` grpcio clients, each one pick_first connection at the same rate, on `pods` pods
/// with `skew-threshold` `threshold`: the skew stays above the threshold and no move lowers
/// it, so nothing is rotated and status says "as even as possible". Returns the skew rotations.
fn as_even_as_possible(octet: u8, clients: &[&str], pods: usize, threshold: &str) -> u64 {
    let mut bed = ClientBed::new(octet, pods, clients, Backends::default());
    let tuning = [
        ("skew-threshold", threshold),
        ("hold-time", "2s"),
        ("max-rotations-per-minute", "120"),
    ];
    bed.configure("connection", &tuning, pods);
    bed.start_agent();
    assert_connection_mode(&bed);
    let spec = ClientSpec {
        concurrency: 10,
        call_delay: Some(Duration::from_millis(20)),
        duration: Some(Duration::from_secs(30)),
        ..ClientSpec::unary(bed.target(), 10_000_000)
    };
    let running: Vec<_> = clients
        .iter()
        .map(|c| {
            bed.harness
                .spawn(&mut bed.tb, Place::Pod(c), ClientKind::Grpcio, &spec)
                .unwrap()
        })
        .collect();
    // Past the minimum connection age (10 s) and the hold, with time to (not) act.
    std::thread::sleep(Duration::from_secs(25));
    let svc = connection_service(&bed);
    eprintln!("{}", bed.status_text());
    let results: Vec<ClientResult> = running
        .into_iter()
        .map(|r| r.wait(&mut bed.tb).unwrap())
        .collect();
    bed.assert_never_failed_open();
    for r in &results {
        eprintln!("{}", summary(r));
        assert_eq!(r.failed_calls(), 0, "no call fails: {}", summary(r));
    }
    let c = &svc["connection"];
    assert_eq!(
        c["state"], "as_even_as_possible",
        "skewed, and no move can lower it: status says so: {svc}"
    );
    assert_eq!(c["as_even_as_possible"], true, "{svc}");
    rotations(&svc, "skew")
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connection_mode_one_heavy_connection_over_five_pods_is_as_even_as_it_can_be_and_never_rotated() {
    let rotated = as_even_as_possible(50, &["grpcio"], 5, "1.5");
    assert_eq!(
        rotated, 0,
        "moving the only connection changes nothing: it is never rotated"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connection_mode_two_equal_heavy_clients_on_three_pods_do_not_ping_pong() {
    // Fair is 2/3 of a client per pod: 1-1-0 is skew 1.5 over a threshold of 1.2, and every
    // move keeps it (or makes it 2-0-0). At most the one rotation that splits them if they
    // were placed on the same pod, then none.
    let rotated = as_even_as_possible(51, &["grpcio-0", "grpcio-1"], 3, "1.2");
    assert!(
        rotated <= 1,
        "two equal clients on three pods never ping-pong: {rotated} skew rotations"
    );
}

// Clients and backends that misbehave during rotations (issue 13 section 4).

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connection_mode_client_that_ignores_goaway_is_refused_then_closed_and_others_are_unaffected() {
    // How long before the relay's FIN (as the tap saw both) a stream may reach the tap and
    // still miss the relay, which is then closing: measured up to 1.3 ms at load average 11.
    const CLOSING_RACE_MS: f64 = 20.0;
    // The tap withholds every GOAWAY: the client never learns it should move, and keeps
    // opening streams on the rotated connection. The relay refuses them (REFUSED_STREAM) and
    // ends the connection once the streams opened before its final GOAWAY are done.
    let withhold = Withhold {
        goaway: true,
        ping: false,
    };
    let (withheld, ordinary, log, _bed) =
        run_withheld(44, "connection", "2s", withhold, Duration::from_secs(12));
    assert_eq!(
        ordinary.failed_calls(),
        0,
        "a client that ignores GOAWAY costs the others nothing: {}",
        summary(&ordinary)
    );
    let mut checked = 0;
    let mut total_refused = 0;
    for conn in framelog::http2_conns(&log) {
        let down = framelog::frames(&log, conn, Dir::ToClient);
        let goaways: Vec<&&framelog::FrameRecord> =
            down.iter().filter(|f| f.kind == "GOAWAY").collect();
        let Some(final_goaway) = goaways.get(1) else {
            continue;
        };
        checked += 1;
        let last = final_goaway.goaway.as_ref().unwrap().0;
        let late: Vec<u32> = framelog::frames(&log, conn, Dir::ToServer)
            .iter()
            .filter(|f| f.kind == "HEADERS" && f.stream > last && f.t_ms > final_goaway.t_ms)
            .map(|f| f.stream)
            .collect();
        let fin = server_fin_ms(&log, conn);
        let up = framelog::frames(&log, conn, Dir::ToServer);
        let mut refused = 0;
        for s in &late {
            let back: Vec<&str> = down
                .iter()
                .filter(|f| f.stream == *s)
                .map(|f| f.kind.as_str())
                .collect();
            assert!(
                !back.contains(&"DATA"),
                "connection {conn}: stream {s}, opened after the final GOAWAY, is never \
                 processed (no response message): {back:?}"
            );
            if down.iter().any(|f| f.stream == *s && f.rst == Some(7)) {
                refused += 1;
                continue;
            }
            // Not refused: it reached the relay after the relay's last earlier stream had
            // ended, so the relay was closing and discarded it (the tap logs a frame when it
            // reads it, before the relay does: a race of a few ms). The client learns from
            // the FIN that it was not processed.
            let at = up.iter().find(|f| f.stream == *s).map_or(0.0, |f| f.t_ms);
            assert!(
                fin.is_some_and(|fin| fin - at <= CLOSING_RACE_MS),
                "connection {conn}: stream {s}, opened after the final GOAWAY at {at:.1} ms, is \
                 refused (REFUSED_STREAM) unless it came as the relay closed (FIN at {fin:?})"
            );
        }
        total_refused += refused;
        assert!(
            fin.is_some_and(|t| t - goaways[0].t_ms < 13_000.0),
            "connection {conn}: the relay ends it with FIN within the drain grace (10 s) of its \
             first GOAWAY, however the client behaves (FIN at {fin:?}, GOAWAY at {})",
            goaways[0].t_ms
        );
        eprintln!(
            "connection {conn}: {} streams opened after the final GOAWAY, {refused} refused, the \
             rest as it closed; FIN {:.0} ms after the first GOAWAY",
            late.len(),
            fin.unwrap_or_default() - goaways[0].t_ms
        );
    }
    assert!(checked >= 1, "at least one connection was rotated: {log:?}");
    assert!(
        total_refused >= 1,
        "the relay refused the streams opened after its final GOAWAY"
    );
    eprintln!(
        "the client that ignores GOAWAY: {} ok, failed {:?}",
        withheld.unary.ok, withheld.unary.failed
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connection_mode_client_that_never_answers_the_ping_moves_on_the_first_goaway_and_loses_no_call()
{
    // The tap withholds the relay's PING, so no ACK ever comes. The relay must neither rush
    // the final GOAWAY (it waits the agent's PING timeout, 10 s) nor hang: GOAWAY(2^31-1)
    // alone moves grpcio, which closes the old connection once its calls are done (measured:
    // ~50 ms after the first GOAWAY), and the relay then ends it with FIN. The PING timeout
    // itself, with a peer that keeps the connection, is the relay's frame-level test
    // (`without_an_ack_the_final_goaway_follows_the_ping_timeout`).
    const PING_TIMEOUT_MS: f64 = 10_000.0;
    let withhold = Withhold {
        goaway: false,
        ping: true,
    };
    let (withheld, ordinary, log, _bed) =
        run_withheld(45, "connection", "2s", withhold, Duration::from_secs(15));
    for r in [&withheld, &ordinary] {
        assert_eq!(
            r.failed_calls(),
            0,
            "a client that never answers the PING still moves on GOAWAY(2^31-1): {}",
            summary(r)
        );
    }
    let conns = framelog::http2_conns(&log);
    let mut checked = 0;
    for &conn in &conns {
        let down = framelog::frames(&log, conn, Dir::ToClient);
        let goaways: Vec<f64> = down
            .iter()
            .filter(|f| f.kind == "GOAWAY")
            .map(|f| f.t_ms)
            .collect();
        let Some(&first) = goaways.first() else {
            continue;
        };
        checked += 1;
        assert!(
            down.iter()
                .any(|f| f.dropped && f.ping.as_ref().is_some_and(|p| !p.0) && f.t_ms >= first),
            "connection {conn}: the relay's PING followed its GOAWAY (and the tap withheld it)"
        );
        assert!(
            !framelog::frames(&log, conn, Dir::ToServer)
                .iter()
                .any(|f| f.ping.as_ref().is_some_and(|p| p.0)),
            "connection {conn}: the client never saw the PING, so never ACKed it"
        );
        if let Some(final_at) = goaways.get(1) {
            // Both GOAWAYs as the tap saw them; the relay's timer starts as it sends the first.
            let wait = final_at - first;
            assert!(
                wait >= PING_TIMEOUT_MS - 100.0,
                "connection {conn}: without an ACK the final GOAWAY waits for the PING timeout \
                 (10 s), not {wait:.0} ms"
            );
        }
        let fin = server_fin_ms(&log, conn);
        assert!(
            fin.is_some_and(|t| t - first < 13_000.0) || conn == *conns.last().unwrap(),
            "connection {conn}: ends with FIN within the drain grace (10 s) of its first GOAWAY \
             (FIN at {fin:?}, GOAWAY at {first})"
        );
        eprintln!(
            "connection {conn}: {} GOAWAY(s), FIN {:.0} ms after the first",
            goaways.len(),
            fin.unwrap_or(f64::NAN) - first
        );
    }
    assert!(checked >= 2, "connections were rotated");
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connection_mode_backend_goaway_mid_rotation_and_keepalive_pings_fail_no_call() {
    // Backends rotate their own connections (1.5 s), the relay rotates the clients' (1 s),
    // and the clients send keepalive PINGs every 200 ms: what only the full path shows is
    // that real clients and a real backend agree with the relay on all of it. The tapped
    // client holds a server stream open for 4 s from its start, so its first connection is
    // still draining (the relay's rotation, at ~1 s, waits for that stream) when the backend's
    // own max age (1.5 s) sends its GOAWAYs: a backend GOAWAY mid-rotation, every run. One
    // backend, the tapped one: that connection is always on it (with two, it was on the
    // untapped one in about half the runs, and the other connections, rotated at ~1 s, never
    // reach the backend's 1.5 s, so the backend's log showed no GOAWAY of its own).
    let mut bed = ClientBed::new(
        46,
        1,
        &["grpcio", "grpc-js", "tapped"],
        Backends {
            max_age: Some(Duration::from_millis(1500)),
            tap_first: true,
        },
    );
    bed.configure("connection", &[("max-connection-age", "1s")], 1);
    bed.start_agent();
    assert_connection_mode(&bed);
    let tap = PodTap::start(&mut bed, "tapped", Withhold::default());
    let spec = |target: String, keepalive| ClientSpec {
        concurrency: 50,
        call_delay: Some(Duration::from_millis(50)),
        duration: Some(Duration::from_secs(15)),
        keepalive,
        ..ClientSpec::unary(target, 10_000_000)
    };
    let target = bed.target();
    let keepalive = Some(Duration::from_millis(200));
    let mut running = Vec::new();
    // No 4 MiB calls here: one refused by a rotation cannot be retried transparently (it
    // exceeds the clients' per-call retry buffer), which is the rotation stress test's open
    // problem (1 grpc-js 4 MiB call failed with REFUSED_STREAM in 1 of 3 runs here).
    // grpc-js without keepalive: grpc-js 1.14.7 keeps its keepalive timer running after any
    // graceful GOAWAY, and the next PING on the closing session fails locally and ends every
    // call still in flight ("Connection dropped"; grpc/grpc-node#3068, open). Measured here
    // with a 200 ms keepalive: 192 of 6,451 grpc-js calls failed so, all at rotations.
    for (pod, kind, t, keepalive) in [
        ("grpcio", ClientKind::Grpcio, target.clone(), keepalive),
        ("grpc-js", ClientKind::GrpcJs, target.clone(), None),
        (
            "tapped",
            ClientKind::Grpcio,
            tap.addr.to_string(),
            keepalive,
        ),
    ] {
        let spec = ClientSpec {
            stream: (pod == "tapped").then_some(Duration::from_secs(4)),
            ..spec(t, keepalive)
        };
        running.push(
            bed.harness
                .spawn(&mut bed.tb, Place::Pod(pod), kind, &spec)
                .unwrap(),
        );
    }
    let results: Vec<ClientResult> = running
        .into_iter()
        .map(|r| r.wait(&mut bed.tb).unwrap())
        .collect();
    for r in &results {
        eprintln!("{}", summary(r));
        assert_eq!(r.failed_calls(), 0, "no call may fail: {}", summary(r));
    }
    let log = tap.log();
    assert!(
        assert_two_phase_goaways(&log) >= 5,
        "the clients were rotated"
    );
    let stream = results[2]
        .server_stream
        .as_ref()
        .expect("the tapped client's stream");
    assert!(
        stream.code == "OK" && stream.messages == stream.expected,
        "the server stream open across both rotations completes: {stream:?}"
    );
    // The stream's connection: our two GOAWAYs, then the backend's own (forwarded, lowered
    // to ours where they would raise it; assert_two_phase_goaways checked the order).
    let first = framelog::http2_conns(&log)[0];
    let goaways: Vec<u32> = framelog::frames(&log, first, Dir::ToClient)
        .iter()
        .filter_map(|f| f.goaway.as_ref().map(|g| g.0))
        .collect();
    eprintln!("the draining connection's GOAWAYs to the client (last-stream-ids): {goaways:?}");
    assert!(
        goaways.len() >= 3,
        "the backend's GOAWAY came mid-rotation and was forwarded: GOAWAYs {goaways:?}"
    );
    // The client's keepalive PINGs are answered (by the backend, through the relay).
    let conn = framelog::http2_conns(&log)[0];
    let up: Vec<String> = framelog::frames(&log, conn, Dir::ToServer)
        .iter()
        .filter_map(|f| f.ping.as_ref().filter(|p| !p.0).map(|p| p.1.clone()))
        .collect();
    let acked: Vec<String> = framelog::frames(&log, conn, Dir::ToClient)
        .iter()
        .filter_map(|f| f.ping.as_ref().filter(|p| p.0).map(|p| p.1.clone()))
        .collect();
    assert!(!up.is_empty(), "the client sent keepalive PINGs");
    assert!(
        up.iter().all(|p| acked.contains(p)),
        "every keepalive PING of the client is ACKed: sent {up:?}, ACKs {acked:?}"
    );
    // What the backend saw: the client's PINGs, never a GOAWAY of the relay's, never the
    // relay's own PING ACK (opaque "skwl\0rot"), and its own GOAWAYs went out.
    let backend = bed.backend_log();
    let to_backend: Vec<&framelog::FrameRecord> = backend
        .iter()
        .filter_map(|l| match l {
            LogLine::Frame(f) if f.dir == Dir::ToServer => Some(f),
            _ => None,
        })
        .collect();
    // GOAWAYs the backend receives can only be the clients' own, forwarded outside a
    // rotation (Node's GOAWAY(0) in answer to a rotation is not forwarded): last-stream-id 0,
    // since a client's names the server's pushed streams. One of the relay's would name
    // client streams (2^31-1 or the last one opened).
    let to_backend_goaways: Vec<u32> = to_backend
        .iter()
        .filter_map(|f| f.goaway.as_ref().map(|g| g.0))
        .collect();
    assert!(
        to_backend_goaways.iter().all(|&last| last == 0),
        "the relay never sends the backend a GOAWAY of its own: {to_backend_goaways:?}"
    );
    let rotation_ping = "736b776c00726f74";
    assert!(
        !to_backend
            .iter()
            .any(|f| f.ping.as_ref().is_some_and(|p| p.1 == rotation_ping)),
        "the relay's rotation PING ACK is swallowed, never forwarded"
    );
    assert!(
        to_backend
            .iter()
            .any(|f| f.ping.as_ref().is_some_and(|p| !p.0)),
        "the clients' keepalive PINGs reach the backend"
    );
    assert!(
        backend.iter().any(|l| matches!(l, LogLine::Frame(f)
            if f.dir == Dir::ToClient && f.kind == "GOAWAY")),
        "the backend sent its own GOAWAYs (max age 1.5 s)"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connection_mode_bad_input_closes_only_that_connection() {
    bad_input_closes_only_that_connection(48, "connection");
}

// Rotation stress (issue 13 section 4).

/// A rotation every second (`max-connection-age: 1s`) for 60 s: 200 unary calls in flight,
/// a server stream and a bidi stream open across rotations, 4 MiB calls one after another.
fn rotation_stress_bed(octet: u8, clients: &[&str]) -> ClientBed {
    let mut bed = ClientBed::new(octet, 4, clients, Backends::default());
    bed.configure("connection", &[("max-connection-age", "1s")], 4);
    bed.start_agent();
    assert_connection_mode(&bed);
    bed
}

const STRESS_FOR: Duration = Duration::from_secs(60);
const STRESS_STREAMS: Duration = Duration::from_secs(5);

fn assert_no_call_failed_through_the_rotations(bed: &ClientBed, results: &[&ClientResult]) {
    bed.assert_never_failed_open();
    eprintln!("{}", bed.status_text());
    let max_age = rotations(&connection_service(bed), "max_age");
    eprintln!("rotations (max_age): {max_age}");
    // One connection per client at a time, each rotated at 0.9-1.1 s of age and then
    // reconnected: 56-115 seen for one or two clients.
    let at_least = 30 * results.len() as u64;
    assert!(
        max_age >= at_least,
        "a 1 s max age rotates each client's connection every second or so ({max_age} in \
         {STRESS_FOR:?}, at least {at_least})"
    );
    for r in results {
        assert_rotation_load_failed_no_call(r);
        for s in [&r.server_stream, &r.bidi] {
            assert!(
                s.as_ref().is_some_and(|s| s.messages > 0),
                "the streams ran: {}",
                summary(r)
            );
        }
    }
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connection_mode_rotation_every_second_fails_no_grpcio_call() {
    // A second grpcio client, with a lighter load, dials through a frame-logging tap: its log
    // shows each rotation's wire sequence as a client sees it, and that no stream it sent was
    // above a final GOAWAY.
    let mut bed = rotation_stress_bed(43, &["grpcio", "tapped"]);
    let tap = PodTap::start(&mut bed, "tapped", Withhold::default());
    let tapped_spec = ClientSpec {
        concurrency: 4,
        ..rotation_load(&tap.addr.to_string(), STRESS_FOR, 4, STRESS_STREAMS)
    };
    let tapped = bed
        .harness
        .spawn(
            &mut bed.tb,
            Place::Pod("tapped"),
            ClientKind::Grpcio,
            &tapped_spec,
        )
        .unwrap();
    let load = rotation_load(&bed.target(), STRESS_FOR, 200, STRESS_STREAMS);
    let grpcio = bed
        .harness
        .run(&mut bed.tb, Place::Pod("grpcio"), ClientKind::Grpcio, &load)
        .unwrap();
    eprintln!("{}", summary(&grpcio));
    let tapped = tapped.wait(&mut bed.tb).unwrap();
    eprintln!("tapped: {}", summary(&tapped));
    assert_no_call_failed_through_the_rotations(&bed, &[&grpcio, &tapped]);
    let log = tap.log();
    let conns = framelog::http2_conns(&log).len();
    let rotated = assert_two_phase_goaways(&log);
    assert_no_stream_sent_above_the_final_goaway(&log);
    eprintln!("tapped grpcio client: {conns} connections in {STRESS_FOR:?}, {rotated} rotated");
    assert!(
        rotated >= 30,
        "a 1 s max age rotates the tapped client's connection about every second \
         ({rotated} rotated of {conns} in {STRESS_FOR:?})"
    );
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn connection_mode_rotation_every_second_fails_no_grpc_js_call() {
    let mut bed = rotation_stress_bed(41, &["grpc-js"]);
    let load = rotation_load(&bed.target(), STRESS_FOR, 200, STRESS_STREAMS);
    let grpc_js = bed
        .harness
        .run(
            &mut bed.tb,
            Place::Pod("grpc-js"),
            ClientKind::GrpcJs,
            &load,
        )
        .unwrap();
    eprintln!("{}", summary(&grpc_js));
    assert_no_call_failed_through_the_rotations(&bed, &[&grpc_js]);
}
