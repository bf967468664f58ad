//! Which backend every pod connection to an observed Service is pinned to, and the skew that
//! results: the agent's view of the problem, for Services that are not balanced by it.
//!
//! Every 2 s: dump the sock_ops connection records, resolve each one's backend (conntrack in
//! this node's namespace under DNAT, asked over netlink once per connection to a Service VIP;
//! the socket's own peer under socket-level balancing), and aggregate per Service and
//! backend. Redirected connections are left out (they go to the
//! balancer by design, and the balancer's own counters show where their requests went), so
//! for a balanced (`request` or `connection` mode) Service this shows the connections it does
//! not balance: those opened before it opted in, still pinned.
//!
//! The connection map (`CONNS`) is an LRU hash: when it is full, recording a new connection
//! evicts the least recently updated record, also one of a connection still open. The
//! observer finds those between two cycles (a record of an open connection that is gone
//! without the observer having forgotten it), counts them ([`Published::evicted`]) and warns; the
//! connections themselves are never blocked.

use std::{
    collections::HashSet,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use skewless_admin::json::{ObservedBackend, ObservedService};
use skewless_datapath::{
    Connection, Datapath,
    conntrack::{self, Attributed, Conntrack, NatTable, Resolver},
};
use skewless_model::{Mode, ServiceKey, Snapshot as Model};
use skewless_observe::{ServiceReport, ServiceSpec, Snapshot, aggregate};
use tokio::sync::watch;
use tracing::{debug, warn};

/// How often connections are sampled.
pub const INTERVAL: Duration = Duration::from_secs(2);

/// What the observer publishes for `/status` and `/metrics`.
#[derive(Debug, Default)]
pub struct Published {
    /// The latest per-Service reports.
    pub reports: Mutex<Vec<ObservedService>>,
    /// Records in the connection map at the last cycle.
    pub entries: AtomicU64,
    /// Records of open connections evicted from the full map, since the start.
    pub evicted: AtomicU64,
}

/// Samples forever, publishing in `out`.
pub async fn run(
    datapath: Arc<Mutex<Datapath>>,
    model: watch::Receiver<Model>,
    out: Arc<Published>,
) {
    let mut previous: Option<Snapshot> = None;
    // The records of open connections at the last dump: one missing from the next dump was
    // evicted (closed ones the observer forgets itself are not in it).
    let mut open_before: HashSet<u64> = HashSet::new();
    let mut evicting = false;
    let started = tokio::time::Instant::now();
    // Kept across cycles: it remembers every socket's answer, so a cycle only asks conntrack
    // about the connections opened since the last one.
    let mut resolver: Option<Resolver> = None;
    let mut conntrack_failed = false;
    let mut tick = tokio::time::interval(INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (specs, owners) = specs(&model.borrow());
        if specs.is_empty() {
            if let Ok(mut o) = out.reports.lock() {
                o.clear();
            }
            open_before.clear();
            continue;
        }
        let conns = match datapath.lock() {
            Ok(dp) => dp.connections(),
            Err(_) => return,
        };
        let gone = evicted(&open_before, &conns);
        out.entries.store(conns.len() as u64, Ordering::Relaxed);
        out.evicted.fetch_add(gone, Ordering::Relaxed);
        if gone > 0 && !evicting {
            warn!(
                evicted = gone,
                entries = conns.len(),
                capacity = skewless_common::CONNS_CAPACITY,
                "connection map full: records of open connections evicted, those connections go unobserved"
            );
        }
        evicting = gone > 0;
        open_before = conns
            .iter()
            .filter(|c| c.closed.is_none())
            .map(|c| c.cookie)
            .collect();
        let vips: HashSet<SocketAddr> = specs.iter().map(|s| s.addr).collect();
        // Netlink round trips block; keep them off the async threads.
        let mut taken = resolver.take();
        let done = tokio::task::spawn_blocking(move || {
            let result = match &mut taken {
                Some(r) => r.attribute(&conns, &vips),
                None => Conntrack::here().open().and_then(|session| {
                    taken
                        .insert(Resolver::new(session))
                        .attribute(&conns, &vips)
                }),
            };
            (
                result.map_err(|e| (e, conntrack::attribute(&conns, &NatTable::default()))),
                taken,
            )
        })
        .await;
        let Ok((result, kept)) = done else { continue };
        let attributed = match result {
            Ok(a) => {
                conntrack_failed = false;
                resolver = kept;
                a
            }
            Err((error, unresolved)) => {
                if !conntrack_failed {
                    warn!(%error, "reading conntrack; DNAT connections stay unresolved");
                    conntrack_failed = true;
                }
                // A socket whose answers may be out of step: start afresh next cycle.
                unresolved
            }
        };
        let current = snapshot(started.elapsed(), &attributed);
        // `aggregate` reports the Services in the order of `specs`.
        let reports = aggregate(&specs, previous.as_ref(), &current);
        let published: Vec<ObservedService> = reports
            .iter()
            .zip(&owners)
            // A balanced Service is only worth showing while unbalanced connections remain.
            .filter(|(r, (_, mode))| *mode == Mode::Observe || !r.backends.is_empty())
            .map(|(r, (key, mode))| publish(key, *mode, r))
            .collect();
        debug!(
            connections = attributed.len(),
            services = published.len(),
            "observed"
        );
        if let Ok(mut o) = out.reports.lock() {
            *o = published;
        }
        // Closed connections have been counted once; drop them so the map holds live ones.
        if let Ok(mut dp) = datapath.lock() {
            for a in attributed.iter().filter(|a| a.conn.closed.is_some()) {
                let _ = dp.forget(a.conn.cookie);
            }
        }
        previous = Some(current);
    }
}

/// Every opted-in Service port, once per ClusterIP (IPv4 and IPv6 alike), with the ready
/// endpoints of that ClusterIP's family, and (same order) the Service and mode it belongs to.
fn specs(model: &Model) -> (Vec<ServiceSpec>, Vec<(ServiceKey, Mode)>) {
    let (mut specs, mut owners) = (Vec::new(), Vec::new());
    for svc in model.iter() {
        for ip in &svc.cluster_ips {
            for port in &svc.ports {
                // A dual-stack Service's IPv6 ClusterIP is DNATed to the pods' IPv6 addresses.
                let endpoints = port
                    .ready()
                    .map(|e| e.addr)
                    .filter(|a| a.is_ipv6() == ip.is_ipv6())
                    .collect();
                let spec = ServiceSpec {
                    addr: SocketAddr::new(*ip, port.port),
                    endpoints,
                };
                specs.push(spec);
                owners.push((svc.key.clone(), svc.mode));
            }
        }
    }
    (specs, owners)
}

/// Records that were of open connections at the last dump (`open_before`) and are not in
/// this one (`now`). The observer only forgets closed records, so these were evicted.
fn evicted(open_before: &HashSet<u64>, now: &[Connection]) -> u64 {
    if open_before.is_empty() {
        return 0;
    }
    let present = now
        .iter()
        .filter(|c| open_before.contains(&c.cookie))
        .count();
    (open_before.len() - present) as u64
}

fn snapshot(at: Duration, attributed: &[Attributed]) -> Snapshot {
    Snapshot {
        at,
        samples: attributed
            .iter()
            .filter(|a| a.conn.redirected_from.is_none())
            .map(|a| skewless_observe::Sample {
                cookie: a.conn.cookie,
                remote: a.conn.remote,
                redirected_from: a.conn.redirected_from,
                backend: a.backend,
                open: a.conn.closed.is_none(),
                bytes_sent: a.conn.bytes_sent,
                bytes_received: a.conn.bytes_received,
            })
            .collect(),
    }
}

fn publish(key: &ServiceKey, mode: Mode, r: &ServiceReport) -> ObservedService {
    ObservedService {
        service: key.to_string(),
        mode: mode.to_string(),
        vip: r.service.to_string(),
        ready_backends: r.ready_backends,
        backends_receiving: r.backends_receiving,
        largest_share: r.largest_share,
        skew: r.skew,
        unresolved: r.unresolved,
        backends: r
            .backends
            .iter()
            .map(|b| ObservedBackend {
                backend: b.backend.to_string(),
                open_connections: b.open_connections,
                share: b.share,
                sent_per_sec: b.sent_per_sec,
                received_per_sec: b.received_per_sec,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(cookie: u64, closed: bool) -> Connection {
        Connection {
            cookie,
            local: "198.18.1.2:40000".parse().unwrap(),
            remote: "198.19.0.10:8080".parse().unwrap(),
            redirected_from: None,
            state: if closed { 7 } else { 1 },
            opened: Duration::from_secs(1),
            closed: closed.then_some(Duration::from_secs(2)),
            bytes_sent: 0,
            bytes_received: 0,
        }
    }

    #[test]
    fn open_records_missing_from_the_next_dump_count_as_evicted() {
        let open_before: HashSet<u64> = [1, 2, 3, 4].into();
        // 1 still open, 2 closed since (its record stays until forgotten), 3 and 4 gone, 9 new.
        let now = [conn(1, false), conn(2, true), conn(9, false)];
        assert_eq!(evicted(&open_before, &now), 2, "3 and 4 were evicted");
        assert_eq!(
            evicted(&HashSet::new(), &now),
            0,
            "nothing can be evicted before the first dump"
        );
        assert_eq!(
            evicted(&[1].into(), &[conn(1, true)]),
            0,
            "a record that closed is not evicted"
        );
    }
}
