//! The load generator's report as a typed contract: what `skewless-loadgen run --json` prints,
//! one JSON object per run, and what `skewless-bench` reads back. Both sides use this one type,
//! so a renamed or missing field fails to compile (or to parse, with the field named) instead of
//! reading as zero.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::LATE_AFTER;

/// One run's results. JSON: `mode` (`closed` or `open`), `ok`, `elapsed_s`, `rps`, latency
/// quantiles in microseconds (`p50_us`, `p90_us`, `p99_us`, `p999_us`, `max_us`), `pods`
/// (successful calls per pod) and `errors` (failed calls by gRPC code); open loop adds
/// `target_rps`, `scheduled`, `sent`, `late`, `not_sent` and `unfinished`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Closed or open loop, with the open loop's bookkeeping.
    #[serde(flatten)]
    pub mode: Mode,
    /// Successful calls measured.
    pub ok: u64,
    /// Length of the measured window, seconds.
    pub elapsed_s: f64,
    /// Successful calls per second.
    pub rps: f64,
    /// Median latency, microseconds (open loop: from each call's intended send time).
    pub p50_us: u64,
    /// p90, microseconds.
    pub p90_us: u64,
    /// p99, microseconds.
    pub p99_us: u64,
    /// p99.9, microseconds.
    pub p999_us: u64,
    /// Slowest successful call, microseconds.
    pub max_us: u64,
    /// Successful calls per pod (the name the echo reply carries).
    pub pods: BTreeMap<String, u64>,
    /// Failed calls by gRPC code.
    pub errors: BTreeMap<String, u64>,
}

/// How the calls were issued; the JSON `mode` field.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum Mode {
    /// A fixed number of calls in flight per connection.
    Closed,
    /// A fixed rate, each call timed from its intended send time.
    Open(OpenReport),
}

/// Open-loop bookkeeping over the calls due in the measured window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OpenReport {
    /// The offered rate, calls per second.
    pub target_rps: f64,
    /// Calls due in the window.
    pub scheduled: u64,
    /// Of those, calls sent (on time or late).
    pub sent: u64,
    /// Of the sent calls, those sent more than [`LATE_AFTER`] after their intended time.
    pub late: u64,
    /// Calls due but never sent (the sender fell behind).
    pub not_sent: u64,
    /// Sent calls with no answer within the drain time after the window.
    pub unfinished: u64,
}

impl Report {
    /// Failed calls.
    #[must_use]
    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }

    /// A pod's share of the successful calls (0..=1).
    #[must_use]
    pub fn share(&self, pod: &str) -> f64 {
        self.pods.get(pod).copied().unwrap_or(0) as f64 / self.ok.max(1) as f64
    }

    /// The open-loop bookkeeping, None for a closed loop.
    #[must_use]
    pub fn open(&self) -> Option<&OpenReport> {
        match &self.mode {
            Mode::Closed => None,
            Mode::Open(o) => Some(o),
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |us: u64| us as f64 / 1e3;
        writeln!(
            f,
            "calls {} in {:.1}s = {:.0} rps; errors {:?}",
            self.ok, self.elapsed_s, self.rps, self.errors
        )?;
        if let Some(o) = self.open() {
            writeln!(
                f,
                "open loop: target {:.0} rps, {} due, {} sent ({} late by > {} ms), {} not sent, {} unfinished",
                o.target_rps,
                o.scheduled,
                o.sent,
                o.late,
                LATE_AFTER.as_millis(),
                o.not_sent,
                o.unfinished
            )?;
        }
        writeln!(
            f,
            "latency ms: p50 {:.2}  p90 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
            ms(self.p50_us),
            ms(self.p90_us),
            ms(self.p99_us),
            ms(self.p999_us),
            ms(self.max_us),
        )?;
        for (pod, n) in &self.pods {
            writeln!(f, "  {pod}: {n} ({:.3}%)", self.share(pod) * 100.0)?;
        }
        Ok(())
    }
}
