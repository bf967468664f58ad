//! The rotation-convergence runs (`--convergence`): the seed-001 scale-up from 2 to 10 pods
//! under pick_first grpcio clients, through skewless-proxy, timed from the clients' own
//! tallies ([`skewless_bench::convergence`]).
//!
//! Per target: skewless-proxy starts with pods 0-1 and `--endpoints-from-stdin`; the clients
//! (`testing/py/rotation_client.py`, one HTTP/2 connection per channel) call for
//! `--convergence-before` seconds, then the benchmark writes the 10-pod set to the proxy's
//! standard input (the scale-up, timed at that write) and the clients go on for
//! `--convergence-after` seconds. Request mode spreads on the next calls; connection mode has
//! to rotate the pinned connections, within its hold time and rotation budget.

use std::fmt::Write as _;
use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use skewless_bench::convergence::{ClientTally, Convergence, analyse};
use skewless_bench::{Pod, Spread};

use crate::procs::{Proc, free_addr};

/// The pods before and after the scale-up (seed 001: 2 -> 10).
pub const BEFORE_PODS: usize = 2;
/// See [`BEFORE_PODS`].
pub const AFTER_PODS: usize = 10;

/// Buckets of the clients' tallies, and buckets per skew window (1 s).
const BUCKET_MS: u64 = 250;
const WINDOW_BUCKETS: usize = 4;
/// Buckets per smoothed skew window (5 s): once every pod holds one connection, a 1 s window
/// still swings over the threshold on the clients' own unevenness (with 10 connections on 10
/// pods, one channel 50% faster than the others for a second is skew 1.5).
const SMOOTH_WINDOW_BUCKETS: usize = 20;

/// The skew threshold the figure is judged against: the `skewless.io/skew-threshold`
/// default.
pub const THRESHOLD: f64 = 1.5;

/// What one convergence run is.
pub struct Plan<'a> {
    /// skewless-proxy and the arguments that select its mode.
    pub proxy: (&'a Path, Vec<String>),
    /// The table's name of the target.
    pub target: String,
    /// The ten pods (the first [`BEFORE_PODS`] are the set before the scale-up).
    pub pods: &'a [Pod],
    /// The venv's Python, the generated stubs and the client script.
    pub python: (&'a Path, &'a Path, &'a Path),
    /// Client channels (connections) and calls in flight on each.
    pub channels: usize,
    /// See `channels`.
    pub concurrency: usize,
    /// Seconds before and after the scale-up.
    pub before: f64,
    /// See `before`.
    pub after: f64,
    /// Proxy worker threads.
    pub threads: usize,
}

/// One run's outcome.
pub struct Outcome {
    /// The table's name of the target.
    pub target: String,
    /// The clients' tally.
    pub tally: ClientTally,
    /// Its analysis (1 s windows).
    pub convergence: Convergence,
    /// Seconds from the scale-up until the skew stays under the threshold in 5 s windows
    /// (None: never within the run).
    pub settled_smooth_s: Option<f64>,
}

fn set_line(pods: &[Pod]) -> String {
    let mut line = pods
        .iter()
        .map(|p| format!("{}={}", p.name, p.addr))
        .collect::<Vec<_>>()
        .join(" ");
    line.push('\n');
    line
}

fn epoch_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Runs one scale-up against one target.
///
/// # Errors
/// When a process cannot start or the clients fail.
pub fn run(plan: &Plan<'_>) -> anyhow::Result<Outcome> {
    let listen: SocketAddr = free_addr()?;
    let (bin, mode_args) = &plan.proxy;
    let mut cmd = Command::new(bin);
    cmd.arg("--listen")
        .arg(listen.to_string())
        .arg("--threads")
        .arg(plan.threads.to_string())
        .arg("--endpoints-from-stdin")
        .args(mode_args);
    for p in &plan.pods[..BEFORE_PODS] {
        cmd.arg("--endpoint").arg(format!("{}={}", p.name, p.addr));
    }
    let mut proxy = Proc::spawn(
        &plan.target,
        cmd.stdin(Stdio::piped()).stdout(Stdio::null()),
    )?;
    proxy.wait_listening(listen)?;
    let (py, gen_dir, script) = plan.python;
    let mut client = Proc::spawn(
        "rotation_client.py",
        Command::new(py)
            .arg(script)
            .arg("--gen")
            .arg(gen_dir)
            .arg("--target")
            .arg(listen.to_string())
            .arg("--channels")
            .arg(plan.channels.to_string())
            .arg("--concurrency")
            .arg(plan.concurrency.to_string())
            .arg("--duration")
            .arg((plan.before + plan.after).to_string())
            .arg("--bucket-ms")
            .arg(BUCKET_MS.to_string())
            .stdout(Stdio::piped()),
    )?;
    // Read the tally while the clients run: it is larger than a pipe's buffer (a bucket per
    // 250 ms with up to 10 pods each), so a client left to write into a full pipe would never
    // exit.
    let mut stdout = client
        .child
        .stdout
        .take()
        .context("the rotation clients' standard output")?;
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        stdout.read_to_string(&mut out).map(|_| out)
    });
    sleep(Duration::from_secs_f64(plan.before));
    let scaled_at = epoch_s();
    proxy
        .child
        .stdin
        .as_mut()
        .context("the proxy's standard input")?
        .write_all(set_line(&plan.pods[..AFTER_PODS]).as_bytes())
        .context("sending the scaled-up endpoint set")?;
    let status = client.wait_for(Duration::from_secs_f64(plan.after + 30.0))?;
    let out = reader
        .join()
        .map_err(|_| anyhow::anyhow!("the tally reader panicked"))?
        .context("reading the rotation clients' tally")?;
    if !status.success() {
        bail!(
            "the rotation clients failed ({status}) against {}",
            plan.target
        );
    }
    let tally: ClientTally =
        serde_json::from_str(out.trim()).context("parsing the rotation clients' tally")?;
    let ready: Vec<String> = plan.pods[..AFTER_PODS]
        .iter()
        .map(|p| p.name.clone())
        .collect();
    let convergence = analyse(&tally, scaled_at, &ready, WINDOW_BUCKETS, THRESHOLD);
    let settled_smooth_s =
        analyse(&tally, scaled_at, &ready, SMOOTH_WINDOW_BUCKETS, THRESHOLD).settled_s;
    drop(proxy);
    Ok(Outcome {
        target: plan.target.clone(),
        tally,
        convergence,
        settled_smooth_s,
    })
}

/// Prints one line about a finished run.
pub fn log(o: &Outcome) {
    let c = &o.convergence;
    let secs = |v: Option<f64>| v.map_or_else(|| "never".to_owned(), |s| format!("{s:.2} s"));
    eprintln!(
        "convergence {:<20} every pod after {}, skew < {THRESHOLD} for good after {} (5 s windows: {}), final skew {:.2}, calls {}, errors {:?}, pod changes {}",
        o.target,
        secs(c.all_receiving_s),
        secs(c.settled_s),
        secs(o.settled_smooth_s),
        c.final_skew,
        o.tally.buckets.iter().flat_map(|b| b.values()).sum::<u64>(),
        o.tally.errors,
        o.tally.moves,
    );
}

/// The convergence table: per target, the median (min–max) over its runs of the time from
/// the scale-up until every pod receives calls and until the skew stays under the threshold
/// (1 s and 5 s windows), the final skew, calls, failed calls and the clients' pod changes.
#[must_use]
pub fn table(outcomes: &[Outcome]) -> String {
    let mut t = String::new();
    t.push_str("| target | runs | channels | every pod receiving after s | skew < 1.5 for good after s | same, 5 s windows | final skew (1 s window) | largest final share | calls | failed calls | connection moves seen by clients |\n");
    t.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    let mut targets: Vec<&str> = outcomes.iter().map(|o| o.target.as_str()).collect();
    targets.dedup();
    for target in targets {
        let runs: Vec<&Outcome> = outcomes.iter().filter(|o| o.target == target).collect();
        let time = |f: fn(&Outcome) -> Option<f64>| {
            let never = runs.iter().filter(|o| f(o).is_none()).count();
            let s = Spread::of(runs.iter().filter_map(|o| f(o)));
            match (s, never) {
                (None, _) => "never".to_owned(),
                (Some(s), 0) => s.show(2),
                (Some(s), n) => format!("{} (never in {n} run(s))", s.show(2)),
            }
        };
        let skew = Spread::of(runs.iter().map(|o| o.convergence.final_skew));
        let share = Spread::of(
            runs.iter()
                .filter_map(|o| o.convergence.final_shares.first().map(|(_, s)| s * 100.0)),
        );
        let failed: u64 = runs
            .iter()
            .map(|o| o.tally.errors.values().sum::<u64>())
            .sum();
        let calls: u64 = runs
            .iter()
            .map(|o| o.tally.buckets.iter().flat_map(|b| b.values()).sum::<u64>())
            .sum();
        let _ = writeln!(
            t,
            "| {target} | {} | {} | {} | {} | {} | {} | {}% | {calls} | {failed} | {} |",
            runs.len(),
            runs.first().map_or(0, |o| o.tally.channels),
            time(|o| o.convergence.all_receiving_s),
            time(|o| o.convergence.settled_s),
            time(|o| o.settled_smooth_s),
            skew.map_or_else(|| "-".to_owned(), |s| s.show(2)),
            share.map_or_else(|| "-".to_owned(), |s| s.show(1)),
            if target.contains("connection") {
                runs.iter().map(|o| o.tally.moves).sum::<u64>().to_string()
            } else {
                "- (per call)".to_owned()
            },
        );
    }
    t
}
