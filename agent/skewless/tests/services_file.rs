//! Privileged: the real `skewless agent --services-file`, measuring how long an opt-in, a mode
//! change and an opt-out written to the file take to reach the eBPF redirect map (which the
//! next connect() follows at once). Issue 3 asks for 100 ms; the agent's fallback poll is 1 s,
//! so only the file watch can make every change fast.
//!
//! The agent runs in this process's network namespace with the balancers on 127.0.0.1 and no
//! pod cgroup attached: the redirect entries are inspected but route nothing, and the
//! endpoints are loopback addresses nothing listens on.

mod admin_api;

use std::{
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

const VIP: &str = "198.19.0.41:50051";

/// Writes the file the way editors and ConfigMaps do: elsewhere, then renamed over it.
fn write_services(path: &Path, mode: Option<&str>) {
    let mode = mode.map_or_else(String::new, |m| format!("    mode: {m}\n"));
    let yaml = format!(
        "services:\n  - name: echo\n    clusterIPs: [\"198.19.0.41\"]\n{mode}    ports:\n      - port: 50051\n    endpoints:\n      - {{address: 127.0.1.1, target: echo-1}}\n"
    );
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, yaml).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Polls `/status` until the redirect map's having the VIP is `want` (10 s at most); returns
/// how long that took.
async fn until_redirected(admin: &str, want: bool) -> Duration {
    admin_api::until(
        admin,
        &format!("redirected = {want}"),
        Duration::from_secs(10),
        |s| {
            s["redirects"]
                .as_array()
                .map(|r| r.iter().any(|r| r["service"] == VIP))
                == Some(want)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
async fn services_file_changes_reach_the_redirect_map_without_waiting_for_the_poll() {
    let dir = std::env::temp_dir().join(format!("skewless-file-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("services.yaml");
    let admin = admin_api::free_admin_addr();
    // The file does not exist yet when the agent starts.
    let child = Command::new(env!("CARGO_BIN_EXE_skewless"))
        .args([
            "agent",
            "--services-file",
            &path.display().to_string(),
            "--balancer-ip",
            "127.0.0.1",
            "--admin-addr",
            &admin,
        ])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let _agent = admin_api::AgentProcess { child, dir };
    until_redirected(&admin, false).await;

    let mut took: Vec<(&str, Duration)> = Vec::new();
    for _ in 0..3 {
        write_services(&path, Some("request"));
        took.push(("opt-in", until_redirected(&admin, true).await));
        write_services(&path, Some("observe"));
        took.push(("mode change", until_redirected(&admin, false).await));
        write_services(&path, Some("request"));
        took.push(("opt-in", until_redirected(&admin, true).await));
        write_services(&path, None);
        took.push(("opt-out", until_redirected(&admin, false).await));
    }
    let mut sorted: Vec<Duration> = took.iter().map(|(_, d)| *d).collect();
    sorted.sort();
    println!(
        "services file change -> redirect map: p50 {:?}, max {:?} over {} changes",
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1],
        sorted.len()
    );
    // With the 1 s poll alone, latencies spread over 0-1 s: twelve of them all under 500 ms
    // would happen about once in 4000 runs. Issue 3's target is 100 ms; the bound is generous
    // for a shared machine.
    for (what, d) in &took {
        assert!(
            *d < Duration::from_millis(500),
            "{what} took {d:?}: the file watch must apply it, not the 1 s poll"
        );
    }
}

/// The body of `GET path` as text, once the agent answers.
async fn text(admin: &str, path: &str) -> String {
    let start = std::time::Instant::now();
    loop {
        if let Some(body) = admin_api::get(admin, path).await {
            return String::from_utf8_lossy(&body).into_owned();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the admin API must come up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
async fn without_a_valid_services_file_nothing_is_redirected_and_ready_says_why() {
    let dir = std::env::temp_dir().join(format!("skewless-nomodel-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("services.yaml");
    let admin = admin_api::free_admin_addr();
    let child = Command::new(env!("CARGO_BIN_EXE_skewless"))
        .args([
            "agent",
            "--services-file",
            &path.display().to_string(),
            "--balancer-ip",
            "127.0.0.1",
            "--admin-addr",
            &admin,
        ])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let _agent = admin_api::AgentProcess { child, dir };

    // No file, then a broken one: the agent has no model, redirects nothing, and says so.
    for broken in [None, Some("services: [ {name: echo, clusterIPs: [")] {
        if let Some(text) = broken {
            std::fs::write(&path, text).unwrap();
        }
        // Past the 1 s poll: a reload has been tried.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let ready = text(&admin, "/ready").await;
        assert!(
            ready.contains("no model yet") && ready.contains(&path.display().to_string()),
            "/ready must say the agent waits for the file: {ready:?}"
        );
        let metrics = text(&admin, "/metrics").await;
        assert!(
            metrics.lines().any(|l| l == "skewless_model_ready 0"),
            "the model_ready gauge must be 0 without a model:\n{metrics}"
        );
        let status = admin_api::status(&admin).await.unwrap();
        assert_eq!(
            status["redirects"].as_array().map(Vec::len),
            Some(0),
            "nothing may be redirected without a model: {status}"
        );
    }

    write_services(&path, Some("request"));
    until_redirected(&admin, true).await;
    assert_eq!(text(&admin, "/ready").await, "ok\n");
    let metrics = text(&admin, "/metrics").await;
    assert!(
        metrics.lines().any(|l| l == "skewless_model_ready 1"),
        "the gauge must be 1 once the file is applied:\n{metrics}"
    );
}
