//! The one result every echo client prints (grpcio, grpc-js and tonic alike), as a type.
//!
//! `testing/py/echo_client.py --json` and `testing/node/echo_client.js` write these field names;
//! the tonic client serializes this type directly. The harness parses every client's output
//! into [`ClientResult`] with serde, so a field a client forgot is a parse error, not a zero.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Everything one client run reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientResult {
    /// `grpcio`, `grpc-js` or `tonic`.
    pub client: String,
    /// The client library's version, as the library itself reports it.
    pub version: String,
    /// The client's start (its `t0`, what every `*_s` time counts from), seconds since the
    /// Unix epoch: lines its times up with a test's own events.
    pub start_unix_s: f64,
    /// Seconds from the client's start to its last call's end.
    pub elapsed_s: f64,
    /// The small unary calls (`--calls`, `--concurrency` in flight).
    pub unary: CallTally,
    /// The large unary calls (`--large-calls` of `--large-bytes` each way).
    pub large: CallTally,
    /// The server-streaming call held open for `--stream-ms`, if asked for.
    pub server_stream: Option<StreamResult>,
    /// The bidi stream of `--bidi-ms`, if asked for.
    pub bidi: Option<StreamResult>,
}

/// Outcomes of one kind of unary call.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CallTally {
    /// Calls that returned OK (with the full reply, for large calls).
    pub ok: u64,
    /// Pod name (from the reply) -> OK calls it served.
    pub pods: BTreeMap<String, u64>,
    /// Pod name -> seconds since the client's start of its first reply.
    pub first_seen_s: BTreeMap<String, f64>,
    /// Per second since the client's start (by reply time): pod name -> OK calls.
    pub per_second: Vec<BTreeMap<String, u64>>,
    /// gRPC status name (`UNAVAILABLE`, ...) -> failed calls.
    pub failed: BTreeMap<String, u64>,
    /// The first failures (at most 20), in order.
    pub failures: Vec<Failure>,
    /// Median latency of the OK calls, in milliseconds.
    pub p50_ms: Option<f64>,
    /// 99th percentile latency of the OK calls, in milliseconds.
    pub p99_ms: Option<f64>,
}

/// One failed call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    /// Seconds since the client's start.
    pub at_s: f64,
    /// gRPC status name.
    pub code: String,
    /// The status message.
    pub message: String,
}

/// How a long-lived stream went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamResult {
    /// Replies the stream should carry.
    pub expected: u64,
    /// Replies it carried.
    pub messages: u64,
    /// Pod name -> replies (one pod: a stream lives on one connection).
    pub pods: BTreeMap<String, u64>,
    /// Its final status name (`OK` when it ended normally).
    pub code: String,
    /// Its status message.
    pub message: String,
}

impl CallTally {
    /// Failed calls of every status.
    #[must_use]
    pub fn failed_total(&self) -> u64 {
        self.failed.values().sum()
    }

    /// OK calls per pod whose reply came in the seconds `from..to` of the run (`per_second`'s
    /// indices; `usize::MAX`: to the end).
    #[must_use]
    pub fn pods_in(&self, from: usize, to: usize) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for second in self.per_second.iter().take(to).skip(from) {
            for (pod, n) in second {
                *out.entry(pod.clone()).or_default() += n;
            }
        }
        out
    }
}

impl StreamResult {
    /// Ended with OK after every expected reply.
    #[must_use]
    pub fn complete(&self) -> bool {
        self.code == "OK" && self.messages == self.expected
    }
}

impl ClientResult {
    /// Every failed call and every stream that did not complete, for assertion messages.
    #[must_use]
    pub fn failed_calls(&self) -> u64 {
        let streams = [&self.server_stream, &self.bidi]
            .into_iter()
            .flatten()
            .filter(|s| !s.complete())
            .count() as u64;
        self.unary.failed_total() + self.large.failed_total() + streams
    }
}

/// The largest share / the fair share over `ready` backends (the definition `observe` and
/// the connection-mode controller use): 1 is even, `ready` is everything on one backend.
#[must_use]
pub fn skew(pods: &BTreeMap<String, u64>, ready: usize) -> f64 {
    let total: u64 = pods.values().sum();
    let largest = pods.values().copied().max().unwrap_or(0);
    if total == 0 || ready == 0 {
        return 0.0;
    }
    #[expect(clippy::cast_precision_loss, reason = "call counts are far below 2^52")]
    let share = largest as f64 / total as f64;
    #[expect(clippy::cast_precision_loss, reason = "a handful of backends")]
    let fair = 1.0 / ready as f64;
    share / fair
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_in_adds_up_the_seconds_of_the_window() {
        let t = CallTally {
            per_second: vec![
                BTreeMap::from([("a".into(), 5)]),
                BTreeMap::from([("a".into(), 1), ("b".into(), 2)]),
                BTreeMap::from([("b".into(), 3)]),
            ],
            ..CallTally::default()
        };
        assert_eq!(
            t.pods_in(1, usize::MAX),
            BTreeMap::from([("a".into(), 1), ("b".into(), 5)])
        );
        assert!(t.pods_in(3, usize::MAX).is_empty());
        assert_eq!(
            t.pods_in(1, 2),
            BTreeMap::from([("a".into(), 1), ("b".into(), 2)])
        );
    }

    #[test]
    fn skew_is_largest_share_over_fair_share() {
        let even = BTreeMap::from([("a".into(), 10), ("b".into(), 10)]);
        assert!((skew(&even, 2) - 1.0).abs() < 1e-9);
        let pinned = BTreeMap::from([("a".into(), 10)]);
        assert!((skew(&pinned, 4) - 4.0).abs() < 1e-9);
        assert!(skew(&BTreeMap::new(), 4).abs() < 1e-9);
    }

    #[test]
    fn a_missing_field_is_a_parse_error_not_a_zero() {
        let text = r#"{"client":"grpcio","version":"1","start_unix_s":0.0,"elapsed_s":1.0,"unary":{"ok":1}}"#;
        assert!(
            serde_json::from_str::<ClientResult>(text).is_err(),
            "a client that leaves fields out must fail the contract"
        );
    }
}
