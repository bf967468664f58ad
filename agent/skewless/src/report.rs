//! What the running balancers report, as the admin API's types: one Service port's numbers
//! over all its data-plane workers (their counters and histograms add up).

use std::sync::Arc;

use skewless_admin::json::{
    ClientError, ConnectionStatus, EndpointStatus, Failures, Histogram, Rotation, ServiceStatus,
};
use skewless_balancer::{
    ConnectionBalancer, EndpointStats, RequestBalancer,
    connection::{BackendStats, ConnectionStats, PolicyState},
    metrics::{
        CONNECTION_BOUNDS, ClientErrorReason, FailureReason, HistogramSnapshot, LATENCY_BOUNDS,
        RotationReason, ServiceSnapshot,
    },
};
use skewless_model::Mode;

/// Where a Service port is balanced.
pub struct Port<'a> {
    pub service: String,
    pub mode: &'static str,
    pub vip: String,
    pub listener: String,
    pub ready_endpoints: usize,
    /// One per data-plane worker.
    pub balancers: &'a [Arc<dyn RequestBalancer>],
}

fn histogram(h: HistogramSnapshot) -> Histogram {
    let HistogramSnapshot { counts, sum } = h;
    Histogram { counts, sum }
}

/// The port's status: endpoints merged over the workers, Service numbers summed.
pub fn service_status(port: Port<'_>) -> ServiceStatus {
    let Port {
        service,
        mode,
        vip,
        listener,
        ready_endpoints,
        balancers,
    } = port;
    let mut total = ServiceSnapshot::default();
    let (mut retries, mut ejections) = (0, 0);
    for b in balancers {
        total.add(&b.snapshot());
        let c = b.counters();
        retries += c.retries;
        ejections += c.ejections;
        // The flood guard counts its cut-offs itself (it sits below h2, on the socket).
        for (reason, n) in [
            (ClientErrorReason::PingFlood, c.ping_floods),
            (ClientErrorReason::SettingsFlood, c.settings_floods),
            (ClientErrorReason::RstStreamFlood, c.rst_stream_floods),
        ] {
            total.client_errors[client_error_index(reason)] += n;
        }
    }
    let ServiceSnapshot {
        latency,
        failures,
        rotations,
        client_connections,
        connection_duration,
        client_errors,
    } = total;
    ServiceStatus {
        service,
        mode: mode.to_owned(),
        vip,
        listener,
        ready_endpoints,
        endpoints: EndpointStats::merge_workers(balancers.iter().map(|b| b.stats()))
            .into_iter()
            .map(endpoint_status)
            .collect(),
        latency_bounds: LATENCY_BOUNDS.to_vec(),
        latency: histogram(latency),
        failures: failures_by_reason(failures),
        retries,
        ejections,
        rotations: rotations_by_reason(rotations),
        client_errors: client_errors_by_reason(client_errors),
        client_connections,
        connection_bounds: CONNECTION_BOUNDS.to_vec(),
        connection_duration: histogram(connection_duration),
        // Filled from the agent's recent window when /status or /metrics is served.
        balancer_skew: None,
        connection: None,
        recent: None,
    }
}

/// A connection-mode Service port's status: its one balancer (shared by the workers, so read
/// once), per backend the relayed connections and the request shares.
pub fn connection_status(
    service: String,
    vip: String,
    listener: String,
    ready_endpoints: usize,
    balancer: &ConnectionBalancer,
) -> ServiceStatus {
    let ConnectionStats {
        state,
        skew,
        live_skew,
        ready_backends,
        backends_receiving,
        connections,
        unrotatable_connections,
        // The metric cells below carry them (the same cells).
        rotations: _,
        rotations_last_minute,
        as_even_as_possible,
        no_backend,
        backends,
    } = balancer.stats();
    let ServiceSnapshot {
        // The relay's: client stream open to end, and what the frames show of failures.
        latency,
        failures,
        rotations,
        client_connections,
        connection_duration,
        client_errors,
    } = balancer.metrics();
    ServiceStatus {
        service,
        mode: Mode::Connection.to_string(),
        vip,
        listener,
        ready_endpoints,
        endpoints: backends.into_iter().map(backend_status).collect(),
        latency_bounds: LATENCY_BOUNDS.to_vec(),
        latency: histogram(latency),
        failures: failures_by_reason(failures),
        // A relay cannot retry a call. A backend whose connects fail is ejected from
        // placement: its state says so and its `failures` count the failed connects; the
        // balancer keeps no ejection counter.
        retries: 0,
        ejections: 0,
        rotations: rotations_by_reason(rotations),
        client_errors: client_errors_by_reason(client_errors),
        client_connections,
        connection_bounds: CONNECTION_BOUNDS.to_vec(),
        connection_duration: histogram(connection_duration),
        balancer_skew: None,
        connection: Some(ConnectionStatus {
            skew,
            live_skew,
            skew_threshold: balancer.config().rotation.skew_threshold,
            ready_backends,
            connections,
            state: policy_state(state).to_owned(),
            backends_receiving,
            rotations_last_minute,
            unrotatable_connections,
            as_even_as_possible,
            no_backend,
        }),
        recent: None,
    }
}

/// The failure counters by reason.
fn failures_by_reason(failures: [u64; FailureReason::ALL.len()]) -> Failures {
    let failed = |reason: FailureReason| {
        FailureReason::ALL
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| failures[i])
    };
    Failures {
        unavailable: failed(FailureReason::Unavailable),
        deadline: failed(FailureReason::Deadline),
        reset: failed(FailureReason::Reset),
        connect: failed(FailureReason::Connect),
        refused: failed(FailureReason::Refused),
    }
}

/// The rotation counters with their reason labels.
fn rotations_by_reason(counts: [u64; RotationReason::ALL.len()]) -> Vec<Rotation> {
    RotationReason::ALL
        .iter()
        .zip(counts)
        .map(|(r, count)| Rotation {
            reason: r.label().to_owned(),
            count,
        })
        .collect()
}

fn client_error_index(reason: ClientErrorReason) -> usize {
    ClientErrorReason::ALL
        .iter()
        .position(|r| *r == reason)
        .unwrap_or(0)
}

/// The client-error counters with their reason labels.
fn client_errors_by_reason(counts: [u64; ClientErrorReason::ALL.len()]) -> Vec<ClientError> {
    ClientErrorReason::ALL
        .iter()
        .zip(counts)
        .map(|(r, count)| ClientError {
            reason: r.label().to_owned(),
            count,
        })
        .collect()
}

fn policy_state(state: PolicyState) -> &'static str {
    match state {
        PolicyState::Idle => "idle",
        PolicyState::Balanced => "balanced",
        PolicyState::Holding => "holding",
        PolicyState::Rotating => "rotating",
        PolicyState::Waiting => "waiting",
        PolicyState::AsEvenAsPossible => "as_even_as_possible",
        PolicyState::Disabled => "disabled",
    }
}

fn backend_status(b: BackendStats) -> EndpointStatus {
    let BackendStats {
        addr,
        name,
        state,
        connections,
        requests,
        share,
        // The placement's load; the share says the same over the window.
        rate: _,
        connect_failures,
    } = b;
    EndpointStatus {
        name,
        addr: addr.to_string(),
        state: state.to_string(),
        requests,
        failures: connect_failures,
        share,
        latency_ms: None,
        in_flight: 0,
        upstream_connections: connections as u64,
        latency: Histogram::empty(LATENCY_BOUNDS),
        recent_p99: None,
        recent_per_sec: None,
        recent_share: None,
    }
}

fn endpoint_status(e: EndpointStats) -> EndpointStatus {
    let EndpointStats {
        addr,
        name,
        state,
        requests,
        failures,
        // Probes are requests too; the table does not show them apart.
        probes: _,
        in_flight,
        share,
        latency,
        upstream_connections,
        latency_histogram,
    } = e;
    EndpointStatus {
        name,
        addr: addr.to_string(),
        state: state.to_string(),
        requests,
        failures,
        share,
        latency_ms: latency.map(|l| l.as_secs_f64() * 1000.0),
        in_flight: in_flight.into(),
        upstream_connections: upstream_connections.into(),
        latency: histogram(latency_histogram),
        // Filled from the agent's recent window.
        recent_p99: None,
        recent_per_sec: None,
        recent_share: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules' SLO thresholds are `le` values: each must be a bound of the balancer's
    /// buckets, written exactly as the agent's /metrics writes it.
    #[test]
    fn every_le_the_rules_use_is_a_bucket_bound_as_exported() {
        let rules = std::fs::read_to_string(
            skewless_admin::monitoring::dir().join(skewless_admin::monitoring::RULES_FILE),
        )
        .unwrap();
        let status = ServiceStatus {
            service: "ns/a".into(),
            vip: "10.0.0.1:80".into(),
            latency_bounds: LATENCY_BOUNDS.to_vec(),
            latency: Histogram {
                counts: vec![0; LATENCY_BOUNDS.len() + 1],
                sum: 0.0,
            },
            ..ServiceStatus::default()
        };
        let text =
            skewless_admin::collector::Metrics::new(&skewless_model::Metrics::default(), "t")
                .encode(skewless_admin::collector::Scrape {
                    services: vec![status],
                    ..Default::default()
                })
                .unwrap();
        let mut checked = 0;
        for (i, _) in rules.match_indices("le=\"") {
            let value = &rules[i + 4..];
            let value = &value[..value.find('"').unwrap()];
            assert!(
                text.contains(&format!("le=\"{value}\"")),
                "le=\"{value}\" in the rules is not a bucket the agent exports"
            );
            checked += 1;
        }
        assert!(checked > 0, "the rules use a latency bucket");
    }
}
