//! The scrape-time collector: one source of truth, nothing to keep in sync.
//!
//! The agent gathers plain numbers when `/metrics` is scraped (the balancers' counters, the
//! kernel's, the observer's latest report) into a [`Scrape`]; [`Metrics::encode`] turns it
//! into OpenMetrics text together with the model's counters. Labels are bounded by Services x
//! backends; nothing is labelled per connection.

use std::sync::{Arc, Mutex};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};

use crate::{
    json::{EndpointStatus, ObservedBackend, ObservedService, ServiceStatus},
    names::{self, Family},
};

/// The kernel hooks' counters, as exported (IPv4 and IPv6 summed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Kernel {
    pub connect_seen: u64,
    pub connect_redirected: u64,
    pub stale_heartbeat: u64,
    pub origdst_update_failed: u64,
    pub observed_connections: u64,
    pub observed_record_failed: u64,
}

/// Everything one scrape reports besides the model's counters.
#[derive(Clone, Debug, Default)]
pub struct Scrape {
    /// Whether the agent has its first complete model (see [`names::MODEL_READY`]).
    pub model_ready: bool,
    pub kernel: Kernel,
    /// Connections the balancers refused (peer outside the pod CIDRs).
    pub refused_peers: u64,
    pub services: Vec<ServiceStatus>,
    pub observed: Vec<ObservedService>,
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
    /// The registry with the model's counters registered under their [`names`].
    #[must_use]
    pub fn new(model: &skewless_model::Metrics) -> Self {
        let mut registry = Registry::with_prefix(names::PREFIX);
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
        let current = Arc::new(Mutex::new(Scrape::default()));
        registry.register_collector(Box::new(AgentCollector(Arc::clone(&current))));
        Self {
            registry,
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

#[derive(Debug)]
struct AgentCollector(Arc<Mutex<Scrape>>);

type Labels = Vec<(&'static str, String)>;

/// Encodes one family from (labels, value) rows.
fn family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    f: Family,
    rows: impl IntoIterator<Item = (Labels, M)>,
) -> Result<(), std::fmt::Error> {
    let help = f.help();
    let mut m = encoder.encode_descriptor(f.name, &help, None, f.kind.metric_type())?;
    for (labels, value) in rows {
        value.encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

fn count(n: usize) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
}

fn service_labels(service: &str, vip: &str) -> Labels {
    vec![("service", service.to_owned()), ("vip", vip.to_owned())]
}

fn backend_labels(service: &str, vip: &str, backend: &str) -> Labels {
    let mut l = service_labels(service, vip);
    l.push(("backend", backend.to_owned()));
    l
}

impl Collector for AgentCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let k = s.kernel;
        let kernel = [
            (names::CONNECT_SEEN, k.connect_seen),
            (names::CONNECT_REDIRECTED, k.connect_redirected),
            (names::BALANCER_REFUSED, s.refused_peers),
            (names::STALE_HEARTBEAT, k.stale_heartbeat),
            (names::ORIGDST_UPDATE_FAILED, k.origdst_update_failed),
            (names::OBSERVED_CONNECTIONS, k.observed_connections),
            (names::OBSERVED_RECORD_FAILED, k.observed_record_failed),
        ];
        for (f, v) in kernel {
            // No labels: encoded directly, so the line reads `name_total 3`, not `name_total{} 3`.
            let help = f.help();
            let m = encoder.encode_descriptor(f.name, &help, None, f.kind.metric_type())?;
            ConstCounter::new(v).encode(m)?;
        }

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
            names::BACKEND_SHARE,
            backends().map(|(l, e)| (l, ConstGauge::new(e.share))),
        )?;
        family(
            &mut encoder,
            names::SERVICE_READY_BACKENDS,
            s.services
                .iter()
                .map(|x| (service_labels(&x.service, &x.vip), count(x.ready_endpoints))),
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
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Scrape {
        Scrape {
            model_ready: true,
            kernel: Kernel {
                connect_seen: 7,
                connect_redirected: 5,
                ..Kernel::default()
            },
            refused_peers: 1,
            services: vec![ServiceStatus {
                service: "ns/echo".to_owned(),
                mode: "request".to_owned(),
                vip: "10.0.0.1:80".to_owned(),
                listener: "169.254.77.1:4000".to_owned(),
                ready_endpoints: 1,
                endpoints: vec![EndpointStatus {
                    name: "echo-0".to_owned(),
                    addr: "10.1.0.1:80".to_owned(),
                    state: "Active".to_owned(),
                    requests: 42,
                    failures: 2,
                    share: 1.0,
                    latency_ms: Some(1.5),
                }],
            }],
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
        let text = Metrics::new(&model()).encode(sample()).unwrap();
        let exported = families(&text, "# TYPE ");
        let listed: Vec<String> = names::ALL
            .iter()
            .map(|f| format!("{}_{}", names::PREFIX, f.name))
            .collect();
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
        assert!(text.contains("skewless_connect_seen_total 7\n"));
    }

    #[test]
    fn every_help_text_ends_with_exactly_one_period() {
        let text = Metrics::new(&model()).encode(sample()).unwrap();
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
