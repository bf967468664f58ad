//! The demo's third act: connection mode and seed 001's scale-up. Long-running pick_first
//! clients are pinned to the Service's two pods; the Deployment is scaled up mid-run; the
//! agent sees the skew, rotates connections one by one with the graceful two-phase GOAWAY, and
//! the clients' reconnects are placed on the new pods. Shown from the clients' own tallies
//! (calls per pod over time) and `skewless status`.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use skewless_testbed::{Place, Testbed, grpc};

use super::{ADMIN, PORT, VIP, target_dir, write_services_file};

/// How long the act's clients run.
const RUN: Duration = Duration::from_secs(32);
/// When, after the clients start, the Deployment is scaled up. The agent never rotates a
/// connection younger than 10 s, so this plus the hold time should reach that.
const SCALE_AT: Duration = Duration::from_secs(8);
/// Each timeline row covers this long.
const ROW: usize = 4;
/// Every call waits this long in the server: one call in flight per connection is ~20
/// calls/s, a load the demo's Python servers carry on a small machine.
const DELAY_MS: u32 = 50;
/// The act's annotations. A threshold of 1.2 asks for an even spread of connections (1.5,
/// the default, would accept 4/4/2/2 over four pods); a short hold time and a higher rotation
/// budget keep the act short.
const TUNING: [(&str, &str); 3] = [
    ("skew-threshold", "1.2"),
    ("hold-time", "3s"),
    ("max-rotations-per-minute", "60"),
];

/// What the act needs from the demo.
pub struct Act<'a> {
    pub gen_dir: &'a Path,
    pub agent_bin: &'a Path,
    pub services_file: &'a Path,
    /// Pods that answer without extra delay (connection mode balances connections by their
    /// request rate, not by latency: a slow pod is request mode's job).
    pub healthy: &'a [String],
    pub clients: &'a [String],
}

pub fn run(tb: &mut Testbed, act: &Act<'_>) -> Result<()> {
    let n = act.healthy.len();
    if n < 3 {
        println!("\n3) Connection mode: skipped (it scales from 2 to all healthy pods: needs 3)");
        return Ok(());
    }
    let before = &act.healthy[..2];
    // `n` connections per client: the total is a multiple of the pod count, so an even spread
    // of connections exists (with 9 connections over 4 pods the best is 3/2/2/2, skew 1.33,
    // over the act's threshold).
    let channels = n;
    let tuning = TUNING
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join(", ");
    println!(
        "\n3) Connection mode, the seed's scale-up: the Service switched to mode: connection \
         ({tuning}) with 2 pods ({}); {} grpcio client(s) with {channels} channels each (pick_first: \
         one connection per channel), one call in flight per connection, for {} s; the \
         Deployment scaled to {n} pods at {} s",
        before.join(", "),
        act.clients.len(),
        RUN.as_secs(),
        SCALE_AT.as_secs()
    );
    write_services_file(tb, act.services_file, "connection", &TUNING, before)?;
    let names: Vec<&str> = before.iter().map(String::as_str).collect();
    tb.set_backends("echo", &names)?;
    wait_for_connection_mode(tb, act.agent_bin)?;

    let mut running = Vec::new();
    for name in act.clients {
        running.push(spawn_client(tb, act.gen_dir, name, channels)?);
    }
    let started = Instant::now();
    std::thread::sleep(SCALE_AT);
    write_services_file(tb, act.services_file, "connection", &TUNING, act.healthy)?;
    let names: Vec<&str> = act.healthy.iter().map(String::as_str).collect();
    tb.set_backends("echo", &names)?;
    let scaled_at = started.elapsed();
    println!(
        "\n   {:>4.1} s  scaled to {n} pods: the new ones are ready and receive nothing, every \
         connection stays where it is",
        scaled_at.as_secs_f64()
    );
    std::thread::sleep(Duration::from_secs(1));
    print_status(tb, act.agent_bin, "   ")?;
    follow_rotations(tb, act.agent_bin, started)?;
    println!("\n   `skewless status` near the end of the run:");
    print_status(tb, act.agent_bin, "   ")?;

    let mut results = Vec::new();
    for (name, client) in act.clients.iter().zip(running) {
        results.push((name, client.wait(tb)?));
    }
    let mut failed = 0;
    for (name, r) in &results {
        if r.ok == 0 {
            bail!("{name}: no call succeeded");
        }
        failed += r.failed;
    }
    println!(
        "\n   calls per pod, all clients together ({} ok, {failed} failed):",
        results.iter().map(|(_, r)| r.ok).sum::<u64>()
    );
    print_timeline(
        &results.iter().map(|(_, r)| r).collect::<Vec<_>>(),
        act.healthy,
        scaled_at,
    );
    let failures = if failed == 0 {
        "No call failed in the move.".to_owned()
    } else {
        format!("{failed} call(s) failed in the move.")
    };
    println!(
        "\n   Scaling up did nothing by itself: every connection was pinned to one of the two old \
         pods. Connection mode saw the skew, held it for the hold time, then rotated \
         connections one by one (GOAWAY, PING, final GOAWAY); each client reconnected at once \
         and was placed on a pod with less load. {failures} The calls stay on their \
         connections: this is the spread of connections, not of calls (request mode balances \
         every call)."
    );
    Ok(())
}

/// One client's result: what the act reads of the `--json` output.
struct Tally {
    ok: u64,
    failed: u64,
    /// When the client started (Unix seconds), and per second since then: pod -> calls.
    start_unix_s: f64,
    per_second: Vec<BTreeMap<String, u64>>,
}

struct RunningClient {
    pid: u32,
    out: PathBuf,
    deadline: Instant,
}

impl RunningClient {
    fn wait(self, tb: &mut Testbed) -> Result<Tally> {
        while tb.is_running(self.pid) {
            if Instant::now() > self.deadline {
                tb.kill(self.pid);
                bail!("a client ran past its time bound");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let text = fs::read_to_string(&self.out)
            .with_context(|| format!("reading {}", self.out.display()))?;
        let _ = fs::remove_file(&self.out);
        parse_tally(&text)
    }
}

fn spawn_client(
    tb: &mut Testbed,
    gen_dir: &Path,
    name: &str,
    channels: usize,
) -> Result<RunningClient> {
    let (py, client) = (grpc::python(), grpc::script("echo_client.py"));
    let target = format!("{VIP}:{PORT}");
    let (gen_dir, channels, duration, delay) = (
        gen_dir.display().to_string(),
        channels.to_string(),
        RUN.as_secs().to_string(),
        DELAY_MS.to_string(),
    );
    let argv = [
        py.to_str().unwrap_or("python3"),
        client.to_str().unwrap_or_default(),
        "--gen",
        &gen_dir,
        "--target",
        &target,
        "--calls",
        "10000000",
        "--channels",
        &channels,
        "--concurrency",
        &channels,
        "--delay-ms",
        &delay,
        "--duration",
        &duration,
        "--json",
    ];
    let out = target_dir().join(format!("demo-{}-{name}.json", tb.id()));
    let file = fs::File::create(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut cmd = tb.command(Place::Pod(name), &argv)?;
    cmd.stdout(file).stderr(Stdio::inherit());
    let pid = tb.spawn_command(&mut cmd)?;
    Ok(RunningClient {
        pid,
        out,
        deadline: Instant::now() + RUN + Duration::from_secs(30),
    })
}

fn parse_tally(text: &str) -> Result<Tally> {
    let v: serde_json::Value = text
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .with_context(|| format!("no JSON result in the client's output {text:?}"))?;
    let unary = &v["unary"];
    let count = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let per_second = unary["per_second"]
        .as_array()
        .map(|secs| {
            secs.iter()
                .map(|s| {
                    s.as_object()
                        .map(|m| m.iter().map(|(k, n)| (k.clone(), count(n))).collect())
                        .unwrap_or_default()
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(Tally {
        ok: count(&unary["ok"]),
        failed: unary["failed"]
            .as_object()
            .map_or(0, |m| m.values().map(count).sum()),
        start_unix_s: v["start_unix_s"].as_f64().unwrap_or(0.0),
        per_second,
    })
}

/// Calls per pod in rows of [`ROW`] seconds since the first client started, all clients
/// together, with each pod's share of the row.
fn print_timeline(results: &[&Tally], pods: &[String], scaled_at: Duration) {
    let t0 = results
        .iter()
        .map(|r| r.start_unix_s)
        .fold(f64::INFINITY, f64::min);
    let mut rows: Vec<BTreeMap<&str, u64>> = Vec::new();
    for r in results {
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "a few seconds between client starts"
        )]
        let offset = (r.start_unix_s - t0).round().max(0.0) as usize;
        for (s, second) in r.per_second.iter().enumerate() {
            let row = (s + offset) / ROW;
            if rows.len() <= row {
                rows.resize_with(row + 1, BTreeMap::new);
            }
            for (pod, n) in second {
                *rows[row].entry(pod.as_str()).or_default() += n;
            }
        }
    }
    let mut header = format!("   {:<8}", "seconds");
    for p in pods {
        header.push_str(&format!(" {p:>13}"));
    }
    println!("{header}");
    #[expect(clippy::cast_precision_loss, reason = "call counts are far below 2^52")]
    for (i, row) in rows.iter().enumerate() {
        let total: u64 = row.values().sum();
        let (from, to) = (i * ROW, (i + 1) * ROW);
        let mut line = format!("   {:<8}", format!("{from}-{to}"));
        for p in pods {
            let n = row.get(p.as_str()).copied().unwrap_or(0);
            let share = if total == 0 {
                0.0
            } else {
                100.0 * n as f64 / total as f64
            };
            line.push_str(&format!(" {n:>6} {share:>5.1}%"));
        }
        let scale = scaled_at.as_secs_f64();
        #[expect(clippy::cast_precision_loss, reason = "small row bounds")]
        if (from as f64) <= scale && scale < to as f64 {
            line.push_str("  <- scaled up");
        }
        println!("{line}");
    }
}

/// Prints a line whenever the Service's connections move between pods (from `skewless status
/// --json`), until shortly before the clients' run ends (so the final status still shows
/// their connections).
fn follow_rotations(tb: &Testbed, agent_bin: &Path, started: Instant) -> Result<()> {
    let mut last = None;
    while started.elapsed() < RUN - Duration::from_secs(3) {
        let status = status_json(tb, agent_bin)?;
        let Some(svc) = status["services"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["mode"] == "connection"))
        else {
            bail!("the agent no longer serves the Service in connection mode: {status}");
        };
        let placement = connections_per_pod(svc);
        if last.as_ref() != Some(&placement) {
            println!(
                "   {:>4.1} s  {}",
                started.elapsed().as_secs_f64(),
                describe(svc)
            );
            last = Some(placement);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(())
}

/// Client connections relayed to each backend.
fn connections_per_pod(svc: &serde_json::Value) -> Vec<(String, u64)> {
    svc["endpoints"]
        .as_array()
        .map(|eps| {
            eps.iter()
                .map(|e| {
                    (
                        e["name"].as_str().unwrap_or("?").to_owned(),
                        e["upstream_connections"].as_u64().unwrap_or(0),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// One line of a connection-mode Service: connections per pod, skew, the policy's state,
/// rotations for skew so far.
fn describe(svc: &serde_json::Value) -> String {
    let c = &svc["connection"];
    let skew_rotations = svc["rotations"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["reason"] == "skew"))
        .and_then(|r| r["count"].as_u64())
        .unwrap_or(0);
    let placement: Vec<String> = connections_per_pod(svc)
        .iter()
        .map(|(pod, n)| format!("{pod} {n}"))
        .collect();
    format!(
        "connections: {}; skew {:.2} (live {:.2}), {}, {skew_rotations} rotated for skew",
        placement.join(", "),
        c["skew"].as_f64().unwrap_or(0.0),
        c["live_skew"].as_f64().unwrap_or(0.0),
        c["state"].as_str().unwrap_or("?"),
    )
}

fn status_json(tb: &Testbed, agent_bin: &Path) -> Result<serde_json::Value> {
    let bin = agent_bin.display().to_string();
    let out = tb.run(
        Place::Node(0),
        &[&bin, "status", "--json", "--admin-addr", ADMIN],
    )?;
    serde_json::from_slice(&out.stdout).context("`skewless status --json` printed no JSON")
}

fn print_status(tb: &Testbed, agent_bin: &Path, indent: &str) -> Result<()> {
    let bin = agent_bin.display().to_string();
    let out = tb.run(Place::Node(0), &[&bin, "status", "--admin-addr", ADMIN])?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        println!("{indent}{line}");
    }
    Ok(())
}

/// Waits until the agent serves the Service in connection mode.
fn wait_for_connection_mode(tb: &Testbed, agent_bin: &Path) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = status_json(tb, agent_bin).unwrap_or_default();
        if status["services"]
            .as_array()
            .is_some_and(|s| s.iter().any(|s| s["mode"] == "connection"))
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the agent did not serve the Service in connection mode within 20 s: {status}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
