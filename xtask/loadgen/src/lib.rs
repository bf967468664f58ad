//! A ghz-like load generator for the echo service: exactly `connections` HTTP/2 connections,
//! `in_flight` requests kept in flight on each (closed loop: a call starts when one ends), one
//! HDR histogram over every call, and per-pod tallies from the replies (the echo reply names
//! the pod). Calls started during the warm-up are not counted.
//!
//! Closed loop measures what a fixed set of clients sees; it suffers from coordinated omission
//! when the target stalls (a stalled call holds back its successors). An open-loop mode at a
//! fixed rate is not implemented yet.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use hdrhistogram::Histogram;
use skewless_echo::pb::EchoRequest;
use skewless_echo::pb::echo_client::EchoClient;
use tokio::time::Instant;
use tonic::transport::Channel;

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
}

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// Where to send calls.
    pub target: SocketAddr,
    /// Number of HTTP/2 connections (like ghz `--connections`).
    pub connections: usize,
    /// Calls in flight per connection.
    pub in_flight: usize,
    /// Calls started in this period are not counted.
    pub warmup: Duration,
    /// Measured period after the warm-up.
    pub duration: Duration,
    /// Request payload size in bytes.
    pub payload: usize,
}

/// What a run measured.
#[derive(Debug)]
pub struct Report {
    /// Latency of every measured successful call, in microseconds.
    pub latency_us: Histogram<u64>,
    /// Successful calls per pod.
    pub pods: BTreeMap<String, u64>,
    /// Failed calls by gRPC code.
    pub errors: BTreeMap<String, u64>,
    /// Length of the measured period.
    pub elapsed: Duration,
}

impl Report {
    /// Successful calls.
    #[must_use]
    pub fn ok(&self) -> u64 {
        self.latency_us.len()
    }

    /// Successful calls per second.
    #[must_use]
    pub fn rps(&self) -> f64 {
        self.ok() as f64 / self.elapsed.as_secs_f64()
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

    /// The report as one JSON object (what `skewless-loadgen run --json` prints): `ok`,
    /// `elapsed_s`, `rps`, latency quantiles in microseconds (`p50_us`, `p90_us`, `p99_us`,
    /// `p999_us`, `max_us`), `pods` (successful calls per pod) and `errors` (failed calls by
    /// gRPC code).
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        let us = |q: f64| self.latency_us.value_at_quantile(q);
        serde_json::json!({
            "ok": self.ok(),
            "elapsed_s": self.elapsed.as_secs_f64(),
            "rps": self.rps(),
            "p50_us": us(0.5),
            "p90_us": us(0.9),
            "p99_us": us(0.99),
            "p999_us": us(0.999),
            "max_us": self.latency_us.max(),
            "pods": self.pods,
            "errors": self.errors,
        })
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        writeln!(
            f,
            "calls {} in {:.1}s = {:.0} rps; errors {:?}",
            self.ok(),
            self.elapsed.as_secs_f64(),
            self.rps(),
            self.errors
        )?;
        writeln!(
            f,
            "latency ms: p50 {:.2}  p90 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
            ms(self.quantile(0.5)),
            ms(self.quantile(0.9)),
            ms(self.quantile(0.99)),
            ms(self.quantile(0.999)),
            ms(Duration::from_micros(self.latency_us.max())),
        )?;
        for (pod, n) in &self.pods {
            writeln!(f, "  {pod}: {n} ({:.3}%)", self.share(pod) * 100.0)?;
        }
        Ok(())
    }
}

fn histogram() -> Result<Histogram<u64>, LoadError> {
    // 1 us .. 60 s at 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000, 3).map_err(LoadError::Histogram)
}

struct TaskResult {
    latency: Histogram<u64>,
    pods: BTreeMap<String, u64>,
    errors: BTreeMap<String, u64>,
}

/// Runs the load and reports.
///
/// # Errors
/// When a connection cannot be made or a task fails.
pub async fn run(config: &LoadConfig) -> Result<Report, LoadError> {
    let LoadConfig {
        target,
        connections,
        in_flight,
        warmup,
        duration,
        payload,
    } = config.clone();
    let start = Instant::now();
    let measure_from = start + warmup;
    let stop_at = measure_from + duration;
    let mut tasks = Vec::with_capacity(connections * in_flight);
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
        for _ in 0..in_flight {
            let mut client = EchoClient::new(channel.clone());
            let body = vec![0x61; payload];
            tasks.push(tokio::spawn(async move {
                let mut r = TaskResult {
                    latency: histogram()?,
                    pods: BTreeMap::new(),
                    errors: BTreeMap::new(),
                };
                loop {
                    let sent = Instant::now();
                    if sent >= stop_at {
                        return Ok::<_, LoadError>(r);
                    }
                    let res = client
                        .echo(EchoRequest {
                            payload: body.clone(),
                            ..EchoRequest::default()
                        })
                        .await;
                    if sent < measure_from {
                        continue;
                    }
                    match res {
                        Ok(reply) => {
                            let us = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX);
                            r.latency.saturating_record(us.max(1));
                            *r.pods.entry(reply.into_inner().pod).or_default() += 1;
                        }
                        Err(status) => {
                            *r.errors.entry(format!("{:?}", status.code())).or_default() += 1;
                        }
                    }
                }
            }));
        }
    }
    let mut report = Report {
        latency_us: histogram()?,
        pods: BTreeMap::new(),
        errors: BTreeMap::new(),
        elapsed: duration,
    };
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
        let report = Report {
            latency_us,
            pods: BTreeMap::from([("pod-0".to_owned(), 600), ("pod-1".to_owned(), 400)]),
            errors: BTreeMap::from([("Unavailable".to_owned(), 2)]),
            elapsed: Duration::from_secs(2),
        };
        let v = report.to_json();
        assert_eq!(v["ok"], 1000);
        assert_eq!(v["rps"], 500.0);
        assert_eq!(v["p50_us"], 500);
        assert_eq!(v["max_us"], 1000);
        assert_eq!(v["pods"]["pod-1"], 400);
        assert_eq!(v["errors"]["Unavailable"], 2);
    }
}
