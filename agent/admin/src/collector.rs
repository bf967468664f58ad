//! The scrape-time collector: one source of truth, nothing to keep in sync.
//!
//! The agent gathers plain numbers when `/metrics` is scraped (the balancers' counters, the
//! kernel's, the observer's latest report) into a [`Scrape`]; [`Metrics::encode`] turns it
//! into OpenMetrics text together with the model's counters. Labels are bounded by Services x
//! backends; nothing is labelled per connection.

use std::sync::{Arc, Mutex};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};

use crate::{
    json::{
        EndpointStatus, Histogram, ObservedBackend, ObservedService, ServiceStatus, UnservedService,
    },
    names::{self, Family},
    process::Process,
};

/// The kernel hooks' counters, as exported (IPv4 and IPv6 summed), and the records of the
/// connection map the observer saw evicted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Kernel {
    pub connect_seen: u64,
    pub connect_redirected: u64,
    pub stale_heartbeat: u64,
    pub origdst_update_failed: u64,
    pub observed_connections: u64,
    pub observed_record_failed: u64,
    pub observed_records_evicted: u64,
}

/// How full one eBPF map is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapUsage {
    /// A bounded label value: `redirect4`, `redirect6`, `conns`.
    pub map: &'static str,
    pub entries: u64,
    pub capacity: u64,
}

/// One data-plane worker thread's scheduler figures and stalls.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WorkerUsage {
    /// On a CPU so far, in seconds.
    pub busy_seconds: f64,
    /// Runnable but waiting for a CPU so far, in seconds.
    pub cpu_wait_seconds: f64,
    /// Stalls so far (see [`names::WORKER_STALLS`]).
    pub stalls: u64,
}

/// Everything one scrape reports besides the model's counters.
#[derive(Clone, Debug, Default)]
pub struct Scrape {
    /// The agent process's own figures; `None` where `/proc` cannot be read.
    pub process: Option<Process>,
    /// The data-plane workers, in worker order (the `worker` label is the index).
    pub workers: Vec<WorkerUsage>,
    /// The container's requests and limits.
    pub resources: crate::json::Resources,
    /// Whether the agent has its first complete model (see [`names::MODEL_READY`]).
    pub model_ready: bool,
    pub kernel: Kernel,
    pub maps: Vec<MapUsage>,
    /// Connections the balancers refused (peer outside the pod CIDRs).
    pub refused_peers: u64,
    /// Redirected Service ports, with the recent window applied ([`crate::window`]).
    pub services: Vec<ServiceStatus>,
    pub observed: Vec<ObservedService>,
    /// Opted-in Service ports that cannot be served.
    pub unserved: Vec<UnservedService>,
}

/// The agent's registry: the model's counters plus the scrape-time collector.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// What the collector reports; set right before each scrape is encoded.
    current: Arc<Mutex<Scrape>>,
    /// One scrape at a time, so each encodes the numbers it gathered.
    scraping: Mutex<()>,
}

impl Metrics {
    /// The registry with the process families, the model's counters registered under their
    /// [`names`], and the agent's `version` for `skewless_build_info`.
    #[must_use]
    pub fn new(model: &skewless_model::Metrics, version: &'static str) -> Self {
        let mut root = Registry::default();
        let current = Arc::new(Mutex::new(Scrape::default()));
        // The process families keep their standard names: outside the `skewless_` prefix.
        root.register_collector(Box::new(ProcessCollector {
            scrape: Arc::clone(&current),
        }));
        let registry = root.sub_registry_with_prefix(names::PREFIX);
        let rejected = names::SERVICE_CONFIG_REJECTED;
        registry.register(
            rejected.name,
            rejected.help_for_registry(),
            model.rejected_family(),
        );
        let source = names::SOURCE_ERRORS;
        registry.register(
            source.name,
            source.help_for_registry(),
            model.source_errors_family(),
        );
        let dropped = names::WARNING_EVENTS_DROPPED;
        registry.register(
            dropped.name,
            dropped.help_for_registry(),
            model.warning_events_dropped_counter(),
        );
        registry.register_collector(Box::new(AgentCollector {
            scrape: Arc::clone(&current),
            version,
        }));
        Self {
            registry: root,
            current,
            scraping: Mutex::new(()),
        }
    }

    /// OpenMetrics text of the model's counters and `scrape`.
    ///
    /// # Errors
    /// Only if the text encoder fails (it writes to a `String`, so in practice never).
    pub fn encode(&self, scrape: Scrape) -> Result<String, std::fmt::Error> {
        let _one = self
            .scraping
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = scrape;
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// The `process_...` families (no prefix, no labels).
#[derive(Debug)]
struct ProcessCollector {
    scrape: Arc<Mutex<Scrape>>,
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self
            .scrape
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(p) = s.process else {
            return Ok(());
        };
        ConstCounter::new(p.cpu_seconds)
            .encode(descriptor(&mut encoder, names::PROCESS_CPU_SECONDS)?)?;
        let gauges = [
            (names::PROCESS_OPEN_FDS, p.open_fds as f64),
            (names::PROCESS_MAX_FDS, p.max_fds as f64),
            (names::PROCESS_VIRTUAL_MEMORY, p.virtual_memory_bytes as f64),
            (
                names::PROCESS_VIRTUAL_MEMORY_MAX,
                p.virtual_memory_max_bytes as f64,
            ),
            (
                names::PROCESS_RESIDENT_MEMORY,
                p.resident_memory_bytes as f64,
            ),
            (names::PROCESS_START_TIME, p.start_time_seconds),
            (names::PROCESS_THREADS, p.threads as f64),
        ];
        for (f, v) in gauges {
            ConstGauge::new(v).encode(descriptor(&mut encoder, f)?)?;
        }
        Ok(())
    }
}

#[derive(Debug)]
struct AgentCollector {
    scrape: Arc<Mutex<Scrape>>,
    version: &'static str,
}

/// Starts a family: its descriptor, from the table.
fn descriptor<'a>(
    encoder: &'a mut DescriptorEncoder,
    f: Family,
) -> Result<MetricEncoder<'a>, std::fmt::Error> {
    let help = f.help();
    // The registry adds its prefix: `skewless` for the agent's collector, none for the
    // process families'.
    encoder.encode_descriptor(f.name, &help, None, f.kind.metric_type())
}

/// Encodes one family from (labels, value) rows.
fn family<'r, L: EncodeLabelSet + 'r, M: EncodeMetric + 'r>(
    encoder: &mut DescriptorEncoder,
    f: Family,
    rows: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    let mut m = descriptor(encoder, f)?;
    for (labels, value) in rows {
        value.encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Encodes one histogram family from (labels, histogram) rows over `bounds`.
fn histograms<'r, L: EncodeLabelSet + 'r>(
    encoder: &mut DescriptorEncoder,
    f: Family,
    bounds: &[f64],
    rows: impl IntoIterator<Item = (L, &'r Histogram)>,
) -> Result<(), std::fmt::Error> {
    let mut m = descriptor(encoder, f)?;
    let mut buckets: Vec<(f64, u64)> = Vec::with_capacity(bounds.len() + 1);
    for (labels, h) in rows {
        buckets.clear();
        // The encoder writes `+Inf` for f64::MAX.
        let upper = bounds.iter().copied().chain(std::iter::once(f64::MAX));
        buckets.extend(upper.zip(h.counts.iter().copied().chain(std::iter::repeat(0))));
        m.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
            h.sum,
            h.count(),
            &buckets,
            None,
        )?;
    }
    Ok(())
}

fn gauge(n: u64) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
}

fn count(n: usize) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
}

type ServiceLabels<'a> = [(&'static str, &'a str); 2];
type BackendLabels<'a> = [(&'static str, &'a str); 3];
type ReasonLabels<'a> = [(&'static str, &'a str); 3];

fn service_labels<'a>(service: &'a str, vip: &'a str) -> ServiceLabels<'a> {
    [("service", service), ("vip", vip)]
}

fn backend_labels<'a>(service: &'a str, vip: &'a str, backend: &'a str) -> BackendLabels<'a> {
    [("service", service), ("vip", vip), ("backend", backend)]
}

/// The exported value of a backend state (the balancer's names, snake_case). Unknown names
/// map to `unknown`, so the label stays bounded.
#[must_use]
pub fn state_label(state: &str) -> &'static str {
    match state {
        "Connecting" | "connecting" => "connecting",
        "NotServing" | "not_serving" => "not_serving",
        "Active" | "active" => "active",
        "Degraded" | "degraded" => "degraded",
        "Ejected" | "ejected" => "ejected",
        _ => "unknown",
    }
}

/// The exported value of connection mode's rotation policy state (bounded: unknown names map
/// to `unknown`).
#[must_use]
pub fn rotation_state_label(state: &str) -> &'static str {
    match state {
        "idle" => "idle",
        "balanced" => "balanced",
        "holding" => "holding",
        "rotating" => "rotating",
        "waiting" => "waiting",
        "as_even_as_possible" => "as_even_as_possible",
        "disabled" => "disabled",
        _ => "unknown",
    }
}

impl Collector for AgentCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self
            .scrape
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // A gauge rather than OpenMetrics' info type: Prometheus' text tooling (promtool
        // 2.42) does not know `info`, and `_info` gauges are the convention it does know.
        family(
            &mut encoder,
            names::BUILD_INFO,
            [([("version", self.version)], gauge(1))],
        )?;
        let k = s.kernel;
        let kernel = [
            (names::CONNECT_SEEN, k.connect_seen),
            (names::CONNECT_REDIRECTED, k.connect_redirected),
            (names::BALANCER_REFUSED, s.refused_peers),
            (names::STALE_HEARTBEAT, k.stale_heartbeat),
            (names::ORIGDST_UPDATE_FAILED, k.origdst_update_failed),
            (names::OBSERVED_CONNECTIONS, k.observed_connections),
            (names::OBSERVED_RECORD_FAILED, k.observed_record_failed),
            (names::OBSERVED_RECORDS_EVICTED, k.observed_records_evicted),
        ];
        for (f, v) in kernel {
            // No labels: encoded directly, so the line reads `name_total 3`, not `name_total{} 3`.
            ConstCounter::new(v).encode(descriptor(&mut encoder, f)?)?;
        }
        family(
            &mut encoder,
            names::MAP_ENTRIES,
            s.maps.iter().map(|m| ([("map", m.map)], gauge(m.entries))),
        )?;
        family(
            &mut encoder,
            names::MAP_CAPACITY,
            s.maps.iter().map(|m| ([("map", m.map)], gauge(m.capacity))),
        )?;

        let ready = names::MODEL_READY;
        let help = ready.help();
        let m = encoder.encode_descriptor(ready.name, &help, None, ready.kind.metric_type())?;
        ConstGauge::new(i64::from(s.model_ready)).encode(m)?;

        let backends = || {
            s.services.iter().flat_map(|x| {
                x.endpoints
                    .iter()
                    .map(move |e: &EndpointStatus| (backend_labels(&x.service, &x.vip, &e.name), e))
            })
        };
        family(
            &mut encoder,
            names::BACKEND_REQUESTS,
            backends().map(|(l, e)| (l, ConstCounter::new(e.requests))),
        )?;
        family(
            &mut encoder,
            names::BACKEND_FAILURES,
            backends().map(|(l, e)| (l, ConstCounter::new(e.failures))),
        )?;
        family(
            &mut encoder,
            names::BACKEND_IN_FLIGHT,
            backends().map(|(l, e)| (l, gauge(e.in_flight))),
        )?;
        family(
            &mut encoder,
            names::BACKEND_UPSTREAM_CONNECTIONS,
            backends().map(|(l, e)| (l, gauge(e.upstream_connections))),
        )?;
        family(
            &mut encoder,
            names::BACKEND_STATE,
            backends().map(|([service, vip, backend], e)| {
                (
                    [service, vip, backend, ("state", state_label(&e.state))],
                    gauge(1),
                )
            }),
        )?;
        family(
            &mut encoder,
            names::BACKEND_LATENCY_P99,
            backends().filter_map(|(l, e)| e.recent_p99.map(|p| (l, ConstGauge::new(p)))),
        )?;

        let services = || {
            s.services
                .iter()
                .map(|x| (service_labels(&x.service, &x.vip), x))
        };
        // Every opted-in Service port once: a balanced Service whose old connections are
        // still observed is in both lists.
        let observed_only = s.observed.iter().filter(|o| {
            !s.services
                .iter()
                .any(|x| x.service == o.service && x.vip == o.vip)
        });
        family(
            &mut encoder,
            names::SERVICE_INFO,
            services()
                .map(|([service, vip], x)| {
                    let l: ReasonLabels<'_> = [service, vip, ("mode", x.mode.as_str())];
                    (l, gauge(1))
                })
                .chain(
                    s.observed
                        .iter()
                        .filter(|o| {
                            !s.services
                                .iter()
                                .any(|x| x.service == o.service && x.vip == o.vip)
                        })
                        .map(|o| {
                            let l: ReasonLabels<'_> = [
                                ("service", o.service.as_str()),
                                ("vip", o.vip.as_str()),
                                ("mode", o.mode.as_str()),
                            ];
                            (l, gauge(1))
                        }),
                ),
        )?;
        family(
            &mut encoder,
            names::SERVICE_UNSERVED,
            s.services
                .iter()
                .map(|x| (service_labels(&x.service, &x.vip), gauge(0)))
                .chain(
                    s.unserved
                        .iter()
                        .map(|u| (service_labels(&u.service, &u.vip), gauge(1))),
                ),
        )?;
        family(
            &mut encoder,
            names::SERVICE_READY_BACKENDS,
            services()
                .map(|(l, x)| (l, count(x.ready_endpoints)))
                .chain(
                    observed_only
                        .map(|o| (service_labels(&o.service, &o.vip), count(o.ready_backends))),
                ),
        )?;
        // Each Service carries its bounds; they are the balancer's constants, the same for all.
        let latency_bounds = s
            .services
            .first()
            .map_or(&[][..], |x| &x.latency_bounds[..]);
        histograms(
            &mut encoder,
            names::REQUEST_DURATION,
            latency_bounds,
            services().map(|(l, x)| (l, &x.latency)),
        )?;
        family(
            &mut encoder,
            names::REQUEST_FAILURES,
            services().flat_map(|([service, vip], x)| {
                x.failures.by_reason().into_iter().map(move |(reason, n)| {
                    let l: ReasonLabels<'_> = [service, vip, ("reason", reason)];
                    (l, ConstCounter::new(n))
                })
            }),
        )?;
        family(
            &mut encoder,
            names::REQUEST_RETRIES,
            services().map(|(l, x)| (l, ConstCounter::new(x.retries))),
        )?;
        family(
            &mut encoder,
            names::EJECTIONS,
            services().map(|(l, x)| (l, ConstCounter::new(x.ejections))),
        )?;
        family(
            &mut encoder,
            names::EJECTED_BACKENDS,
            services().map(|(l, x)| {
                let ejected = x
                    .endpoints
                    .iter()
                    .filter(|e| state_label(&e.state) == "ejected")
                    .count();
                (l, count(ejected))
            }),
        )?;
        family(
            &mut encoder,
            names::ROTATIONS,
            services().flat_map(|([service, vip], x)| {
                x.rotations.iter().map(move |r| {
                    let l: ReasonLabels<'_> = [service, vip, ("reason", r.reason.as_str())];
                    (l, ConstCounter::new(r.count))
                })
            }),
        )?;
        family(
            &mut encoder,
            names::CLIENT_PROTOCOL_ERRORS,
            services().flat_map(|([service, vip], x)| {
                x.client_errors.iter().map(move |e| {
                    let l: ReasonLabels<'_> = [service, vip, ("reason", e.reason.as_str())];
                    (l, ConstCounter::new(e.count))
                })
            }),
        )?;
        family(
            &mut encoder,
            names::CLIENT_CONNECTIONS,
            services().map(|(l, x)| (l, gauge(x.client_connections))),
        )?;
        let connection_bounds = s
            .services
            .first()
            .map_or(&[][..], |x| &x.connection_bounds[..]);
        histograms(
            &mut encoder,
            names::CLIENT_CONNECTION_DURATION,
            connection_bounds,
            services().map(|(l, x)| (l, &x.connection_duration)),
        )?;
        family(
            &mut encoder,
            names::BALANCER_SKEW,
            services().filter_map(|(l, x)| x.balancer_skew.map(|k| (l, ConstGauge::new(k)))),
        )?;
        let connection_mode =
            || services().filter_map(|(l, x)| x.connection.as_ref().map(|c| (l, c)));
        family(
            &mut encoder,
            names::UNROTATABLE_CONNECTIONS,
            connection_mode().map(|(l, c)| (l, count(c.unrotatable_connections))),
        )?;
        family(
            &mut encoder,
            names::NO_BACKEND_CONNECTIONS,
            connection_mode().map(|(l, c)| (l, ConstCounter::new(c.no_backend))),
        )?;
        family(
            &mut encoder,
            names::ROTATION_STATE,
            connection_mode().map(|([service, vip], c)| {
                let l: ReasonLabels<'_> = [service, vip, ("state", rotation_state_label(&c.state))];
                (l, gauge(1))
            }),
        )?;

        let observed_backends = || {
            s.observed.iter().flat_map(|o| {
                o.backends.iter().map(move |b: &ObservedBackend| {
                    (backend_labels(&o.service, &o.vip, &b.backend), b)
                })
            })
        };
        family(
            &mut encoder,
            names::OBSERVED_SKEW,
            s.observed
                .iter()
                .map(|o| (service_labels(&o.service, &o.vip), ConstGauge::new(o.skew))),
        )?;
        family(
            &mut encoder,
            names::OBSERVED_BACKENDS_RECEIVING,
            s.observed.iter().map(|o| {
                (
                    service_labels(&o.service, &o.vip),
                    count(o.backends_receiving),
                )
            }),
        )?;
        family(
            &mut encoder,
            names::OBSERVED_BACKEND_SHARE,
            observed_backends().map(|(l, b)| (l, ConstGauge::new(b.share))),
        )?;
        family(
            &mut encoder,
            names::OBSERVED_BACKEND_CONNECTIONS,
            observed_backends().map(|(l, b)| (l, count(b.open_connections))),
        )?;

        let workers: Vec<(String, WorkerUsage)> = s
            .workers
            .iter()
            .enumerate()
            .map(|(i, w)| (i.to_string(), *w))
            .collect();
        let worker = |i: &str| [("worker", i.to_owned())];
        family(
            &mut encoder,
            names::WORKER_BUSY,
            workers
                .iter()
                .map(|(i, w)| (worker(i), ConstCounter::new(w.busy_seconds))),
        )?;
        family(
            &mut encoder,
            names::WORKER_CPU_WAIT,
            workers
                .iter()
                .map(|(i, w)| (worker(i), ConstCounter::new(w.cpu_wait_seconds))),
        )?;
        family(
            &mut encoder,
            names::WORKER_STALLS,
            workers
                .iter()
                .map(|(i, w)| (worker(i), ConstCounter::new(w.stalls))),
        )?;
        let r = s.resources;
        family(
            &mut encoder,
            names::CONTAINER_CPU,
            [
                ("request", r.cpu_request_cores),
                ("limit", r.cpu_limit_cores),
            ]
            .into_iter()
            .filter_map(|(kind, v)| v.map(|v| ([("kind", kind)], ConstGauge::new(v)))),
        )?;
        family(
            &mut encoder,
            names::CONTAINER_MEMORY,
            [
                ("request", r.memory_request_bytes),
                ("limit", r.memory_limit_bytes),
            ]
            .into_iter()
            .filter_map(|(kind, v)| v.map(|v| ([("kind", kind)], gauge(v)))),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The balancer's bounds (skewless-balancer owns them; the JSON carries them).
    const LATENCY_BOUNDS: &[f64] = &[
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ];
    const CONNECTION_BOUNDS: &[f64] = &[0.1, 1.0, 10.0, 60.0, 3600.0];

    fn sample() -> Scrape {
        let latency = Histogram {
            counts: {
                let mut c = vec![0; LATENCY_BOUNDS.len() + 1];
                c[2] = 40;
                c[8] = 2;
                c
            },
            sum: 0.62,
        };
        let mut connection_duration = Histogram::empty(CONNECTION_BOUNDS);
        connection_duration.counts[3] = 1;
        connection_duration.sum = 12.0;
        Scrape {
            process: Some(Process {
                cpu_seconds: 1.5,
                open_fds: 12,
                max_fds: 1024,
                virtual_memory_bytes: 1 << 30,
                virtual_memory_max_bytes: u64::MAX,
                resident_memory_bytes: 20 << 20,
                start_time_seconds: 1_764_700_000.25,
                threads: 6,
            }),
            workers: vec![
                WorkerUsage {
                    busy_seconds: 2.5,
                    cpu_wait_seconds: 0.125,
                    stalls: 1,
                },
                WorkerUsage::default(),
            ],
            resources: crate::json::Resources {
                cpu_request_cores: Some(0.1),
                cpu_limit_cores: None,
                memory_request_bytes: Some(64 << 20),
                memory_limit_bytes: Some(256 << 20),
            },
            model_ready: true,
            kernel: Kernel {
                connect_seen: 7,
                connect_redirected: 5,
                ..Kernel::default()
            },
            maps: vec![MapUsage {
                map: "conns",
                entries: 3,
                capacity: 65536,
            }],
            refused_peers: 1,
            services: vec![
                ServiceStatus {
                    service: "ns/echo".to_owned(),
                    mode: "request".to_owned(),
                    vip: "10.0.0.1:80".to_owned(),
                    listener: "169.254.77.1:4000".to_owned(),
                    ready_endpoints: 1,
                    endpoints: vec![EndpointStatus {
                        name: "echo-0".to_owned(),
                        addr: "10.1.0.1:80".to_owned(),
                        state: "NotServing".to_owned(),
                        requests: 42,
                        failures: 2,
                        share: 1.0,
                        latency_ms: Some(1.5),
                        in_flight: 3,
                        upstream_connections: 1,
                        latency: latency.clone(),
                        recent_p99: Some(0.2),
                        recent_per_sec: None,
                        recent_share: None,
                    }],
                    latency_bounds: LATENCY_BOUNDS.to_vec(),
                    latency,
                    failures: crate::json::Failures {
                        deadline: 2,
                        ..crate::json::Failures::default()
                    },
                    retries: 4,
                    ejections: 1,
                    rotations: vec![crate::json::Rotation {
                        reason: "max_age".to_owned(),
                        count: 6,
                    }],
                    client_errors: vec![crate::json::ClientError {
                        reason: "ping_flood".to_owned(),
                        count: 1,
                    }],
                    client_connections: 2,
                    connection_bounds: CONNECTION_BOUNDS.to_vec(),
                    connection_duration,
                    balancer_skew: Some(1.0),
                    connection: None,
                    recent: None,
                },
                connection_mode(),
            ],
            observed: vec![ObservedService {
                service: "ns/obs".to_owned(),
                mode: "observe".to_owned(),
                vip: "10.0.0.2:80".to_owned(),
                ready_backends: 2,
                backends_receiving: 1,
                largest_share: 1.0,
                skew: 2.0,
                unresolved: 0,
                backends: vec![ObservedBackend {
                    backend: "10.1.0.2:80".to_owned(),
                    open_connections: 3,
                    share: 1.0,
                    sent_per_sec: 0.0,
                    received_per_sec: 0.0,
                }],
            }],
            unserved: vec![UnservedService {
                service: "ns/down".to_owned(),
                mode: "request".to_owned(),
                vip: "10.0.0.9:80".to_owned(),
                error: "listening on 169.254.77.1:0: Cannot assign requested address".to_owned(),
                since_seconds: 3.0,
            }],
        }
    }

    /// A connection-mode Service port: one backend with two relayed connections.
    fn connection_mode() -> ServiceStatus {
        ServiceStatus {
            service: "ns/conn".to_owned(),
            mode: "connection".to_owned(),
            vip: "10.0.0.3:80".to_owned(),
            ready_endpoints: 1,
            endpoints: vec![EndpointStatus {
                name: "conn-0".to_owned(),
                addr: "10.1.0.3:80".to_owned(),
                state: "Active".to_owned(),
                requests: 9,
                upstream_connections: 2,
                latency: Histogram::empty(LATENCY_BOUNDS),
                ..EndpointStatus::default()
            }],
            latency_bounds: LATENCY_BOUNDS.to_vec(),
            latency: Histogram::empty(LATENCY_BOUNDS),
            connection_bounds: CONNECTION_BOUNDS.to_vec(),
            connection_duration: Histogram::empty(CONNECTION_BOUNDS),
            balancer_skew: Some(1.0),
            connection: Some(crate::json::ConnectionStatus {
                skew: 1.0,
                state: "waiting".to_owned(),
                unrotatable_connections: 1,
                no_backend: 4,
                ..crate::json::ConnectionStatus::default()
            }),
            ..ServiceStatus::default()
        }
    }

    /// Model counters with one sample each: a rejected Service and a failed source.
    fn model() -> skewless_model::Metrics {
        use skewless_model::{Index, PortInput, ServiceInput, ServiceKey, annotations};
        let metrics = skewless_model::Metrics::default();
        let mut index = Index::new(metrics.clone());
        let bad = ServiceInput {
            key: ServiceKey::new("ns", "web"),
            annotations: [(annotations::MODE.to_owned(), "bogus".to_owned())].into(),
            cluster_ips: vec!["10.96.0.10".into()],
            ports: vec![PortInput {
                name: "grpc".into(),
                port: 80,
                protocol: "TCP".into(),
                target_port: None,
            }],
        };
        assert!(
            index.apply_service(&bad).is_some(),
            "a bad mode is rejected"
        );
        metrics.source_error("file");
        metrics
    }

    fn families(text: &str, line: &str) -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix(line))
            .map(|l| l.split(' ').next().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn every_listed_family_is_exported_and_nothing_else() {
        let text = Metrics::new(&model(), "1.2.3").encode(sample()).unwrap();
        let exported = families(&text, "# TYPE ");
        let listed: Vec<String> = names::ALL.iter().map(names::Family::full_name).collect();
        assert_eq!(
            exported, listed,
            "names::ALL must list what /metrics exports, in order"
        );
        for series in names::all_series() {
            assert!(
                text.lines().any(|l| l.starts_with(&format!("{series} "))
                    || l.starts_with(&format!("{series}{{"))),
                "{series} has a sample in {text}"
            );
        }
        assert!(text.contains(
            "skewless_backend_requests_total{service=\"ns/echo\",vip=\"10.0.0.1:80\",backend=\"echo-0\"} 42"
        ));
        for line in [
            "skewless_connect_seen_total 7\n",
            "skewless_build_info{version=\"1.2.3\"} 1\n",
            "skewless_map_capacity{map=\"conns\"} 65536\n",
            "skewless_backend_state{service=\"ns/echo\",vip=\"10.0.0.1:80\",backend=\"echo-0\",state=\"not_serving\"} 1\n",
            "skewless_request_duration_seconds_count{service=\"ns/echo\",vip=\"10.0.0.1:80\"} 42\n",
            // Cumulative buckets with the bounds as the SLO points are written.
            "skewless_request_duration_seconds_bucket{le=\"0.0025\",service=\"ns/echo\",vip=\"10.0.0.1:80\"} 40\n",
            "skewless_request_duration_seconds_bucket{le=\"0.25\",service=\"ns/echo\",vip=\"10.0.0.1:80\"} 42\n",
            "skewless_request_duration_seconds_bucket{le=\"+Inf\",service=\"ns/echo\",vip=\"10.0.0.1:80\"} 42\n",
            "skewless_request_failures_total{service=\"ns/echo\",vip=\"10.0.0.1:80\",reason=\"deadline\"} 2\n",
            "skewless_request_failures_total{service=\"ns/echo\",vip=\"10.0.0.1:80\",reason=\"refused\"} 0\n",
            "skewless_rotations_total{service=\"ns/echo\",vip=\"10.0.0.1:80\",reason=\"max_age\"} 6\n",
            "skewless_client_protocol_errors_total{service=\"ns/echo\",vip=\"10.0.0.1:80\",reason=\"ping_flood\"} 1\n",
            // An opted-in Service port the agent cannot serve.
            "skewless_service_unserved{service=\"ns/down\",vip=\"10.0.0.9:80\"} 1\n",
            // A served one is 0, so the alert's series always exists.
            "skewless_service_unserved{service=\"ns/echo\",vip=\"10.0.0.1:80\"} 0\n",
            // The observed Service's ready backends, the balanced one's from its balancer.
            "skewless_service_ready_backends{service=\"ns/obs\",vip=\"10.0.0.2:80\"} 2\n",
            "skewless_service_ready_backends{service=\"ns/echo\",vip=\"10.0.0.1:80\"} 1\n",
            // Connection mode: the relayed connections per backend, the policy's view.
            "skewless_backend_upstream_connections{service=\"ns/conn\",vip=\"10.0.0.3:80\",backend=\"conn-0\"} 2\n",
            "skewless_unrotatable_connections{service=\"ns/conn\",vip=\"10.0.0.3:80\"} 1\n",
            "skewless_no_backend_connections_total{service=\"ns/conn\",vip=\"10.0.0.3:80\"} 4\n",
            "skewless_rotation_state{service=\"ns/conn\",vip=\"10.0.0.3:80\",state=\"waiting\"} 1\n",
            // The process families under their standard names, in their base units.
            "process_cpu_seconds_total 1.5\n",
            "process_resident_memory_bytes 20971520.0\n",
            "process_max_fds 1024.0\n",
            "process_start_time_seconds 1764700000.25\n",
            "process_threads 6.0\n",
            "skewless_worker_busy_seconds_total{worker=\"0\"} 2.5\n",
            "skewless_worker_cpu_wait_seconds_total{worker=\"0\"} 0.125\n",
            "skewless_worker_stalls_total{worker=\"0\"} 1\n",
            "skewless_worker_stalls_total{worker=\"1\"} 0\n",
            "skewless_container_cpu_cores{kind=\"request\"} 0.1\n",
            "skewless_container_memory_bytes{kind=\"limit\"} 268435456\n",
            "skewless_service_info{service=\"ns/conn\",vip=\"10.0.0.3:80\",mode=\"connection\"} 1\n",
            "skewless_service_info{service=\"ns/obs\",vip=\"10.0.0.2:80\",mode=\"observe\"} 1\n",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    #[test]
    fn a_balanced_service_still_observed_has_its_ready_backends_once() {
        let mut scrape = sample();
        scrape.observed[0].service = "ns/echo".to_owned();
        scrape.observed[0].vip = "10.0.0.1:80".to_owned();
        let text = Metrics::new(&model(), "1").encode(scrape).unwrap();
        let ready = text
            .lines()
            .filter(|l| l.starts_with("skewless_service_ready_backends{service=\"ns/echo\""))
            .count();
        assert_eq!(ready, 1, "one series per Service port: {text}");
    }

    #[test]
    fn every_help_text_ends_with_exactly_one_period() {
        let text = Metrics::new(&model(), "1.2.3").encode(sample()).unwrap();
        let helps: Vec<&str> = text.lines().filter(|l| l.starts_with("# HELP ")).collect();
        assert_eq!(helps.len(), names::ALL.len(), "one HELP per family: {text}");
        for h in helps {
            assert!(
                h.ends_with('.') && !h.ends_with(".."),
                "HELP must end in one period: {h}"
            );
        }
    }
}
