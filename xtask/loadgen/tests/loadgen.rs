//! The load generator against one in-process echo pod: counts, tallies and histogram agree.

use std::time::Duration;

use skewless_echo::SpawnedEcho;
use skewless_loadgen::{LoadConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_run_tallies_every_successful_call_by_pod() {
    let echo = SpawnedEcho::start("127.0.0.1:0".parse().expect("addr"), "pod-l")
        .await
        .expect("echo");
    let report = run(&LoadConfig {
        target: echo.addr,
        connections: 2,
        in_flight: 4,
        warmup: Duration::from_millis(100),
        duration: Duration::from_millis(400),
        payload: 8,
    })
    .await
    .expect("run");
    assert!(report.ok() > 0, "calls completed");
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(
        report.pods.get("pod-l").copied(),
        Some(report.ok()),
        "every measured call is tallied to the pod that served it"
    );
    assert!((report.share("pod-l") - 1.0).abs() < f64::EPSILON);
    assert!(report.quantile(0.5) <= report.quantile(0.99));
    echo.stop().await.expect("stop");
}
