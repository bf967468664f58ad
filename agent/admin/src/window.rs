//! The agent's recent window: what the balancers did in the last 30 to 60 seconds.
//!
//! Counters are cumulative; two numbers are only meaningful over a recent stretch of time and
//! are exported as gauges: the balancer's skew (largest request share over the ready
//! endpoints / fair share) and each backend's p99. `/status` (and the status page) also shows
//! each Service's recent calls per second, success and percentiles, and each backend's recent
//! rate and share, from the same readings. Prometheus could compute both from
//! counters, but the per-backend p99 would need a per-backend histogram, which at 100
//! Services x 50 backends is the larger part of the cardinality budget (docs/metrics.md).
//!
//! The agent reads the cumulative numbers every [`PERIOD`] ([`Window::rotate`]) and keeps the
//! last two readings; [`Window::apply`] measures from the older one, so the window is always
//! between one and two periods long (since the start, before the first two readings).

use std::{collections::HashMap, time::Duration};

use crate::json::{Histogram, RecentCalls, ServiceStatus};

/// How often the agent takes a reading.
pub const PERIOD: Duration = Duration::from_secs(30);

/// One reading of a backend: its request count and latency histogram.
#[derive(Clone, Debug, Default)]
struct Backend {
    requests: u64,
    latency: Histogram,
}

/// One reading of a Service port: its calls' histogram, failures and backends by address.
#[derive(Clone, Debug, Default)]
struct Service {
    latency: Histogram,
    failures: u64,
    backends: HashMap<String, Backend>,
}

/// One reading of every Service port, by (service, vip), and when it was taken (time since
/// an arbitrary origin, the same for every reading).
#[derive(Clone, Debug, Default)]
struct Reading {
    at: Duration,
    services: HashMap<(String, String), Service>,
}

/// The last two readings.
#[derive(Debug, Default)]
pub struct Window {
    older: Reading,
    newer: Reading,
}

fn read(services: &[ServiceStatus], at: Duration) -> Reading {
    let services = services
        .iter()
        .map(|s| {
            let backends = s
                .endpoints
                .iter()
                .map(|e| {
                    let b = Backend {
                        requests: e.requests,
                        latency: e.latency.clone(),
                    };
                    (e.addr.clone(), b)
                })
                .collect();
            let service = Service {
                latency: s.latency.clone(),
                failures: s.failures.total(),
                backends,
            };
            ((s.service.clone(), s.vip.clone()), service)
        })
        .collect();
    Reading { at, services }
}

impl Window {
    /// Takes a reading of `services` (the balancers' cumulative numbers `at` now); the oldest
    /// goes.
    pub fn rotate(&mut self, services: &[ServiceStatus], at: Duration) {
        self.older = std::mem::replace(&mut self.newer, read(services, at));
    }

    /// Fills in each Service's `balancer_skew` and `recent` calls, and each backend's
    /// `recent_p99`, `recent_per_sec` and `recent_share`, from what happened since the older
    /// reading (a Service or backend first seen in the newer one: since then; one in neither:
    /// everything so far, and no rates). `now` is on the readings' clock.
    pub fn apply(&self, services: &mut [ServiceStatus], now: Duration) {
        for s in services {
            let key = (s.service.clone(), s.vip.clone());
            let (baseline, since) = match self.older.services.get(&key) {
                Some(b) => (Some(b), Some(self.older.at)),
                None => (
                    self.newer.services.get(&key),
                    self.newer.services.get(&key).map(|_| self.newer.at),
                ),
            };
            let seconds = since.map(|t| now.saturating_sub(t).as_secs_f64());
            let mut recent_requests = Vec::with_capacity(s.endpoints.len());
            for e in &mut s.endpoints {
                let base = baseline.and_then(|b| b.backends.get(&e.addr));
                let (requests, latency) = match base {
                    // A lower count means the endpoint was removed and added again.
                    Some(b) if b.requests <= e.requests => {
                        (e.requests - b.requests, e.latency.since(&b.latency))
                    }
                    _ => (e.requests, e.latency.clone()),
                };
                e.recent_p99 = latency.quantile(&s.latency_bounds, 0.99);
                e.recent_per_sec = seconds.filter(|&t| t > 0.0).map(|t| requests as f64 / t);
                recent_requests.push(requests);
            }
            let total: u64 = recent_requests.iter().sum();
            for (e, n) in s.endpoints.iter_mut().zip(&recent_requests) {
                e.recent_share = (total > 0).then(|| *n as f64 / total as f64);
            }
            s.recent = match (baseline, seconds) {
                (Some(b), Some(t)) if t > 0.0 => {
                    let calls = s.latency.since(&b.latency);
                    let n = calls.count();
                    let failed = s.failures.total().saturating_sub(b.failures).min(n);
                    Some(RecentCalls {
                        seconds: t,
                        calls_per_sec: n as f64 / t,
                        success: (n > 0).then(|| 1.0 - failed as f64 / n as f64),
                        p50: calls.quantile(&s.latency_bounds, 0.5),
                        p99: calls.quantile(&s.latency_bounds, 0.99),
                    })
                }
                _ => None,
            };
            s.balancer_skew = match &s.connection {
                // Connection mode: the rotation policy's own window, the skew it acts on.
                Some(c) => (c.skew > 0.0).then_some(c.skew),
                None => skew(&recent_requests, s.ready_endpoints),
            };
        }
    }
}

/// Largest share / fair share over `ready` endpoints; `None` without requests.
fn skew(requests: &[u64], ready: usize) -> Option<f64> {
    let total: u64 = requests.iter().sum();
    let largest = requests.iter().copied().max()?;
    if total == 0 || ready == 0 {
        return None;
    }
    #[expect(
        clippy::cast_precision_loss,
        reason = "request counts and endpoint counts far below 2^52"
    )]
    Some(largest as f64 * ready as f64 / total as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::EndpointStatus;

    const BOUNDS: &[f64] = &[0.001, 0.01, 0.1];

    fn service(requests: &[(u64, [u64; 4])], ready: usize) -> ServiceStatus {
        ServiceStatus {
            service: "ns/echo".into(),
            vip: "10.0.0.1:80".into(),
            ready_endpoints: ready,
            latency_bounds: BOUNDS.to_vec(),
            endpoints: requests
                .iter()
                .enumerate()
                .map(|(i, (n, counts))| EndpointStatus {
                    addr: format!("10.1.0.{i}:80"),
                    requests: *n,
                    latency: Histogram {
                        counts: counts.to_vec(),
                        sum: 0.0,
                    },
                    ..EndpointStatus::default()
                })
                .collect(),
            ..ServiceStatus::default()
        }
    }

    #[test]
    fn skew_and_p99_cover_only_what_happened_since_the_older_reading() {
        let mut w = Window::default();
        // Long ago: backend 0 took everything, slowly.
        w.rotate(
            &[service(&[(100, [0, 0, 100, 0]), (0, [0; 4])], 2)],
            Duration::from_secs(0),
        );
        w.rotate(
            &[service(&[(150, [50, 0, 100, 0]), (50, [50, 0, 0, 0])], 2)],
            Duration::from_secs(30),
        );
        // Since the older reading: 150 each, all fast.
        let mut now = [service(
            &[(250, [150, 0, 100, 0]), (150, [150, 0, 0, 0])],
            2,
        )];
        w.apply(&mut now, Duration::from_secs(50));
        let skew = now[0].balancer_skew.unwrap();
        assert!(
            (skew - 1.0).abs() < 1e-9,
            "even since the older reading: {skew}"
        );
        let p99 = now[0].endpoints[1].recent_p99.unwrap();
        assert!(p99 <= 0.001, "backend 1 was fast: {p99}");
        w.rotate(&now, Duration::from_secs(60));
        // The next window starts after the slow start of backend 0.
        let mut later = [service(
            &[(350, [250, 0, 100, 0]), (150, [150, 0, 0, 0])],
            2,
        )];
        w.apply(&mut later, Duration::from_secs(75));
        let skew = later[0].balancer_skew.unwrap();
        assert!(
            (skew - 2.0 * 200.0 / 300.0).abs() < 1e-9,
            "200 of 300 recent requests on one of two backends: {skew}"
        );
        let p99 = later[0].endpoints[0].recent_p99.unwrap();
        assert!(
            p99 <= 0.001,
            "the slow requests are out of the window: {p99}"
        );
    }

    #[test]
    fn skew_counts_ready_endpoints_that_got_nothing() {
        assert_eq!(skew(&[10, 0], 4), Some(4.0), "all on one of four");
        assert_eq!(skew(&[0, 0], 2), None, "no requests, no skew");
        assert_eq!(skew(&[], 2), None);
    }

    #[test]
    fn a_connection_mode_service_reports_its_rotation_policys_skew() {
        let mut w = Window::default();
        let mut svc = service(&[(100, [0; 4]), (0, [0; 4])], 2);
        w.rotate(std::slice::from_ref(&svc), Duration::from_secs(0));
        svc.endpoints[0].requests = 200;
        svc.connection = Some(crate::json::ConnectionStatus {
            skew: 1.25,
            ..crate::json::ConnectionStatus::default()
        });
        let mut now = [svc];
        w.apply(&mut now, Duration::from_secs(75));
        assert_eq!(
            now[0].balancer_skew,
            Some(1.25),
            "the policy's view, not the window's (2.0)"
        );
        now[0].connection.as_mut().unwrap().skew = 0.0;
        w.apply(&mut now, Duration::from_secs(75));
        assert_eq!(now[0].balancer_skew, None, "no traffic, no skew");
    }

    #[test]
    fn a_re_added_endpoint_counts_from_zero() {
        let mut w = Window::default();
        w.rotate(
            &[service(&[(100, [100, 0, 0, 0])], 1)],
            Duration::from_secs(0),
        );
        let mut now = [service(&[(10, [0, 10, 0, 0])], 1)];
        w.apply(&mut now, Duration::from_secs(75));
        let p99 = now[0].endpoints[0].recent_p99.unwrap();
        assert!(p99 > 0.001, "only the 10 new requests count: {p99}");
    }

    #[test]
    fn recent_calls_rates_shares_and_percentiles_cover_the_window_only() {
        let mut w = Window::default();
        let mut before = service(&[(100, [100, 0, 0, 0]), (0, [0; 4])], 2);
        before.latency = Histogram {
            counts: vec![100, 0, 0, 0],
            sum: 0.05,
        };
        before.failures.reset = 5;
        w.rotate(std::slice::from_ref(&before), Duration::from_secs(10));
        // 40 s later: 300 more calls, 200 and 100 on the two backends, 30 of them slow and
        // 3 failed.
        let mut now = [service(&[(300, [300, 0, 0, 0]), (100, [70, 0, 30, 0])], 2)];
        now[0].latency = Histogram {
            counts: vec![370, 0, 30, 0],
            sum: 1.0,
        };
        now[0].failures.reset = 8;
        w.apply(&mut now, Duration::from_secs(50));
        let r = now[0].recent.expect("recent calls after a reading");
        assert_eq!(r.seconds, 40.0);
        assert_eq!(r.calls_per_sec, 300.0 / 40.0);
        assert_eq!(r.success, Some(1.0 - 3.0 / 300.0));
        assert!(r.p50.unwrap() <= 0.001, "most calls were fast: {r:?}");
        assert!(r.p99.unwrap() > 0.01, "10% were slow: {r:?}");
        let e = &now[0].endpoints;
        assert_eq!(e[0].recent_per_sec, Some(200.0 / 40.0));
        assert_eq!(e[1].recent_per_sec, Some(100.0 / 40.0));
        assert_eq!(e[0].recent_share, Some(200.0 / 300.0));
        assert_eq!(e[1].recent_share, Some(100.0 / 300.0));
        // Before any reading: no rates, no recent calls.
        let mut fresh = [service(&[(5, [5, 0, 0, 0])], 1)];
        Window::default().apply(&mut fresh, Duration::from_secs(1));
        assert_eq!(fresh[0].recent, None);
        assert_eq!(fresh[0].endpoints[0].recent_per_sec, None);
        assert_eq!(fresh[0].endpoints[0].recent_share, Some(1.0));
    }
}
