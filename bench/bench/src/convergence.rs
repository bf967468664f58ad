//! The rotation-convergence figure (issue 13 §5, the seed-001 scenario): pick_first clients
//! pinned to 2 pods, the endpoint set grows to 10 mid-run, and the figure is how long the
//! balancer takes to spread them: from the scale-up until every pod receives calls, and until
//! the skew stays under the threshold.
//!
//! The numbers come from the clients' own tallies (every echo reply names its pod), counted in
//! fixed buckets of time; the skew of a moment is computed over a sliding window of buckets
//! with the definition the agent reports: the largest pod's share of the calls divided by the
//! fair share over the ready pods.

use std::collections::BTreeMap;

use serde::Deserialize;

/// What `testing/py/rotation_client.py` prints: per bucket of `bucket_ms` from `start`
/// (seconds since the epoch), the calls each pod answered.
#[derive(Debug, Clone, Deserialize)]
pub struct ClientTally {
    /// Wall-clock start of bucket 0, seconds since the epoch.
    pub start: f64,
    /// Bucket length, milliseconds.
    pub bucket_ms: u64,
    /// Successful calls per pod, per bucket.
    pub buckets: Vec<BTreeMap<String, u64>>,
    /// Failed calls by gRPC status name.
    pub errors: BTreeMap<String, u64>,
    /// Times a channel's answering pod changed (its connection was moved), over all channels.
    pub moves: u64,
    /// Client channels (each one HTTP/2 connection).
    pub channels: u64,
}

/// Skew of every window position after the scale-up, and the convergence times.
#[derive(Debug, Clone, PartialEq)]
pub struct Convergence {
    /// (seconds from the scale-up to the window's start, skew over the window against the
    /// pods after the scale-up) for every window of the run, negative before the scale-up;
    /// the times below count only windows that start after it (to the bucket: the first
    /// starts at the first bucket boundary after it).
    pub skew: Vec<(f64, f64)>,
    /// Seconds from the scale-up to the start of the first window in which every ready pod
    /// answered a call (None: never within the run).
    pub all_receiving_s: Option<f64>,
    /// Seconds from the scale-up to the start of the first window from which the skew stays
    /// under the threshold until the end of the run (None: it never settled).
    pub settled_s: Option<f64>,
    /// The last window's skew.
    pub final_skew: f64,
    /// The last window's pod shares (0..=1), largest first.
    pub final_shares: Vec<(String, f64)>,
}

/// Skew of one window: the largest share of `counts` over the fair share of `ready` pods
/// (1.0 is even; `ready` is the most it can be). Pods not in `ready` still count in the
/// total. None when the window has no calls.
#[must_use]
pub fn skew(counts: &BTreeMap<String, u64>, ready: &[String]) -> Option<f64> {
    let total: u64 = counts.values().sum();
    if total == 0 || ready.is_empty() {
        return None;
    }
    let largest = counts.values().copied().max().unwrap_or(0);
    Some(largest as f64 / total as f64 * ready.len() as f64)
}

/// Analyses `tally` for a scale-up to `ready` pods at `scaled_at` (seconds since the epoch),
/// with windows of `window` buckets, against `threshold`.
#[must_use]
pub fn analyse(
    tally: &ClientTally,
    scaled_at: f64,
    ready: &[String],
    window: usize,
    threshold: f64,
) -> Convergence {
    let bucket_s = tally.bucket_ms as f64 / 1e3;
    let window = window.max(1);
    let mut skews = Vec::new();
    let mut all_receiving_s = None;
    let mut last = BTreeMap::new();
    for end in window..=tally.buckets.len() {
        let begin = end - window;
        let begin_t = tally.start + begin as f64 * bucket_s;
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        for b in &tally.buckets[begin..end] {
            for (pod, n) in b {
                *counts.entry(pod.clone()).or_default() += n;
            }
        }
        let Some(s) = skew(&counts, ready) else {
            continue;
        };
        // A window is timed by its start: from then on, for a whole window, the spread was
        // what it measured.
        let at = begin_t - scaled_at;
        skews.push((at, s));
        // Only windows wholly after the scale-up describe the new endpoint set.
        if at < -1e-9 {
            continue;
        }
        if all_receiving_s.is_none() && ready.iter().all(|p| counts.get(p).is_some_and(|n| *n > 0))
        {
            all_receiving_s = Some(at);
        }
        last = counts;
    }
    // The first window after the scale-up from which every window is under the threshold.
    let after: Vec<(f64, f64)> = skews.iter().copied().filter(|(t, _)| *t > -1e-9).collect();
    let settled_s = match after.iter().rposition(|(_, s)| *s >= threshold) {
        None => after.first().map(|(t, _)| *t),
        Some(i) => after.get(i + 1).map(|(t, _)| *t),
    };
    let total: u64 = last.values().sum();
    let mut final_shares: Vec<(String, f64)> = last
        .into_iter()
        .map(|(p, n)| (p, n as f64 / total.max(1) as f64))
        .collect();
    final_shares.sort_by(|a, b| b.1.total_cmp(&a.1));
    Convergence {
        final_skew: skews.last().map_or(f64::NAN, |(_, s)| *s),
        skew: skews,
        all_receiving_s,
        settled_s,
        final_shares,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("pod-{i}")).collect()
    }

    fn bucket(counts: &[(usize, u64)]) -> BTreeMap<String, u64> {
        counts
            .iter()
            .map(|(p, n)| (format!("pod-{p}"), *n))
            .collect()
    }

    #[test]
    fn skew_is_the_largest_share_over_the_fair_share() {
        let even = bucket(&[(0, 10), (1, 10)]);
        assert_eq!(skew(&even, &pods(2)), Some(1.0));
        // Two of ten pods take everything: each has 50%, fair is 10%.
        assert_eq!(skew(&even, &pods(10)), Some(5.0));
        assert_eq!(skew(&bucket(&[(0, 30), (1, 10)]), &pods(2)), Some(1.5));
        assert_eq!(skew(&BTreeMap::new(), &pods(2)), None);
    }

    #[test]
    fn convergence_is_timed_from_the_scale_up_until_the_skew_stays_under() {
        // 100 ms buckets from t=1000 s; scale-up from 2 to 4 pods at 1000.2 s. Buckets 0-3:
        // only pods 0 and 1; 4-5: pod 2 joins; from 6 on all four evenly, except one relapse
        // at bucket 8.
        let mut buckets = vec![bucket(&[(0, 10), (1, 10)]); 4];
        buckets.extend(vec![bucket(&[(0, 10), (1, 10), (2, 10)]); 2]);
        buckets.extend(vec![bucket(&[(0, 5), (1, 5), (2, 5), (3, 5)]); 2]);
        buckets.push(bucket(&[(0, 20), (1, 5), (2, 5), (3, 5)]));
        buckets.extend(vec![bucket(&[(0, 5), (1, 5), (2, 5), (3, 5)]); 5]);
        let tally = ClientTally {
            start: 1000.0,
            bucket_ms: 100,
            buckets,
            errors: BTreeMap::new(),
            moves: 3,
            channels: 4,
        };
        let c = analyse(&tally, 1000.2, &pods(4), 2, 1.5);
        // The first window wholly after the scale-up is buckets 2-3 (from 1000.2 s); the two
        // before it are in the series, from -0.2 s.
        assert!((c.skew[0].0 + 0.2).abs() < 1e-9, "{c:?}");
        let first = c.skew[2];
        assert!(
            first.0.abs() < 1e-9 && (first.1 - 2.0).abs() < 1e-9,
            "{c:?}"
        );
        // Pod 3 first answers in bucket 6: the window 5-6 starts at 1000.5 s.
        assert!((c.all_receiving_s.unwrap() - 0.3).abs() < 1e-9, "{c:?}");
        // Windows 7-8 and 8-9 (the relapse) have pod 0 at 25 of 55 calls: skew 1.82. The skew
        // stays under from window 9-10 (from 1000.9 s).
        assert!((c.settled_s.unwrap() - 0.7).abs() < 1e-9, "{c:?}");
        assert!((c.final_skew - 1.0).abs() < 1e-9);
        assert_eq!(c.final_shares.len(), 4);
        // Never settling is None, not the end of the run.
        let mut stuck = tally.clone();
        stuck.buckets.push(bucket(&[(0, 50), (1, 1)]));
        assert_eq!(analyse(&stuck, 1000.2, &pods(4), 2, 1.5).settled_s, None);
    }

    #[test]
    fn the_client_tally_parses() {
        let t: ClientTally = serde_json::from_str(
            r#"{"start": 5.5, "bucket_ms": 250, "buckets": [{"pod-0": 3}, {}],
                "errors": {"UNAVAILABLE": 1}, "moves": 2, "channels": 10}"#,
        )
        .unwrap();
        assert_eq!(t.buckets.len(), 2);
        assert_eq!(t.errors["UNAVAILABLE"], 1);
    }
}
