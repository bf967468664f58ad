//! The `skewless status` text, from the `/status` document.
//!
//! Rates, percentiles and success rates come from two documents taken some time apart: the
//! counters are cumulative (the same numbers `/metrics` exports), so what happened in between
//! is their difference. With one document only, those columns show `-`.

use std::{fmt::Write as _, time::Duration};

use crate::json::{ConnectionStatus, EndpointStatus, Histogram, ServiceStatus, Status};

/// The human-readable form of `now`; with `earlier` (a document taken `interval` before), also
/// calls per second, success rate and p50/p99 per Service and backend over that interval.
#[must_use]
pub fn status_text(now: &Status, earlier: Option<(&Status, Duration)>) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_status(&mut out, now, earlier);
    out
}

/// What happened to a histogram and its failures between two documents.
struct Recent {
    per_sec: f64,
    success: Option<f64>,
    p50: Option<f64>,
    p99: Option<f64>,
}

impl Recent {
    fn of(
        bounds: &[f64],
        now: &Histogram,
        then: Option<&Histogram>,
        failed: u64,
        interval: Duration,
    ) -> Self {
        let h = then.map_or_else(|| now.clone(), |t| now.since(t));
        let calls = h.count();
        #[expect(clippy::cast_precision_loss, reason = "counts far below 2^52")]
        let (per_sec, success) = (
            calls as f64 / interval.as_secs_f64().max(1e-9),
            (calls > 0).then(|| 1.0 - failed.min(calls) as f64 / calls as f64),
        );
        Self {
            per_sec,
            success,
            p50: h.quantile(bounds, 0.5),
            p99: h.quantile(bounds, 0.99),
        }
    }

    fn columns(this: Option<&Self>) -> String {
        let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |s| format!("{:.1}", s * 1e3));
        match this {
            None => format!("{:>9} {:>8} {:>7} {:>7}", "-", "-", "-", "-"),
            Some(r) => format!(
                "{:>9.1} {:>8} {:>7} {:>7}",
                r.per_sec,
                r.success
                    .map_or_else(|| "-".to_owned(), |s| format!("{:.2}%", s * 100.0)),
                ms(r.p50),
                ms(r.p99),
            ),
        }
    }
}

fn find<'a>(s: &'a Status, svc: &ServiceStatus) -> Option<&'a ServiceStatus> {
    s.services
        .iter()
        .find(|x| x.service == svc.service && x.vip == svc.vip && x.listener == svc.listener)
}

fn find_endpoint<'a>(svc: &'a ServiceStatus, e: &EndpointStatus) -> Option<&'a EndpointStatus> {
    svc.endpoints.iter().find(|x| x.addr == e.addr)
}

fn write_status(
    out: &mut String,
    s: &Status,
    earlier: Option<(&Status, Duration)>,
) -> std::fmt::Result {
    writeln!(
        out,
        "node {}: {} connect()s seen, {} redirected",
        s.node, s.connect_seen, s.connect_redirected
    )?;
    writeln!(out, "{:<24} {:<24}", "REDIRECT", "TO")?;
    for r in &s.redirects {
        writeln!(out, "{:<24} {:<24}", r.service, r.target)?;
    }
    for u in &s.unserved {
        writeln!(
            out,
            "\nNOT SERVED: service {} ({}) {} for {:.0}s (plain L4 meanwhile): {}",
            u.service, u.mode, u.vip, u.since_seconds, u.error
        )?;
    }
    for o in &s.observed {
        let unresolved = if o.unresolved > 0 {
            format!(", {} unresolved", o.unresolved)
        } else {
            String::new()
        };
        writeln!(
            out,
            "\nservice {} ({}) {}: {} ready, {} receiving traffic from this node's pods, largest share {:.2}, skew {:.2}{unresolved}",
            o.service,
            o.mode,
            o.vip,
            o.ready_backends,
            o.backends_receiving,
            o.largest_share,
            o.skew,
        )?;
        writeln!(
            out,
            "  {:<22} {:>6} {:>7} {:>12} {:>12}",
            "BACKEND", "CONNS", "SHARE", "SENT B/s", "RECV B/s"
        )?;
        for b in &o.backends {
            writeln!(
                out,
                "  {:<22} {:>6} {:>7.3} {:>12.0} {:>12.0}",
                b.backend, b.open_connections, b.share, b.sent_per_sec, b.received_per_sec
            )?;
        }
    }
    for svc in &s.services {
        let receiving = svc.endpoints.iter().filter(|e| e.requests > 0).count();
        let largest = svc.endpoints.iter().map(|e| e.share).fold(0.0, f64::max);
        writeln!(
            out,
            "\nservice {} ({}) {} -> {}: {} ready, {} receiving traffic, largest share {:.2}",
            svc.service, svc.mode, svc.vip, svc.listener, svc.ready_endpoints, receiving, largest
        )?;
        let then = earlier.and_then(|(e, interval)| find(e, svc).map(|t| (t, interval)));
        let recent = then.map(|(t, interval)| {
            let failed = svc.failures.total().saturating_sub(t.failures.total());
            Recent::of(
                &svc.latency_bounds,
                &svc.latency,
                Some(&t.latency),
                failed,
                interval,
            )
        });
        if let (Some(r), Some((_, interval))) = (&recent, then) {
            let ms =
                |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{:.1} ms", v * 1e3));
            writeln!(
                out,
                "  calls {:.1}/s, success {}, p50 {}, p99 {} (last {:.1} s)",
                r.per_sec,
                r.success
                    .map_or_else(|| "-".to_owned(), |v| format!("{:.2}%", v * 100.0)),
                ms(r.p50),
                ms(r.p99),
                interval.as_secs_f64(),
            )?;
        }
        if let Some(c) = &svc.connection {
            write_connection(out, svc, c, then)?;
            continue;
        }
        writeln!(
            out,
            "  {:<12} {:<22} {:<10} {:>9} {:>8} {:>7} {:>10} {:>9} {:>8} {:>7} {:>7}",
            "BACKEND",
            "ADDRESS",
            "STATE",
            "REQUESTS",
            "FAILED",
            "SHARE",
            "EWMA ms",
            "RPS",
            "SUCCESS",
            "p50 ms",
            "p99 ms"
        )?;
        for e in &svc.endpoints {
            let latency = e
                .latency_ms
                .map_or_else(|| "-".to_owned(), |l| format!("{l:.1}"));
            let recent = then.map(|(t, interval)| {
                let before = find_endpoint(t, e);
                let failed = e.failures.saturating_sub(before.map_or(0, |b| b.failures));
                Recent::of(
                    &svc.latency_bounds,
                    &e.latency,
                    before.map(|b| &b.latency),
                    failed,
                    interval,
                )
            });
            writeln!(
                out,
                "  {:<12} {:<22} {:<10} {:>9} {:>8} {:>7.3} {:>10} {}",
                e.name,
                e.addr,
                e.state,
                e.requests,
                e.failures,
                e.share,
                latency,
                Recent::columns(recent.as_ref())
            )?;
        }
    }
    Ok(())
}

/// A connection-mode Service's rotation view and its backends: relayed connections and
/// request shares (a relay times calls per Service, not per backend).
fn write_connection(
    out: &mut String,
    svc: &ServiceStatus,
    c: &ConnectionStatus,
    then: Option<(&ServiceStatus, Duration)>,
) -> std::fmt::Result {
    writeln!(
        out,
        "  skew {:.2} (live {:.2}, threshold {:.2}), rotation {}; {} backends take connections; \
         {} connections, {} unrotatable (tonic)",
        c.skew,
        c.live_skew,
        c.skew_threshold,
        c.state,
        c.ready_backends,
        c.connections,
        c.unrotatable_connections,
    )?;
    let reasons: Vec<String> = svc
        .rotations
        .iter()
        .map(|r| format!("{} {}", r.reason, r.count))
        .collect();
    writeln!(
        out,
        "  rotations: {} for skew in the last minute; since start: {}",
        c.rotations_last_minute,
        reasons.join(", ")
    )?;
    if c.no_backend > 0 {
        writeln!(
            out,
            "  {} client connections closed: no backend could be connected",
            c.no_backend
        )?;
    }
    if c.as_even_as_possible {
        writeln!(
            out,
            "  as even as connection mode can be: use mode request (it balances per call; \
             no connection can move to lower the skew)"
        )?;
    }
    writeln!(
        out,
        "  {:<12} {:<22} {:<10} {:>6} {:>9} {:>7} {:>9} {:>13}",
        "BACKEND", "ADDRESS", "STATE", "CONNS", "REQUESTS", "SHARE", "RPS", "CONNECT FAILS"
    )?;
    for e in &svc.endpoints {
        let rps = then.map_or_else(
            || "-".to_owned(),
            |(t, interval)| {
                let before = find_endpoint(t, e).map_or(0, |b| b.requests);
                #[expect(clippy::cast_precision_loss, reason = "counts far below 2^52")]
                let per_sec =
                    e.requests.saturating_sub(before) as f64 / interval.as_secs_f64().max(1e-9);
                format!("{per_sec:.1}")
            },
        );
        writeln!(
            out,
            "  {:<12} {:<22} {:<10} {:>6} {:>9} {:>7.3} {:>9} {:>13}",
            e.name, e.addr, e.state, e.upstream_connections, e.requests, e.share, rps, e.failures
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: &[f64] = &[0.001, 0.01, 0.1];

    fn status(requests: u64, fast: u64, slow: u64, failures: u64) -> Status {
        let latency = Histogram {
            counts: vec![fast, 0, slow, 0],
            sum: 0.0,
        };
        Status {
            node: "n1".into(),
            redirects: Vec::new(),
            connect_seen: 0,
            connect_redirected: 0,
            refused_peers: 0,
            unserved: Vec::new(),
            services: vec![ServiceStatus {
                service: "ns/echo".into(),
                mode: "request".into(),
                vip: "10.0.0.1:80".into(),
                listener: "169.254.77.1:4000".into(),
                ready_endpoints: 1,
                endpoints: vec![EndpointStatus {
                    name: "echo-0".into(),
                    addr: "10.1.0.1:80".into(),
                    state: "Active".into(),
                    requests,
                    failures,
                    share: 1.0,
                    latency: latency.clone(),
                    ..EndpointStatus::default()
                }],
                latency_bounds: BOUNDS.to_vec(),
                latency,
                failures: crate::json::Failures {
                    reset: failures,
                    ..crate::json::Failures::default()
                },
                ..ServiceStatus::default()
            }],
            observed: Vec::new(),
            agent: crate::json::AgentStatus::default(),
        }
    }

    #[test]
    fn rates_and_percentiles_cover_the_interval_between_two_documents() {
        // 100 fast calls long ago; then 200 in 2 s: 100 fast, 100 slow, 20 failed.
        let then = status(100, 100, 0, 0);
        let now = status(300, 200, 100, 20);
        let text = status_text(&now, Some((&then, Duration::from_secs(2))));
        assert!(
            text.contains("calls 100.0/s, success 90.00%, p50 1.0 ms, p99 98.2 ms (last 2.0 s)"),
            "{text}"
        );
        let row = text.lines().find(|l| l.contains("echo-0")).unwrap();
        assert!(row.ends_with("    100.0   90.00%     1.0    98.2"), "{row}");
    }

    #[test]
    fn one_document_shows_no_rates() {
        let text = status_text(&status(1, 1, 0, 0), None);
        assert!(!text.contains("calls "), "{text}");
        let row = text.lines().find(|l| l.contains("echo-0")).unwrap();
        assert!(row.ends_with("        -        -       -       -"), "{row}");
    }

    fn connection(requests: [u64; 2], as_even_as_possible: bool) -> Status {
        let endpoint = |i: usize, conns: u64| EndpointStatus {
            name: format!("echo-{i}"),
            addr: format!("10.1.0.{i}:80"),
            state: "Active".into(),
            requests: requests[i],
            upstream_connections: conns,
            share: 0.5,
            ..EndpointStatus::default()
        };
        Status {
            node: "n1".into(),
            unserved: Vec::new(),
            services: vec![ServiceStatus {
                service: "ns/echo".into(),
                mode: "connection".into(),
                vip: "10.0.0.1:80".into(),
                listener: "169.254.77.1:4000".into(),
                ready_endpoints: 2,
                endpoints: vec![endpoint(0, 3), endpoint(1, 1)],
                latency_bounds: BOUNDS.to_vec(),
                latency: Histogram::empty(BOUNDS),
                rotations: vec![
                    crate::json::Rotation {
                        reason: "skew".into(),
                        count: 4,
                    },
                    crate::json::Rotation {
                        reason: "drain".into(),
                        count: 0,
                    },
                ],
                connection: Some(ConnectionStatus {
                    skew: 2.0,
                    live_skew: 1.8,
                    skew_threshold: 1.5,
                    state: "rotating".into(),
                    ready_backends: 2,
                    connections: 4,
                    backends_receiving: 2,
                    rotations_last_minute: 3,
                    unrotatable_connections: 1,
                    as_even_as_possible,
                    no_backend: 0,
                }),
                ..ServiceStatus::default()
            }],
            redirects: Vec::new(),
            connect_seen: 0,
            connect_redirected: 0,
            refused_peers: 0,
            observed: Vec::new(),
            agent: crate::json::AgentStatus::default(),
        }
    }

    #[test]
    fn a_connection_mode_service_shows_its_skew_rotations_and_connections_per_backend() {
        let then = connection([100, 0], false);
        let now = connection([300, 50], false);
        let text = status_text(&now, Some((&then, Duration::from_secs(2))));
        assert!(
            text.contains(
                "skew 2.00 (live 1.80, threshold 1.50), rotation rotating; 2 backends take \
                 connections; 4 connections, 1 unrotatable (tonic)"
            ),
            "{text}"
        );
        assert!(
            text.contains("rotations: 3 for skew in the last minute; since start: skew 4, drain 0"),
            "{text}"
        );
        let row = text.lines().find(|l| l.contains("echo-0")).unwrap();
        assert_eq!(
            row.split_whitespace().collect::<Vec<_>>(),
            [
                "echo-0",
                "10.1.0.0:80",
                "Active",
                "3",
                "300",
                "0.500",
                "100.0",
                "0"
            ],
            "connections, requests, share, requests per second over the interval: {row}"
        );
        assert!(!text.contains("EWMA"), "no request-mode columns: {text}");
        assert!(!text.contains("use mode request"), "{text}");
    }

    #[test]
    fn a_connection_mode_service_as_even_as_it_can_be_points_to_request_mode() {
        let text = status_text(&connection([1, 0], true), None);
        assert!(
            text.contains("as even as connection mode can be: use mode request"),
            "{text}"
        );
        let row = text.lines().find(|l| l.contains("echo-1")).unwrap();
        assert!(row.contains(" - "), "no rate from one document: {row}");
    }

    #[test]
    fn a_service_that_cannot_be_served_is_shown_with_its_error() {
        let mut s = status(1, 1, 0, 0);
        s.unserved.push(crate::json::UnservedService {
            service: "ns/down".into(),
            mode: "request".into(),
            vip: "10.0.0.9:80".into(),
            error: "listening on 169.254.77.1:0: Cannot assign requested address".into(),
            since_seconds: 42.0,
        });
        let text = status_text(&s, None);
        assert!(
            text.contains("NOT SERVED: service ns/down (request) 10.0.0.9:80 for 42s")
                && text.contains("Cannot assign requested address"),
            "{text}"
        );
    }
}
