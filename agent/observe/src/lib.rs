//! Turns observed client connections into per-Service skew figures.
//!
//! Input: the Services to report on (address and ready endpoints) and snapshots of the
//! connections the datapath observed, each already attributed to the backend it is pinned to
//! (`skewless_datapath::conntrack::attribute`). Output, per Service: per backend the open
//! connections, the bytes each way, bytes/s between two snapshots and the backend's share of
//! the Service's traffic; and for the Service the number of backends receiving traffic, the
//! largest share and the skew (largest share / fair share, 1.0 = perfectly even, N = all
//! traffic on one of N ready backends).
//!
//! Addresses are `SocketAddr`: IPv4 and IPv6 Services are aggregated the same way (a
//! dual-stack Service is two `ServiceSpec`s, one per ClusterIP, each with the endpoints of
//! its family).
//!
//! Pure logic with no kernel or clock access, so it is tested with synthetic records.
#![forbid(unsafe_code)]

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    time::Duration,
};

/// A Service to report on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceSpec {
    /// The ClusterIP:port clients connect to.
    pub addr: SocketAddr,
    /// Ready endpoints (pod ip:target port). Socket-LB connections go straight to these.
    pub endpoints: Vec<SocketAddr>,
}

/// One observed connection, attributed to a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Socket cookie: identifies the connection across snapshots.
    pub cookie: u64,
    /// What the socket is connected to (a VIP under DNAT, a pod under socket-LB).
    pub remote: SocketAddr,
    /// The Service address a redirected socket asked for, if it was redirected.
    pub redirected_from: Option<SocketAddr>,
    /// The backend it is pinned to (equal to `remote` when nothing resolved it further).
    pub backend: SocketAddr,
    /// Whether the connection is still open.
    pub open: bool,
    /// Cumulative bytes client -> backend.
    pub bytes_sent: u64,
    /// Cumulative bytes backend -> client.
    pub bytes_received: u64,
}

/// All connections observed at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// When the snapshot was taken (any monotonic clock, same for all snapshots).
    pub at: Duration,
    pub samples: Vec<Sample>,
}

/// Traffic of one (Service, backend) pair.
#[derive(Clone, Debug, PartialEq)]
pub struct BackendReport {
    pub backend: SocketAddr,
    /// Open connections pinned to this backend.
    pub open_connections: usize,
    /// Cumulative bytes client -> backend over the connections in the snapshot.
    pub bytes_sent: u64,
    /// Cumulative bytes backend -> client over the connections in the snapshot.
    pub bytes_received: u64,
    /// Bytes/s client -> backend since the previous snapshot (0 without one).
    pub sent_per_sec: f64,
    /// Bytes/s backend -> client since the previous snapshot (0 without one).
    pub received_per_sec: f64,
    /// Share of the Service's traffic, 0.0..=1.0 (see [`ServiceReport::basis`]).
    pub share: f64,
}

/// What shares are computed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShareBasis {
    /// Bytes both ways since the previous snapshot (or cumulative without one).
    Bytes,
    /// No bytes moved: open connections instead (idle but pinned clients).
    OpenConnections,
    /// Nothing to share: no bytes, no open connections.
    None,
}

/// Skew figures of one Service.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceReport {
    pub service: SocketAddr,
    /// Ready endpoints, from the [`ServiceSpec`].
    pub ready_backends: usize,
    /// Per backend, sorted by address; only backends with at least one connection.
    pub backends: Vec<BackendReport>,
    /// Backends with a non-zero share.
    pub backends_receiving: usize,
    /// The largest share (0.0 when nothing moved).
    pub largest_share: f64,
    /// Largest share / fair share (1 / ready backends): 1.0 is even, `ready_backends` is
    /// everything on one backend. 0.0 when nothing moved.
    pub skew: f64,
    pub basis: ShareBasis,
    /// Connections to this Service whose backend could not be resolved (no conntrack entry:
    /// the "backend" is still the VIP). They are left out of the figures above.
    pub unresolved: usize,
}

/// Aggregates `current` per Service; with `previous` (an earlier snapshot of the same
/// datapath) it also computes rates and bases shares on the bytes moved in between.
///
/// A connection belongs to a Service when it was redirected from the Service's address, is
/// connected to it (DNAT), or is connected straight to one of its endpoints (socket-LB; the
/// first Service listing that endpoint wins). Connections to nothing listed are ignored.
#[must_use]
pub fn aggregate(
    services: &[ServiceSpec],
    previous: Option<&Snapshot>,
    current: &Snapshot,
) -> Vec<ServiceReport> {
    let by_addr: HashMap<SocketAddr, usize> = services
        .iter()
        .enumerate()
        .map(|(i, s)| (s.addr, i))
        .collect();
    let mut by_endpoint: HashMap<SocketAddr, usize> = HashMap::new();
    for (i, s) in services.iter().enumerate() {
        for e in &s.endpoints {
            by_endpoint.entry(*e).or_insert(i);
        }
    }
    let before: HashMap<u64, &Sample> = previous
        .map(|p| p.samples.iter().map(|s| (s.cookie, s)).collect())
        .unwrap_or_default();
    let elapsed = previous
        .map(|p| current.at.saturating_sub(p.at))
        .filter(|d| !d.is_zero());

    // Per Service: backend -> (report, bytes in the window).
    let mut acc: Vec<BTreeMap<SocketAddr, (BackendReport, u64)>> =
        vec![BTreeMap::new(); services.len()];
    let mut unresolved = vec![0usize; services.len()];
    for s in &current.samples {
        let svc = s
            .redirected_from
            .and_then(|a| by_addr.get(&a))
            .or_else(|| by_addr.get(&s.remote))
            .or_else(|| by_endpoint.get(&s.remote))
            .copied();
        let Some(svc) = svc else { continue };
        if s.backend == services[svc].addr {
            unresolved[svc] += 1;
            continue;
        }
        let (prev_sent, prev_recv) = before
            .get(&s.cookie)
            .map_or((0, 0), |p| (p.bytes_sent, p.bytes_received));
        let d_sent = s.bytes_sent.saturating_sub(prev_sent);
        let d_recv = s.bytes_received.saturating_sub(prev_recv);
        let (r, window) = acc[svc].entry(s.backend).or_insert_with(|| {
            (
                BackendReport {
                    backend: s.backend,
                    open_connections: 0,
                    bytes_sent: 0,
                    bytes_received: 0,
                    sent_per_sec: 0.0,
                    received_per_sec: 0.0,
                    share: 0.0,
                },
                0,
            )
        });
        r.open_connections += usize::from(s.open);
        r.bytes_sent += s.bytes_sent;
        r.bytes_received += s.bytes_received;
        if let Some(e) = elapsed {
            r.sent_per_sec += d_sent as f64 / e.as_secs_f64();
            r.received_per_sec += d_recv as f64 / e.as_secs_f64();
        }
        *window += d_sent + d_recv;
    }

    services
        .iter()
        .zip(acc)
        .zip(unresolved)
        .map(|((spec, backends), unresolved)| report(spec, backends, unresolved))
        .collect()
}

fn report(
    spec: &ServiceSpec,
    backends: BTreeMap<SocketAddr, (BackendReport, u64)>,
    unresolved: usize,
) -> ServiceReport {
    let total_bytes: u64 = backends.values().map(|(_, w)| w).sum();
    let total_open: usize = backends.values().map(|(r, _)| r.open_connections).sum();
    let basis = if total_bytes > 0 {
        ShareBasis::Bytes
    } else if total_open > 0 {
        ShareBasis::OpenConnections
    } else {
        ShareBasis::None
    };
    let backends: Vec<BackendReport> = backends
        .into_values()
        .map(|(mut r, window)| {
            r.share = match basis {
                ShareBasis::Bytes => window as f64 / total_bytes as f64,
                ShareBasis::OpenConnections => r.open_connections as f64 / total_open as f64,
                ShareBasis::None => 0.0,
            };
            r
        })
        .collect();
    let backends_receiving = backends.iter().filter(|r| r.share > 0.0).count();
    let largest_share = backends.iter().map(|r| r.share).fold(0.0, f64::max);
    // Without a known endpoint count, the backends seen are the best guess at the fair share.
    let ready = if spec.endpoints.is_empty() {
        backends.len()
    } else {
        spec.endpoints.len()
    };
    ServiceReport {
        service: spec.addr,
        ready_backends: spec.endpoints.len(),
        backends,
        backends_receiving,
        largest_share,
        skew: largest_share * ready as f64,
        basis,
        unresolved,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VIP: &str = "10.96.0.10:8080";

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn pods(n: u8) -> Vec<SocketAddr> {
        (1..=n)
            .map(|i| SocketAddr::from(([10, 0, i, 2], 8080)))
            .collect()
    }

    fn spec(n: u8) -> ServiceSpec {
        ServiceSpec {
            addr: addr(VIP),
            endpoints: pods(n),
        }
    }

    fn sample(cookie: u64, backend: SocketAddr, sent: u64, received: u64) -> Sample {
        Sample {
            cookie,
            remote: addr(VIP),
            redirected_from: None,
            backend,
            open: true,
            bytes_sent: sent,
            bytes_received: received,
        }
    }

    fn snap(secs: u64, samples: Vec<Sample>) -> Snapshot {
        Snapshot {
            at: Duration::from_secs(secs),
            samples,
        }
    }

    #[test]
    fn one_pinned_connection_of_four_backends_is_full_skew() {
        let p = pods(4);
        let r = &aggregate(
            &[spec(4)],
            None,
            &snap(1, vec![sample(1, p[2], 1000, 5000)]),
        )[0];
        assert_eq!(
            r.backends_receiving, 1,
            "only the pinned backend moves bytes"
        );
        assert!((r.largest_share - 1.0).abs() < 1e-9, "{r:?}");
        assert!(
            (r.skew - 4.0).abs() < 1e-9,
            "all on 1 of 4 is skew 4: {r:?}"
        );
        assert_eq!(r.ready_backends, 4);
        assert_eq!(r.backends[0].bytes_sent, 1000);
        assert_eq!(r.backends[0].bytes_received, 5000);
    }

    #[test]
    fn even_traffic_is_skew_one_and_shares_sum_to_one() {
        let p = pods(4);
        let samples = (0..8)
            .map(|i| sample(i, p[i as usize % 4], 100, 100))
            .collect();
        let r = &aggregate(&[spec(4)], None, &snap(1, samples))[0];
        assert_eq!(r.backends_receiving, 4);
        assert!((r.skew - 1.0).abs() < 1e-9, "{r:?}");
        let sum: f64 = r.backends.iter().map(|b| b.share).sum();
        assert!((sum - 1.0).abs() < 1e-9, "shares must sum to 1: {sum}");
        assert!(r.backends.iter().all(|b| b.open_connections == 2));
    }

    #[test]
    fn rates_and_shares_use_bytes_moved_between_snapshots() {
        let p = pods(2);
        // Backend 0 moved a lot before, nothing since; backend 1 moves 2000 B/s each way.
        let before = snap(
            10,
            vec![sample(1, p[0], 1_000_000, 0), sample(2, p[1], 0, 0)],
        );
        let after = snap(
            12,
            vec![sample(1, p[0], 1_000_000, 0), sample(2, p[1], 4000, 4000)],
        );
        let r = &aggregate(&[spec(2)], Some(&before), &after)[0];
        assert_eq!(r.backends_receiving, 1, "only backend 1 moved bytes: {r:?}");
        let b1 = r.backends.iter().find(|b| b.backend == p[1]).unwrap();
        assert!((b1.sent_per_sec - 2000.0).abs() < 1e-9, "{b1:?}");
        assert!((b1.received_per_sec - 2000.0).abs() < 1e-9, "{b1:?}");
        assert!((b1.share - 1.0).abs() < 1e-9);
        let b0 = r.backends.iter().find(|b| b.backend == p[0]).unwrap();
        assert_eq!(b0.sent_per_sec, 0.0);
        assert_eq!(b0.bytes_sent, 1_000_000, "cumulative bytes stay reported");
    }

    #[test]
    fn a_connection_new_since_the_previous_snapshot_counts_all_its_bytes() {
        let p = pods(2);
        let before = snap(0, vec![sample(1, p[0], 100, 0)]);
        let after = snap(1, vec![sample(1, p[0], 200, 0), sample(2, p[1], 300, 0)]);
        let r = &aggregate(&[spec(2)], Some(&before), &after)[0];
        let shares: Vec<f64> = r.backends.iter().map(|b| b.share).collect();
        assert!((shares[0] - 0.25).abs() < 1e-9 && (shares[1] - 0.75).abs() < 1e-9);
    }

    #[test]
    fn idle_connections_share_by_count() {
        let p = pods(4);
        let samples = vec![sample(1, p[0], 0, 0), sample(2, p[0], 0, 0)];
        let r = &aggregate(&[spec(4)], None, &snap(1, samples))[0];
        assert_eq!(r.basis, ShareBasis::OpenConnections);
        assert!((r.largest_share - 1.0).abs() < 1e-9);
        assert!((r.skew - 4.0).abs() < 1e-9);
    }

    #[test]
    fn socket_lb_and_redirected_connections_find_their_service() {
        let p = pods(2);
        let direct = Sample {
            remote: p[1],
            ..sample(1, p[1], 10, 10)
        };
        let redirected = Sample {
            remote: addr("169.254.77.1:15001"),
            redirected_from: Some(addr(VIP)),
            ..sample(2, p[0], 10, 10)
        };
        let stranger = Sample {
            remote: addr("10.0.9.9:80"),
            ..sample(3, addr("10.0.9.9:80"), 10, 10)
        };
        let r = &aggregate(
            &[spec(2)],
            None,
            &snap(1, vec![direct, redirected, stranger]),
        )[0];
        assert_eq!(r.backends.len(), 2, "{r:?}");
        assert_eq!(r.backends_receiving, 2);
    }

    #[test]
    fn unresolved_dnat_connections_are_counted_not_attributed() {
        let p = pods(2);
        let lost = sample(1, addr(VIP), 10, 10);
        let r = &aggregate(
            &[spec(2)],
            None,
            &snap(1, vec![lost, sample(2, p[0], 5, 5)]),
        )[0];
        assert_eq!(r.unresolved, 1);
        assert_eq!(r.backends.len(), 1, "the VIP is never a backend: {r:?}");
    }

    #[test]
    fn nothing_moved_reports_zero_skew() {
        let r = &aggregate(&[spec(3)], None, &Snapshot::default())[0];
        assert_eq!(r.basis, ShareBasis::None);
        assert_eq!(r.backends_receiving, 0);
        assert_eq!(r.skew, 0.0);
    }

    #[test]
    fn dual_stack_service_is_reported_per_family() {
        // One Service, two ClusterIPs; each spec lists the endpoints of its family.
        let v6_pods: Vec<SocketAddr> = (1..=4u16)
            .map(|i| SocketAddr::new([0xfd00, 0, 0, i, 0, 0, 0, 2].into(), 8080))
            .collect();
        let v6 = ServiceSpec {
            addr: addr("[fd00:96::a]:8080"),
            endpoints: v6_pods.clone(),
        };
        let p = pods(4);
        let samples = vec![
            // IPv6 client pinned through the IPv6 VIP (DNAT resolved to a pod's IPv6 address).
            Sample {
                remote: v6.addr,
                ..sample(1, v6_pods[3], 100, 900)
            },
            // IPv4 client spread over two pods through the IPv4 VIP.
            sample(2, p[0], 100, 400),
            sample(3, p[1], 100, 400),
        ];
        let r = aggregate(&[spec(4), v6], None, &snap(1, samples));
        assert_eq!(r[0].backends_receiving, 2, "IPv4 ClusterIP: {:?}", r[0]);
        assert_eq!(r[1].backends_receiving, 1, "IPv6 ClusterIP: {:?}", r[1]);
        assert_eq!(r[1].backends[0].backend, v6_pods[3]);
        assert!(
            (r[1].skew - 4.0).abs() < 1e-9,
            "the IPv6 family is pinned on its own: {:?}",
            r[1]
        );
        assert_eq!(r[1].unresolved, 0);
    }
}
