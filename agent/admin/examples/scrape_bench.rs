//! The cardinality benchmark: what one scrape of a node with `--services` Service ports of
//! `--backends` backends each costs (series, bytes, time to encode), run by `cargo xtask
//! bench` (docs/metrics.md has the results and the command).
//!
//! The numbers are synthetic but shaped as the agent's are: every backend with traffic and a
//! latency histogram, every Service with failures, rotations and connections, pod-like names.
//! Timed: the recent window's application and the encoding, i.e. the agent's scrape-time work
//! after it has read the balancers' cells.

use std::time::{Duration, Instant};

use skewless_admin::{
    collector::{Kernel, MapUsage, Metrics, Scrape},
    json::{ClientError, EndpointStatus, Failures, Histogram, Rotation, ServiceStatus},
    window::Window,
};

/// The balancer's bounds (skewless-balancer owns them; the JSON carries them).
const LATENCY_BOUNDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
const CONNECTION_BOUNDS: &[f64] = &[
    0.1, 1.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0,
];

fn histogram(bounds: &[f64], seed: u64) -> Histogram {
    Histogram {
        counts: (0..=bounds.len() as u64)
            .map(|i| (seed * 7919 + i * 104_729) % 100_000)
            .collect(),
        sum: seed as f64 * 0.37,
    }
}

fn services(n: usize, backends: usize, round: u64) -> Vec<ServiceStatus> {
    (0..n)
        .map(|s| ServiceStatus {
            service: format!("namespace-{s}/service-{s}"),
            mode: "request".to_owned(),
            vip: format!("10.96.{}.{}:50051", s / 250, s % 250 + 1),
            listener: format!("169.254.77.1:{}", 40_000 + s),
            ready_endpoints: backends,
            endpoints: (0..backends)
                .map(|b| {
                    let seed = (s * backends + b) as u64 + round * 1000;
                    EndpointStatus {
                        name: format!("service-{s}-7d9f8b6c4-{b:05}"),
                        addr: format!("10.{}.{}.{}:50051", 100 + s / 250, s % 250, b + 1),
                        state: "Active".to_owned(),
                        requests: seed * 13,
                        failures: seed % 3,
                        share: 1.0 / backends as f64,
                        latency_ms: Some(1.5),
                        in_flight: seed % 7,
                        upstream_connections: 1,
                        latency: histogram(LATENCY_BOUNDS, seed),
                        recent_p99: None,
                        recent_per_sec: None,
                        recent_share: None,
                    }
                })
                .collect(),
            latency_bounds: LATENCY_BOUNDS.to_vec(),
            latency: histogram(LATENCY_BOUNDS, s as u64 + round),
            failures: Failures {
                deadline: s as u64,
                ..Failures::default()
            },
            retries: s as u64,
            ejections: 1,
            rotations: ["skew", "backend_removed", "not_serving", "max_age", "drain"]
                .iter()
                .map(|r| Rotation {
                    reason: (*r).to_owned(),
                    count: 2,
                })
                .collect(),
            client_errors: [
                "no_preface",
                "malformed",
                "ping_flood",
                "settings_flood",
                "rst_stream_flood",
                "too_many_streams",
            ]
            .iter()
            .map(|r| ClientError {
                reason: (*r).to_owned(),
                count: 1,
            })
            .collect(),
            client_connections: 4,
            connection_bounds: CONNECTION_BOUNDS.to_vec(),
            connection_duration: histogram(CONNECTION_BOUNDS, s as u64),
            balancer_skew: None,
            recent: None,
            connection: None,
        })
        .collect()
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().expect("a number"))
}

fn main() {
    let (n, b, rounds) = (
        arg("--services", 100),
        arg("--backends", 50),
        arg("--rounds", 21),
    );
    let model = skewless_model::Metrics::default();
    let metrics = Metrics::new(&model, "bench");
    let mut window = Window::default();
    window.rotate(&services(n, b, 0), Duration::from_secs(0));
    window.rotate(&services(n, b, 1), Duration::from_secs(30));
    let mut times: Vec<Duration> = Vec::new();
    let mut text = String::new();
    for round in 0..rounds {
        // Gathering the balancers' numbers is not timed; what the scrape does with them is.
        let mut current = services(n, b, 2 + round as u64);
        let started = Instant::now();
        window.apply(&mut current, Duration::from_secs(45));
        let applied = started.elapsed();
        let scrape = Scrape {
            process: None,
            workers: Vec::new(),
            resources: skewless_admin::json::Resources::default(),
            model_ready: true,
            kernel: Kernel::default(),
            maps: vec![MapUsage {
                map: "redirect4",
                entries: n as u64,
                capacity: 4096,
            }],
            refused_peers: 0,
            services: current,
            observed: Vec::new(),
            unserved: Vec::new(),
        };
        text = metrics.encode(scrape).expect("encode");
        times.push(started.elapsed());
        if std::env::var_os("SCRAPE_BENCH_DEBUG").is_some() {
            eprintln!("window {:?}, total {:?}", applied, started.elapsed());
        }
    }
    times.sort();
    let series = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .count();
    let median = times[times.len() / 2];
    println!(
        "scrape at {n} Services x {b} backends: {series} series, {:.2} MB, median {:.1} ms \
         (min {:.1}, max {:.1}) over {rounds} rounds",
        text.len() as f64 / 1e6,
        median.as_secs_f64() * 1e3,
        times[0].as_secs_f64() * 1e3,
        times[times.len() - 1].as_secs_f64() * 1e3,
    );
    println!("targets: under 40000 series and 50 ms");
    if series >= 40_000 || median >= Duration::from_millis(50) {
        eprintln!("scrape benchmark: over budget");
        std::process::exit(1);
    }
}
