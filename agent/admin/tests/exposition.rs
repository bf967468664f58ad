//! The exposition itself against Prometheus' own linter: `promtool check metrics` (the
//! naming guide: base units, `_total` counters, no reserved suffixes, help texts) finds
//! nothing in a scrape that carries every family, except its known misreading of OpenMetrics
//! counters as lacking help text (promtool 2.42 parses the classic text format; issue 10 says
//! not to chase it). The agent's real scrape is checked the same way in the skewless crate's
//! end-to-end test.

use skewless_admin::{
    collector::{Kernel, MapUsage, Metrics, Scrape, WorkerUsage},
    json::{EndpointStatus, Histogram, ObservedBackend, ObservedService, Rotation, ServiceStatus},
    monitoring,
    process::Process,
};

#[test]
fn promtool_finds_nothing_but_its_openmetrics_counter_misreading() {
    let bounds = vec![0.001, 0.25, 10.0];
    let h = Histogram {
        counts: vec![1, 2, 3, 4],
        sum: 1.5,
    };
    let scrape = Scrape {
        process: Some(Process {
            cpu_seconds: 0.5,
            open_fds: 10,
            max_fds: 1024,
            virtual_memory_bytes: 1 << 28,
            virtual_memory_max_bytes: u64::MAX,
            resident_memory_bytes: 1 << 24,
            start_time_seconds: 1_764_700_000.0,
            threads: 4,
        }),
        workers: vec![WorkerUsage {
            busy_seconds: 1.0,
            cpu_wait_seconds: 0.1,
            stalls: 0,
        }],
        resources: skewless_admin::json::Resources {
            cpu_request_cores: Some(0.1),
            cpu_limit_cores: Some(1.0),
            memory_request_bytes: Some(64 << 20),
            memory_limit_bytes: Some(256 << 20),
        },
        model_ready: true,
        kernel: Kernel::default(),
        maps: vec![MapUsage {
            map: "redirect4",
            entries: 1,
            capacity: 4096,
        }],
        refused_peers: 0,
        services: vec![ServiceStatus {
            service: "ns/a".into(),
            mode: "request".into(),
            vip: "10.0.0.1:80".into(),
            listener: "169.254.77.1:4000".into(),
            ready_endpoints: 1,
            endpoints: vec![EndpointStatus {
                name: "a-0".into(),
                addr: "10.1.0.1:80".into(),
                state: "Active".into(),
                requests: 10,
                latency: h.clone(),
                recent_p99: Some(0.1),
                ..EndpointStatus::default()
            }],
            latency_bounds: bounds.clone(),
            latency: h.clone(),
            rotations: vec![Rotation {
                reason: "drain".into(),
                count: 1,
            }],
            connection_bounds: bounds,
            connection_duration: h,
            balancer_skew: Some(1.0),
            ..ServiceStatus::default()
        }],
        observed: vec![ObservedService {
            service: "ns/b".into(),
            mode: "observe".into(),
            vip: "10.0.0.2:80".into(),
            ready_backends: 2,
            backends_receiving: 1,
            largest_share: 1.0,
            skew: 2.0,
            unresolved: 0,
            backends: vec![ObservedBackend {
                backend: "10.1.0.2:80".into(),
                open_connections: 1,
                share: 1.0,
                sent_per_sec: 0.0,
                received_per_sec: 0.0,
            }],
        }],
        unserved: vec![skewless_admin::json::UnservedService {
            service: "ns/c".into(),
            mode: "request".into(),
            vip: "10.0.0.3:80".into(),
            error: "listening on 169.254.77.1:0: Cannot assign requested address".into(),
            since_seconds: 12.0,
        }],
    };
    let model = skewless_model::Metrics::default();
    model.source_error("file");
    let text = Metrics::new(&model, "1.0.0").encode(scrape).unwrap();
    let problems = monitoring::promtool_check_metrics(&text)
        .expect("promtool must be installed (Debian's prometheus package: `cargo xtask setup`)");
    assert!(
        problems.is_empty(),
        "promtool check metrics: {problems:#?}\n{text}"
    );
}
