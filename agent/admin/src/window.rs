//! The agent's recent window: what the balancers did in the last 30 to 60 seconds.
//!
//! Counters are cumulative; two numbers are only meaningful over a recent stretch of time and
//! are exported as gauges: the balancer's skew (largest request share over the ready
//! endpoints / fair share) and each backend's p99. Prometheus could compute both from
//! counters, but the per-backend p99 would need a per-backend histogram, which at 100
//! Services x 50 backends is the larger part of the cardinality budget (docs/metrics.md).
//!
//! The agent reads the cumulative numbers every [`PERIOD`] ([`Window::rotate`]) and keeps the
//! last two readings; [`Window::apply`] measures from the older one, so the window is always
//! between one and two periods long (since the start, before the first two readings).

use std::{collections::HashMap, time::Duration};

use crate::json::{Histogram, ServiceStatus};

/// How often the agent takes a reading.
pub const PERIOD: Duration = Duration::from_secs(30);

/// One reading of a backend: its request count and latency histogram.
#[derive(Clone, Debug, Default)]
struct Backend {
    requests: u64,
    latency: Histogram,
}

/// One reading of every backend of every Service port, by (service, vip) and address.
type Reading = HashMap<(String, String), HashMap<String, Backend>>;

/// The last two readings.
#[derive(Debug, Default)]
pub struct Window {
    older: Reading,
    newer: Reading,
}

fn read(services: &[ServiceStatus]) -> Reading {
    services
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
            ((s.service.clone(), s.vip.clone()), backends)
        })
        .collect()
}

impl Window {
    /// Takes a reading of `services` (the balancers' cumulative numbers now); the oldest goes.
    pub fn rotate(&mut self, services: &[ServiceStatus]) {
        self.older = std::mem::replace(&mut self.newer, read(services));
    }

    /// Fills in each Service's `balancer_skew` and each backend's `recent_p99` from what
    /// happened since the older reading.
    pub fn apply(&self, services: &mut [ServiceStatus]) {
        for s in services {
            let key = (s.service.clone(), s.vip.clone());
            let baseline = self.older.get(&key).or_else(|| self.newer.get(&key));
            let mut recent_requests = Vec::with_capacity(s.endpoints.len());
            for e in &mut s.endpoints {
                let base = baseline.and_then(|b| b.get(&e.addr));
                let (requests, latency) = match base {
                    // A lower count means the endpoint was removed and added again.
                    Some(b) if b.requests <= e.requests => {
                        (e.requests - b.requests, e.latency.since(&b.latency))
                    }
                    _ => (e.requests, e.latency.clone()),
                };
                e.recent_p99 = latency.quantile(&s.latency_bounds, 0.99);
                recent_requests.push(requests);
            }
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
        w.rotate(&[service(&[(100, [0, 0, 100, 0]), (0, [0; 4])], 2)]);
        w.rotate(&[service(&[(150, [50, 0, 100, 0]), (50, [50, 0, 0, 0])], 2)]);
        // Since the older reading: 150 each, all fast.
        let mut now = [service(
            &[(250, [150, 0, 100, 0]), (150, [150, 0, 0, 0])],
            2,
        )];
        w.apply(&mut now);
        let skew = now[0].balancer_skew.unwrap();
        assert!(
            (skew - 1.0).abs() < 1e-9,
            "even since the older reading: {skew}"
        );
        let p99 = now[0].endpoints[1].recent_p99.unwrap();
        assert!(p99 <= 0.001, "backend 1 was fast: {p99}");
        w.rotate(&now);
        // The next window starts after the slow start of backend 0.
        let mut later = [service(
            &[(350, [250, 0, 100, 0]), (150, [150, 0, 0, 0])],
            2,
        )];
        w.apply(&mut later);
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
        w.rotate(std::slice::from_ref(&svc));
        svc.endpoints[0].requests = 200;
        svc.connection = Some(crate::json::ConnectionStatus {
            skew: 1.25,
            ..crate::json::ConnectionStatus::default()
        });
        let mut now = [svc];
        w.apply(&mut now);
        assert_eq!(
            now[0].balancer_skew,
            Some(1.25),
            "the policy's view, not the window's (2.0)"
        );
        now[0].connection.as_mut().unwrap().skew = 0.0;
        w.apply(&mut now);
        assert_eq!(now[0].balancer_skew, None, "no traffic, no skew");
    }

    #[test]
    fn a_re_added_endpoint_counts_from_zero() {
        let mut w = Window::default();
        w.rotate(&[service(&[(100, [100, 0, 0, 0])], 1)]);
        let mut now = [service(&[(10, [0, 10, 0, 0])], 1)];
        w.apply(&mut now);
        let p99 = now[0].endpoints[0].recent_p99.unwrap();
        assert!(p99 > 0.001, "only the 10 new requests count: {p99}");
    }
}
