//! The load generator against one in-process echo pod: counts, tallies and histogram agree, and
//! the open loop times calls from their intended start.

use std::time::Duration;

use skewless_echo::SpawnedEcho;
use skewless_loadgen::{Load, LoadConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_run_tallies_every_successful_call_by_pod() {
    let echo = SpawnedEcho::start("127.0.0.1:0".parse().expect("addr"), "pod-l")
        .await
        .expect("echo");
    let report = run(&LoadConfig {
        target: echo.addr,
        connections: 2,
        load: Load::Closed { in_flight: 4 },
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_sends_every_due_call_and_each_waits_at_least_the_server_delay() {
    let echo = SpawnedEcho::start("127.0.0.1:0".parse().expect("addr"), "pod-o")
        .await
        .expect("echo");
    echo.control.set_delay(Duration::from_millis(50));
    // 100 calls/s for 1 s: exactly 100 calls are due in the window; the server serves them
    // concurrently, so none has to wait for another.
    let report = run(&LoadConfig {
        target: echo.addr,
        connections: 2,
        load: Load::Open {
            rate: 100.0,
            max_in_flight: 1000,
        },
        warmup: Duration::from_millis(200),
        duration: Duration::from_secs(1),
        payload: 8,
    })
    .await
    .expect("run");
    let open = report.open.expect("open-loop stats");
    assert_eq!(open.scheduled, 100, "rate x duration calls are due");
    assert_eq!(report.not_sent(), 0, "a 100/s schedule is kept");
    assert_eq!(
        report.ok() + report.failed() + report.unfinished(),
        open.sent
    );
    assert_eq!(
        report.ok(),
        100,
        "every call succeeded: {:?}",
        report.errors
    );
    assert_eq!(report.pods.get("pod-o").copied(), Some(100));
    assert!(
        report.latency_us.min() >= 50_000,
        "every call includes the 50 ms server delay, min {} us",
        report.latency_us.min()
    );
    echo.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_counts_a_backlog_from_the_intended_send_time() {
    let echo = SpawnedEcho::start("127.0.0.1:0".parse().expect("addr"), "pod-b")
        .await
        .expect("echo");
    echo.control.set_delay(Duration::from_millis(50));
    // One call at a time and 50 ms each: at most ~20 calls/s get through, but 100/s are due.
    // Each sent call waits behind the ones before it, and that wait is part of its latency:
    // the k-th call leaves ~40k ms after it was due. A closed loop would report ~50 ms.
    let report = run(&LoadConfig {
        target: echo.addr,
        connections: 1,
        load: Load::Open {
            rate: 100.0,
            max_in_flight: 1,
        },
        warmup: Duration::ZERO,
        duration: Duration::from_secs(1),
        payload: 8,
    })
    .await
    .expect("run");
    let open = report.open.expect("open-loop stats");
    assert_eq!(open.scheduled, 100, "rate x duration calls are due");
    assert!(
        open.sent < open.scheduled,
        "the sender fell behind: {} of {} sent",
        open.sent,
        open.scheduled
    );
    assert_eq!(report.not_sent(), open.scheduled - open.sent);
    assert!(
        open.late > 0,
        "calls left after their intended time: {open:?}"
    );
    assert!(report.ok() > 0, "calls completed: {:?}", report.errors);
    assert!(
        report.latency_us.max() >= 200_000,
        "the backlog shows in the latency (max {} us, over 4x the server delay)",
        report.latency_us.max()
    );
    assert!(
        report.quantile(0.99) > Duration::from_millis(100),
        "p99 {:?} counts queueing, not only the 50 ms service time",
        report.quantile(0.99)
    );
    echo.stop().await.expect("stop");
}
