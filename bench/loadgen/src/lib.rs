//! A ghz-like load generator for the echo service: exactly `connections` HTTP/2 connections,
//! one HDR histogram over every call, and per-pod tallies from the replies (the echo reply names
//! the pod). Calls started (closed loop) or due (open loop) during the warm-up are not counted.
//!
//! Two ways to issue calls ([`Load`]):
//! - **Closed loop** (like ghz `-c`): `in_flight` calls kept in flight on each connection, a
//!   call starts when one ends. It measures what a fixed set of busy clients sees, and suffers
//!   from coordinated omission when the target stalls: a stalled call holds back its
//!   successors, so the stall is recorded once instead of once per call that should have
//!   been sent meanwhile.
//! - **Open loop** at a fixed total rate: call `i` is due at `i / rate` seconds after the start
//!   ([`intended_offset`]), the calls dealt round-robin over the connections, and its latency
//!   is measured from that *intended* time, not from when it was actually sent (Gil Tene's
//!   correction for coordinated omission, as in wrk2). If the target falls behind, the
//!   per-connection cap on outstanding calls makes the sender wait; the calls it sends late
//!   still count from their intended time, and calls still unsent [`SEND_GRACE`] after the
//!   window closes are reported as not sent rather than silently skipped. tokio's timer has a 1 ms resolution,
//!   so a call can leave up to about 1 ms after its intended time; that wait is in its latency,
//!   the same for every target.
#![forbid(unsafe_code)]

mod report;

pub use report::{Mode, OpenReport, Report};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use hdrhistogram::Histogram;
use skewless_echo::pb::EchoRequest;
use skewless_echo::pb::echo_client::EchoClient;
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep_until, timeout_at};
use tonic::transport::Channel;

/// An open-loop call sent more than this after its intended time counts as late.
pub const LATE_AFTER: Duration = Duration::from_millis(5);

/// A call due in the window may still leave this long after the window ends (a call due just
/// before the end leaves after it when the timer ticks late or the process was not scheduled);
/// a sender further behind stops and reports the rest as not sent.
pub const SEND_GRACE: Duration = Duration::from_millis(100);

/// How long an open-loop run waits, after its window, for calls still outstanding; calls not
/// done by then are reported as unfinished.
pub const DRAIN: Duration = Duration::from_secs(5);

/// Errors of a load run.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Connecting to the target failed.
    #[error("failed to connect to {addr}")]
    Connect {
        /// The target.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The target does not make a valid URI.
    #[error("invalid target URI")]
    Uri(#[source] tonic::codegen::http::uri::InvalidUri),
    /// The histogram could not be created.
    #[error("histogram error")]
    Histogram(#[source] hdrhistogram::CreationError),
    /// Histograms could not be merged.
    #[error("histogram merge error")]
    Merge(#[source] hdrhistogram::AdditionError),
    /// A load task panicked.
    #[error("load task failed")]
    Task(#[source] tokio::task::JoinError),
    /// The open-loop rate is not a positive finite number, or a count is zero.
    #[error("invalid load: {0}")]
    Invalid(&'static str),
}

/// How calls are issued.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// `in_flight` calls kept in flight on each connection; a call starts when one ends.
    Closed {
        /// Calls in flight per connection.
        in_flight: usize,
    },
    /// `rate` calls per second in total, each due at its intended time whatever the target
    /// does, dealt round-robin over the connections.
    Open {
        /// Calls per second over all connections.
        rate: f64,
        /// Most calls outstanding on one connection; when reached, the sender waits for one
        /// to finish (the waiting shows in the latency, measured from the intended time).
        max_in_flight: usize,
    },
}

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// Where to send calls.
    pub target: SocketAddr,
    /// Number of HTTP/2 connections (like ghz `--connections`).
    pub connections: usize,
    /// Closed or open loop.
    pub load: Load,
    /// Calls started (closed) or due (open) in this period are not counted.
    pub warmup: Duration,
    /// Measured period after the warm-up.
    pub duration: Duration,
    /// Request payload size in bytes.
    pub payload: usize,
}

/// Open-loop bookkeeping of a run, over the calls due in the measured window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpenStats {
    /// The target rate, calls per second.
    pub target_rps: f64,
    /// Calls due in the measured window.
    pub scheduled: u64,
    /// Of those, calls sent (on time or late).
    pub sent: u64,
    /// Of the sent calls, those sent more than [`LATE_AFTER`] after their intended time.
    pub late: u64,
}

/// What a run measured, with the full latency histogram; [`Measurement::report`] gives the
/// [`Report`] that is printed and read back by the benchmark.
#[derive(Debug)]
pub struct Measurement {
    /// Latency of every measured successful call, in microseconds (open loop: from its
    /// intended time).
    pub latency_us: Histogram<u64>,
    /// Successful calls per pod.
    pub pods: BTreeMap<String, u64>,
    /// Failed calls by gRPC code.
    pub errors: BTreeMap<String, u64>,
    /// Length of the measured period.
    pub elapsed: Duration,
    /// Open-loop bookkeeping (None for a closed-loop run).
    pub open: Option<OpenStats>,
}

impl Measurement {
    /// Successful calls.
    #[must_use]
    pub fn ok(&self) -> u64 {
        self.latency_us.len()
    }

    /// Failed calls.
    #[must_use]
    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Successful calls per second.
    #[must_use]
    pub fn rps(&self) -> f64 {
        self.ok() as f64 / self.elapsed.as_secs_f64()
    }

    /// Open loop: calls due in the window that were never sent because the sender fell
    /// behind (0 for closed loop).
    #[must_use]
    pub fn not_sent(&self) -> u64 {
        self.open.map_or(0, |o| o.scheduled.saturating_sub(o.sent))
    }

    /// Open loop: sent calls that neither succeeded nor failed within [`DRAIN`] after the
    /// window (0 for closed loop).
    #[must_use]
    pub fn unfinished(&self) -> u64 {
        self.open
            .map_or(0, |o| o.sent.saturating_sub(self.ok() + self.failed()))
    }

    /// A pod's share of the successful calls (0..=1).
    #[must_use]
    pub fn share(&self, pod: &str) -> f64 {
        self.pods.get(pod).copied().unwrap_or(0) as f64 / self.ok().max(1) as f64
    }

    /// Latency at a quantile.
    #[must_use]
    pub fn quantile(&self, q: f64) -> Duration {
        Duration::from_micros(self.latency_us.value_at_quantile(q))
    }

    /// The run's [`Report`]: counts, quantiles and tallies (what `skewless-loadgen run`
    /// prints, as text or with `--json` as one JSON object).
    #[must_use]
    pub fn report(&self) -> Report {
        let us = |q: f64| self.latency_us.value_at_quantile(q);
        Report {
            mode: self.open.map_or(Mode::Closed, |o| {
                Mode::Open(OpenReport {
                    target_rps: o.target_rps,
                    scheduled: o.scheduled,
                    sent: o.sent,
                    late: o.late,
                    not_sent: self.not_sent(),
                    unfinished: self.unfinished(),
                })
            }),
            ok: self.ok(),
            elapsed_s: self.elapsed.as_secs_f64(),
            rps: self.rps(),
            p50_us: us(0.5),
            p90_us: us(0.9),
            p99_us: us(0.99),
            p999_us: us(0.999),
            max_us: self.latency_us.max(),
            pods: self.pods.clone(),
            errors: self.errors.clone(),
        }
    }
}

/// When call `k` of connection `conn` (of `connections`) is due in an open loop at `rate`
/// calls per second, counted from the start of the run: the run's `i`-th call (`i = k *
/// connections + conn`) is due at `i / rate`, so the calls are evenly spaced over the whole
/// run and dealt round-robin to the connections.
#[must_use]
pub fn intended_offset(rate: f64, connections: usize, conn: usize, k: u64) -> Duration {
    let i = k * connections as u64 + conn as u64;
    Duration::from_secs_f64(i as f64 / rate)
}

fn histogram() -> Result<Histogram<u64>, LoadError> {
    // 1 us .. 60 s at 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000, 3).map_err(LoadError::Histogram)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

struct TaskResult {
    latency: Histogram<u64>,
    pods: BTreeMap<String, u64>,
    errors: BTreeMap<String, u64>,
    open: OpenStats,
}

impl TaskResult {
    fn new() -> Result<Self, LoadError> {
        Ok(Self {
            latency: histogram()?,
            pods: BTreeMap::new(),
            errors: BTreeMap::new(),
            open: OpenStats::default(),
        })
    }

    fn record(&mut self, latency: Duration, res: Result<String, tonic::Code>) {
        match res {
            Ok(pod) => {
                self.latency.saturating_record(micros(latency));
                *self.pods.entry(pod).or_default() += 1;
            }
            Err(code) => *self.errors.entry(format!("{code:?}")).or_default() += 1,
        }
    }
}

/// The outcome of one open-loop call: its latency from the intended time, and the pod that
/// served it or the failure. Only measured calls produce one.
type Outcome = (Duration, Result<String, tonic::Code>);

struct Window {
    start: Instant,
    measure_from: Instant,
    stop_at: Instant,
}

async fn echo(client: &mut EchoClient<Channel>, body: &[u8]) -> Result<String, tonic::Code> {
    client
        .echo(EchoRequest {
            payload: body.to_vec(),
            ..EchoRequest::default()
        })
        .await
        .map(|reply| reply.into_inner().pod)
        .map_err(|status| status.code())
}

async fn closed_slot(
    mut client: EchoClient<Channel>,
    body: Vec<u8>,
    w: Window,
) -> Result<TaskResult, LoadError> {
    let mut r = TaskResult::new()?;
    loop {
        let sent = Instant::now();
        if sent >= w.stop_at {
            return Ok(r);
        }
        let res = echo(&mut client, &body).await;
        if sent >= w.measure_from {
            r.record(sent.elapsed(), res);
        }
    }
}

/// One connection's share of an open loop: sends each call at its intended time (or as soon
/// as a slot is free, if the cap is reached), records latency from the intended time.
async fn open_connection(
    client: &EchoClient<Channel>,
    body: Vec<u8>,
    (rate, connections, conn, max_in_flight): (f64, usize, usize, usize),
    w: Window,
) -> Result<TaskResult, LoadError> {
    let mut r = TaskResult::new()?;
    r.open.target_rps = rate;
    let mut calls: JoinSet<Option<Outcome>> = JoinSet::new();
    let done = |r: &mut TaskResult, joined: Option<Result<Option<Outcome>, _>>| {
        if let Some(joined) = joined
            && let Some((latency, res)) = joined.map_err(LoadError::Task)?
        {
            r.record(latency, res);
        }
        Ok::<_, LoadError>(())
    };
    let send_until = w.stop_at + SEND_GRACE;
    let mut k = 0;
    loop {
        let intended = w.start + intended_offset(rate, connections, conn, k);
        if intended >= w.stop_at || Instant::now() >= send_until {
            break;
        }
        // At the cap, wait for a call to finish; this call goes late and says so.
        while calls.len() >= max_in_flight && Instant::now() < send_until {
            if let Ok(joined) = timeout_at(send_until, calls.join_next()).await {
                done(&mut r, joined)?;
            }
        }
        // Until it is due, collect the calls that finish.
        loop {
            tokio::select! {
                biased;
                () = sleep_until(intended) => break,
                joined = calls.join_next(), if !calls.is_empty() => done(&mut r, joined)?,
            }
        }
        let now = Instant::now();
        if now >= send_until {
            break;
        }
        let measured = intended >= w.measure_from;
        if measured {
            r.open.sent += 1;
            if now > intended + LATE_AFTER {
                r.open.late += 1;
            }
        }
        let mut client = client.clone();
        let body = body.clone();
        calls.spawn(async move {
            let res = echo(&mut client, &body).await;
            measured.then(|| (intended.elapsed(), res))
        });
        k += 1;
    }
    // Every call due in the window counts, sent or not.
    for k in 0.. {
        let intended = w.start + intended_offset(rate, connections, conn, k);
        if intended >= w.stop_at {
            break;
        }
        if intended >= w.measure_from {
            r.open.scheduled += 1;
        }
    }
    let drain_until = send_until.max(Instant::now()) + DRAIN;
    while let Ok(Some(joined)) = timeout_at(drain_until, calls.join_next()).await {
        done(&mut r, Some(joined))?;
    }
    calls.abort_all();
    Ok(r)
}

/// Runs the load and reports.
///
/// # Errors
/// When a connection cannot be made, the load is invalid or a task fails.
pub async fn run(config: &LoadConfig) -> Result<Measurement, LoadError> {
    let LoadConfig {
        target,
        connections,
        load,
        warmup,
        duration,
        payload,
    } = config.clone();
    if connections == 0 {
        return Err(LoadError::Invalid("connections must be at least 1"));
    }
    match load {
        Load::Closed { in_flight: 0 } => {
            return Err(LoadError::Invalid("in-flight must be at least 1"));
        }
        Load::Open {
            rate,
            max_in_flight,
        } if !(rate.is_finite() && rate > 0.0) || max_in_flight == 0 => {
            return Err(LoadError::Invalid(
                "the rate must be positive and max-in-flight at least 1",
            ));
        }
        _ => {}
    }
    let mut channels = Vec::with_capacity(connections);
    for _ in 0..connections {
        // One Channel is one HTTP/2 connection.
        let channel = Channel::from_shared(format!("http://{target}"))
            .map_err(LoadError::Uri)?
            .connect()
            .await
            .map_err(|source| LoadError::Connect {
                addr: target,
                source,
            })?;
        channels.push(channel);
    }
    let start = Instant::now();
    let window = || Window {
        start,
        measure_from: start + warmup,
        stop_at: start + warmup + duration,
    };
    let body = vec![0x61; payload];
    let mut tasks = Vec::new();
    for (conn, channel) in channels.into_iter().enumerate() {
        match load {
            Load::Closed { in_flight } => {
                for _ in 0..in_flight {
                    let client = EchoClient::new(channel.clone());
                    tasks.push(tokio::spawn(closed_slot(client, body.clone(), window())));
                }
            }
            Load::Open {
                rate,
                max_in_flight,
            } => {
                let client = EchoClient::new(channel);
                let body = body.clone();
                let w = window();
                tasks.push(tokio::spawn(async move {
                    open_connection(&client, body, (rate, connections, conn, max_in_flight), w)
                        .await
                }));
            }
        }
    }
    let mut report = Measurement {
        latency_us: histogram()?,
        pods: BTreeMap::new(),
        errors: BTreeMap::new(),
        elapsed: duration,
        open: None,
    };
    let mut open = OpenStats::default();
    for t in tasks {
        let r = t.await.map_err(LoadError::Task)??;
        report
            .latency_us
            .add(&r.latency)
            .map_err(LoadError::Merge)?;
        for (k, v) in r.pods {
            *report.pods.entry(k).or_default() += v;
        }
        for (k, v) in r.errors {
            *report.errors.entry(k).or_default() += v;
        }
        open.scheduled += r.open.scheduled;
        open.sent += r.open.sent;
        open.late += r.open.late;
    }
    if let Load::Open { rate, .. } = load {
        open.target_rps = rate;
        report.open = Some(open);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_report_has_quantiles_and_tallies() {
        let mut latency_us = histogram().unwrap();
        for us in 1..=1000 {
            latency_us.record(us).unwrap();
        }
        let report = Measurement {
            latency_us,
            pods: BTreeMap::from([("pod-0".to_owned(), 600), ("pod-1".to_owned(), 400)]),
            errors: BTreeMap::from([("Unavailable".to_owned(), 2)]),
            elapsed: Duration::from_secs(2),
            open: None,
        };
        let v = serde_json::to_value(report.report()).unwrap();
        assert_eq!(v["mode"], "closed");
        assert_eq!(v["ok"], 1000);
        assert_eq!(v["rps"], 500.0);
        assert_eq!(v["p50_us"], 500);
        assert_eq!(v["max_us"], 1000);
        assert_eq!(v["pods"]["pod-1"], 400);
        assert_eq!(v["errors"]["Unavailable"], 2);
        assert!(v.get("not_sent").is_none(), "closed loop has no schedule");
        let back: Report = serde_json::from_value(v).unwrap();
        assert_eq!(
            back,
            report.report(),
            "the JSON reads back as the same report"
        );
        assert_eq!(back.open(), None);
    }

    #[test]
    fn open_json_reports_unsent_and_unfinished_calls() {
        let mut latency_us = histogram().unwrap();
        for us in 1..=90 {
            latency_us.record(us).unwrap();
        }
        let report = Measurement {
            latency_us,
            pods: BTreeMap::from([("pod-0".to_owned(), 90)]),
            errors: BTreeMap::from([("Unavailable".to_owned(), 4)]),
            elapsed: Duration::from_secs(1),
            open: Some(OpenStats {
                target_rps: 100.0,
                scheduled: 100,
                sent: 97,
                late: 5,
            }),
        };
        let v = serde_json::to_value(report.report()).unwrap();
        assert_eq!(v["mode"], "open");
        assert_eq!(v["target_rps"], 100.0);
        assert_eq!(v["not_sent"], 3, "100 due, 97 sent");
        assert_eq!(v["unfinished"], 3, "97 sent, 90 ok, 4 failed");
        assert_eq!(v["late"], 5);
        let back: Report = serde_json::from_str(&v.to_string()).unwrap();
        assert_eq!(
            back,
            report.report(),
            "the JSON reads back as the same report"
        );
        assert_eq!(
            back.open().map(|o| (o.not_sent, o.unfinished)),
            Some((3, 3))
        );
    }

    #[test]
    fn a_report_missing_a_field_is_an_error_that_names_it() {
        let mut v = serde_json::json!({
            "mode": "open", "ok": 1, "elapsed_s": 1.0, "rps": 1.0, "p50_us": 1, "p90_us": 1,
            "p99_us": 1, "p999_us": 1, "max_us": 1, "pods": {}, "errors": {},
            "target_rps": 5.0, "scheduled": 5, "sent": 5, "late": 0, "not_sent": 0,
        });
        let err = serde_json::from_value::<Report>(v.clone()).unwrap_err();
        assert!(err.to_string().contains("unfinished"), "{err}");
        v["unfinished"] = 0.into();
        assert!(serde_json::from_value::<Report>(v.clone()).is_ok());
        v.as_object_mut().unwrap().remove("p99_us");
        let err = serde_json::from_value::<Report>(v).unwrap_err();
        assert!(err.to_string().contains("p99_us"), "{err}");
    }

    #[test]
    fn open_schedule_spaces_all_calls_evenly_and_deals_them_round_robin() {
        let (rate, conns) = (1000.0, 4);
        let mut all: Vec<Duration> = (0..conns)
            .flat_map(|c| (0..250).map(move |k| intended_offset(rate, conns, c, k)))
            .collect();
        all.sort();
        // Merged over the connections, call i is due at i ms: one call per 1/rate.
        for (i, t) in all.iter().enumerate() {
            assert_eq!(*t, Duration::from_millis(i as u64), "call {i}");
        }
        // Each connection carries every 4th call: spacing connections / rate.
        for c in 0..conns {
            let gap = intended_offset(rate, conns, c, 11) - intended_offset(rate, conns, c, 10);
            assert_eq!(gap, Duration::from_millis(4));
            assert_eq!(
                intended_offset(rate, conns, c, 0),
                Duration::from_millis(c as u64)
            );
        }
    }

    #[test]
    fn open_schedule_puts_rate_times_duration_calls_in_a_window() {
        // 250 calls/s for 2 s after a 0.5 s warm-up: 500 calls due, whatever the connections.
        for conns in [1, 2, 3, 8] {
            let due = (0..conns)
                .flat_map(|c| (0..1000).map(move |k| intended_offset(250.0, conns, c, k)))
                .filter(|t| *t >= Duration::from_millis(500) && *t < Duration::from_millis(2500))
                .count();
            assert_eq!(due, 500, "{conns} connection(s)");
        }
    }
}
