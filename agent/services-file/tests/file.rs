//! The local file source: parse, apply, watch for changes, keep the last good state.

use std::{net::SocketAddr, path::Path, time::Duration};

use skewless_model::{Metrics, Mode, ServiceKey, Snapshot};
use skewless_services_file::{FileError, FileSource, parse};
use tokio::sync::watch;

const EXAMPLE: &str = include_str!("../examples/services.yaml");
const WAIT: Duration = Duration::from_secs(5);

fn mk_file(services: &str) -> String {
    format!("services:\n{services}")
}

fn mk_service(name: &str, mode: &str, endpoints: &[&str]) -> String {
    let mut s = format!(
        "  - name: {name}\n    clusterIPs: [\"10.96.0.10\"]\n    mode: {mode}\n    ports:\n      - {{name: grpc, port: 80, targetPort: 8080}}\n    endpoints:\n"
    );
    for e in endpoints {
        s.push_str(&format!("      - address: {e}\n"));
    }
    s
}

async fn wait_for(
    rx: &mut watch::Receiver<Snapshot>,
    what: &str,
    mut f: impl FnMut(&Snapshot) -> bool,
) {
    let fut = async {
        loop {
            if f(&rx.borrow_and_update()) {
                return;
            }
            rx.changed().await.expect("source alive");
        }
    };
    tokio::time::timeout(WAIT, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for: {what}"));
}

fn key(name: &str) -> ServiceKey {
    ServiceKey::new("default", name)
}

#[test]
fn example_file_gives_named_ports_dual_stack_and_conditions() {
    let (_dir, path) = write_temp(EXAMPLE);
    let mut src = FileSource::new(path, Duration::from_secs(1), Metrics::default());
    let rx = src.snapshots();
    let rejections = src.reload().expect("example is valid");
    assert!(rejections.is_empty());
    let snap = rx.borrow().clone();
    let echo = snap.get(&key("echo")).expect("echo published");
    let port = echo.port(50051).expect("port");
    let addrs: Vec<SocketAddr> = port.ready().map(|e| e.addr).collect();
    assert_eq!(
        addrs,
        vec![
            "10.0.1.11:50051".parse::<SocketAddr>().unwrap(),
            "10.0.1.12:50052".parse().unwrap()
        ],
        "named targetPort resolves per endpoint; the terminating endpoint is not ready"
    );
    assert_eq!(port.endpoints.len(), 3);
    assert_eq!(echo.tuning.retryable_methods.len(), 1);
    let slow = snap.get(&key("slow")).expect("slow published");
    assert_eq!(slow.mode, Mode::Connection);
    assert_eq!(slow.cluster_ips.len(), 2, "dual-stack VIPs");
    assert_eq!(slow.port(80).unwrap().ready().count(), 2);
    assert!(
        slow.port(80)
            .unwrap()
            .ready()
            .all(|e| e.addr.port() == 8080)
    );
}

#[test]
fn unknown_field_is_a_parse_error() {
    let text = mk_file(&mk_service("a", "request", &[]).replace("mode:", "mdoe:"));
    let err = parse(Path::new("f.yaml"), &text).expect_err("typo must be rejected");
    assert!(matches!(err, FileError::Parse { .. }), "{err:?}");
}

#[test]
fn named_target_port_without_endpoint_port_is_an_error() {
    let text = mk_file(
        &mk_service("a", "request", &["10.0.0.1"]).replace("targetPort: 8080", "targetPort: grpc"),
    );
    let err = parse(Path::new("f.yaml"), &text).expect_err("port cannot be resolved");
    assert!(
        matches!(err, FileError::MissingEndpointPort { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("10.0.0.1"));
}

#[test]
fn duplicate_service_is_an_error() {
    let text = mk_file(&format!(
        "{}{}",
        mk_service("a", "request", &[]),
        mk_service("a", "observe", &[])
    ));
    let err = parse(Path::new("f.yaml"), &text).expect_err("duplicate");
    assert!(matches!(err, FileError::DuplicateService { .. }), "{err:?}");
}

fn write_temp(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("services.yaml");
    std::fs::write(&path, text).expect("write");
    // The caller holds the TempDir: dropping it deletes the file.
    (dir, path)
}

#[tokio::test(flavor = "current_thread")]
async fn file_changes_are_applied_and_a_broken_file_keeps_the_last_good_state() {
    let (_dir, path) = write_temp(&mk_file(&mk_service(
        "web",
        "request",
        &["10.0.0.1", "10.0.0.2"],
    )));
    let metrics = Metrics::default();
    let src = FileSource::new(&path, Duration::from_millis(20), metrics.clone());
    let mut rx = src.snapshots();
    let task = tokio::spawn(src.run());

    wait_for(&mut rx, "initial file applied", |s| {
        s.get(&key("web"))
            .is_some_and(|w| w.port(80).unwrap().ready().count() == 2)
    })
    .await;

    std::fs::write(
        &path,
        mk_file(&mk_service(
            "web",
            "observe",
            &["10.0.0.1", "10.0.0.2", "10.0.0.3"],
        )),
    )
    .expect("write");
    wait_for(&mut rx, "edit applied", |s| {
        s.get(&key("web"))
            .is_some_and(|w| w.mode == Mode::Observe && w.port(80).unwrap().ready().count() == 3)
    })
    .await;

    std::fs::write(&path, "services: [ {name: web").expect("write");
    let deadline = tokio::time::Instant::now() + WAIT;
    while metrics.source_errors_total("file") == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "broken file must be counted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        metrics.source_errors_total("file"),
        1,
        "an unchanged broken file is reported once"
    );
    let web = rx
        .borrow()
        .get(&key("web"))
        .cloned()
        .expect("last good state kept");
    assert_eq!(web.mode, Mode::Observe);

    // A bad annotation on one Service keeps that Service's last good config.
    std::fs::write(
        &path,
        mk_file(&mk_service("web", "sometimes", &["10.0.0.1"])),
    )
    .expect("write");
    let deadline = tokio::time::Instant::now() + WAIT;
    while metrics.rejected_total("UnknownMode") == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "bad mode must be counted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let web = rx
        .borrow()
        .get(&key("web"))
        .cloned()
        .expect("last good config kept");
    assert_eq!(web.mode, Mode::Observe);
    assert_eq!(
        web.port(80).unwrap().ready().count(),
        1,
        "endpoints still follow the file"
    );

    std::fs::write(&path, mk_file("")).expect("write");
    wait_for(&mut rx, "services removed", Snapshot::is_empty).await;
    task.abort();
}

/// Waits until `f` holds and returns how long that took.
async fn latency(
    rx: &mut watch::Receiver<Snapshot>,
    what: &str,
    f: impl FnMut(&Snapshot) -> bool,
) -> Duration {
    let start = tokio::time::Instant::now();
    wait_for(rx, what, f).await;
    start.elapsed()
}

#[tokio::test(flavor = "current_thread")]
async fn changes_are_picked_up_by_the_directory_watch_not_the_poll() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("services.yaml");
    // The poll (10 s) is far slower than any bound below: only the inotify watch can pass.
    let src = FileSource::new(&path, Duration::from_secs(10), Metrics::default());
    let mut rx = src.snapshots();
    let task = tokio::spawn(src.run());
    // The first read (at start) finds no file; give the source a moment to set its watch up.
    tokio::time::sleep(Duration::from_millis(100)).await;

    // Created after the source started (written elsewhere, renamed in: what editors and
    // Kubernetes' atomic writer do).
    let replace = |text: String| {
        let tmp = dir.path().join(".services.yaml.tmp");
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, &path).expect("rename");
    };
    replace(mk_file(&mk_service("web", "request", &["10.0.0.1"])));
    let created = latency(&mut rx, "file created -> opt-in", |s| {
        s.get(&key("web")).is_some_and(|w| w.mode == Mode::Request)
    })
    .await;

    // Written in place.
    std::fs::write(&path, mk_file(&mk_service("web", "observe", &["10.0.0.1"]))).expect("write");
    let in_place = latency(&mut rx, "in-place write -> mode change", |s| {
        s.get(&key("web")).is_some_and(|w| w.mode == Mode::Observe)
    })
    .await;

    // Replaced by rename: opt-out.
    replace(mk_file(""));
    let renamed = latency(&mut rx, "replaced by rename -> opt-out", Snapshot::is_empty).await;

    // And back, several times, for a spread.
    let mut more = Vec::new();
    for i in 0..5 {
        let mode = if i % 2 == 0 { "request" } else { "observe" };
        replace(mk_file(&mk_service("web", mode, &["10.0.0.1"])));
        more.push(
            latency(&mut rx, "replaced by rename -> mode", |s| {
                s.get(&key("web")).is_some_and(|w| w.mode.as_str() == mode)
            })
            .await,
        );
    }
    println!(
        "services file change -> snapshot: created {created:?}, in place {in_place:?}, renamed {renamed:?}, 5 more renames max {:?}",
        more.iter().max().expect("5 samples")
    );
    for (what, took) in [
        ("created", created),
        ("in place", in_place),
        ("renamed", renamed),
    ]
    .into_iter()
    .chain(more.into_iter().map(|t| ("renamed again", t)))
    {
        // Issue 3 asks for 100 ms; generous here for a shared test machine, and still 10x
        // under the poll.
        assert!(
            took < Duration::from_secs(1),
            "{what}: the watch picks the change up, not the 10 s poll: {took:?}"
        );
    }
    task.abort();
}
