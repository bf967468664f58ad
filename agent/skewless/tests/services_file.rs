//! Privileged: the real `skewless agent --services-file`, measuring how long an opt-in, a mode
//! change and an opt-out written to the file take to reach the eBPF redirect map (which the
//! next connect() follows at once). Issue 3 asks for 100 ms; the agent's fallback poll is 1 s,
//! so only the file watch can make every change fast.
//!
//! The agent runs in this process's network namespace with the balancers on 127.0.0.1 and no
//! pod cgroup attached: the redirect entries are inspected but route nothing, and the
//! endpoints are loopback addresses nothing listens on.

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use http_body_util::{BodyExt as _, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

const VIP: &str = "198.19.0.41:50051";

/// The agent and its temp dir: killed and removed on drop, also when the test fails.
struct Agent {
    child: Child,
    dir: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

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

async fn status(admin: &str) -> Option<serde_json::Value> {
    let stream = tokio::net::TcpStream::connect(admin).await.ok()?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(conn);
    let req = http::Request::get("/status")
        .header("host", admin)
        .body(Empty::<Bytes>::new())
        .ok()?;
    let body = sender
        .send_request(req)
        .await
        .ok()?
        .into_body()
        .collect()
        .await
        .ok()?
        .to_bytes();
    serde_json::from_slice(&body).ok()
}

/// Whether the redirect map has the VIP, per `/status`; `None` while the agent is not up.
async fn redirected(admin: &str) -> Option<bool> {
    let s = status(admin).await?;
    Some(
        s["redirects"]
            .as_array()?
            .iter()
            .any(|r| r["service"] == VIP),
    )
}

/// Polls `/status` every 2 ms until the redirect is `want`; returns how long that took.
async fn until_redirected(admin: &str, want: bool) -> Duration {
    let start = Instant::now();
    loop {
        if redirected(admin).await == Some(want) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for redirected = {want}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
async fn services_file_changes_reach_the_redirect_map_without_waiting_for_the_poll() {
    let dir = std::env::temp_dir().join(format!("skewless-file-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("services.yaml");
    let admin = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
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
    let _agent = Agent { child, dir };
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
