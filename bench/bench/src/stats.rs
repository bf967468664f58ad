//! Runs and their folding: one [`Row`] per measured run, the interleaved order of repeated
//! runs, and one [`Summary`] (median and range) per cell.

use skewless_loadgen::Report;

/// One measured run.
#[derive(Debug, Clone, Default)]
pub struct Row {
    /// Delay of the slow pod, ms.
    pub delay_ms: u64,
    /// Client HTTP/2 connections.
    pub connections: usize,
    /// What was loaded: one of [`TARGET_ORDER`], or a second build of skewless-proxy
    /// (`skewless@LABEL`).
    pub target: String,
    /// Open loop: the offered rate, calls per second (None for closed loop).
    pub offered_rps: Option<f64>,
    /// Successful calls per second.
    pub rps: f64,
    /// Latency quantiles, ms.
    pub p50_ms: f64,
    /// p99, ms.
    pub p99_ms: f64,
    /// p99.9, ms.
    pub p999_ms: f64,
    /// The slow pod's share of successful calls (0..=1).
    pub slow_share: f64,
    /// Failed calls.
    pub errors: u64,
    /// Open loop: calls sent more than 5 ms after their intended time.
    pub late: u64,
    /// Open loop: calls due in the window but never sent (the sender fell behind).
    pub not_sent: u64,
    /// Open loop: sent calls with no answer within the load generator's drain time.
    pub unfinished: u64,
    /// Proxy CPU over the measured window, in cores per 1,000 RPS (None for direct runs).
    pub cores_per_krps: Option<f64>,
    /// Proxy peak RSS in MiB, summed over its processes (None for direct runs).
    pub peak_rss_mib: Option<f64>,
    /// Which repeat of its cell this run was (0 for the first pass): runs of two targets with
    /// the same repeat ran in the same pass, close in time.
    pub repeat: usize,
}

impl Row {
    /// Whether `other` loaded the same cell (delay, connections, closed or open loop).
    #[must_use]
    pub fn same_cell(&self, other: &Row) -> bool {
        self.delay_ms == other.delay_ms
            && self.connections == other.connections
            && self.offered_rps.is_some() == other.offered_rps.is_some()
    }

    /// Fills the load generator's fields from its report (`skewless-loadgen run --json`).
    pub fn set_load(&mut self, report: &Report, slow_pod: &str) {
        let ms = |us: u64| us as f64 / 1e3;
        self.rps = report.rps;
        self.p50_ms = ms(report.p50_us);
        self.p99_ms = ms(report.p99_us);
        self.p999_ms = ms(report.p999_us);
        self.slow_share = if report.ok > 0 {
            report.share(slow_pod)
        } else {
            0.0
        };
        self.errors = report.failed();
        if let Some(o) = report.open() {
            self.offered_rps = Some(o.target_rps);
            self.late = o.late;
            self.not_sent = o.not_sent;
            self.unfinished = o.unfinished;
        }
    }
}

/// The order of the runs of `cells`, each given as (cell, its targets, its repeats): pass `p`
/// runs, in cell order, every cell repeated more than `p` times, with its targets rotated left
/// by `p`. So a cell's repeats are spread over the whole run instead of back to back, and each
/// target takes every position in turn: a burst of load from other work on the machine lands
/// on every target alike rather than on one proxy's runs.
#[must_use]
pub fn interleave<C: Copy, T: Copy>(cells: &[(C, Vec<T>, usize)]) -> Vec<(C, T)> {
    let passes = cells.iter().map(|(_, _, n)| *n).max().unwrap_or(0);
    let mut order = Vec::new();
    for pass in 0..passes {
        for (cell, targets, repeats) in cells {
            if pass >= *repeats || targets.is_empty() {
                continue;
            }
            let mut t = targets.clone();
            let n = pass % t.len();
            t.rotate_left(n);
            order.extend(t.into_iter().map(|t| (*cell, t)));
        }
    }
    order
}

/// The runs of targets `a` and `b` in the cell of `like`, paired by repeat (the same pass of
/// the interleaved order), in repeat order; a repeat only one of them has is left out.
#[must_use]
pub fn pairs<'a>(rows: &'a [Row], like: &Row, a: &str, b: &str) -> Vec<(&'a Row, &'a Row)> {
    let of = |t: &str| -> Vec<&'a Row> {
        let mut v: Vec<&Row> = rows
            .iter()
            .filter(|r| r.target == t && r.same_cell(like))
            .collect();
        v.sort_by_key(|r| r.repeat);
        v
    };
    let bs = of(b);
    of(a)
        .into_iter()
        .filter_map(|ra| Some((ra, *bs.iter().find(|rb| rb.repeat == ra.repeat)?)))
        .collect()
}

/// Median and range of one measure over a cell's repeats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// The median (mean of the two middle values for an even count).
    pub median: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

impl Spread {
    /// The spread of `values`; None when there are none.
    #[must_use]
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Self> {
        let mut v: Vec<f64> = values.into_iter().collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            f64::midpoint(v[n / 2 - 1], v[n / 2])
        };
        Some(Self {
            median,
            min: v[0],
            max: v[n - 1],
        })
    }

    /// A distribution-free interval holding the median of what `values` sample with at least
    /// 95% confidence: the `k`-th smallest and `k`-th largest value for the largest `k` whose
    /// binomial tail (n trials, p = 1/2) leaves at most 2.5% on either side. None for fewer
    /// than 6 values (no such `k` exists).
    #[must_use]
    pub fn median_interval(values: impl IntoIterator<Item = f64>) -> Option<(f64, f64)> {
        let mut v: Vec<f64> = values.into_iter().collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        // P(Bin(n, 1/2) <= j) for j = 0, 1, ...: the chance that fewer than j + 1 values fall
        // below the median.
        let mut tail = 0.0;
        let mut choose = 1.0;
        let mut k = 0;
        for j in 0..n {
            tail += choose * 0.5f64.powi(i32::try_from(n).ok()?);
            if tail > 0.025 {
                break;
            }
            k = j + 1;
            #[expect(clippy::cast_precision_loss, reason = "n is a few dozen runs")]
            {
                choose = choose * (n - j) as f64 / (j + 1) as f64;
            }
        }
        (k > 0).then(|| (v[k - 1], v[n - k]))
    }

    /// `median (min–max)` with `digits` decimals, or just the value for a single run.
    #[must_use]
    pub fn show(&self, digits: usize) -> String {
        if (self.max - self.min).abs() < f64::EPSILON {
            format!("{:.digits$}", self.median)
        } else {
            format!(
                "{:.digits$} ({:.digits$}–{:.digits$})",
                self.median, self.min, self.max
            )
        }
    }
}

/// The runs of one cell (delay, connections, target, closed or open loop) folded together:
/// the median and range of RPS and CPU, the median of each latency quantile over the runs (as
/// the seed benchmark reports percentiles across its repeats), the median slow-pod share,
/// summed error counts and the largest peak RSS.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Delay of the slow pod, ms.
    pub delay_ms: u64,
    /// Client HTTP/2 connections.
    pub connections: usize,
    /// What was loaded.
    pub target: String,
    /// Open loop: the offered rate (None for closed loop).
    pub offered_rps: Option<f64>,
    /// Runs folded in.
    pub runs: usize,
    /// Successful calls per second.
    pub rps: Spread,
    /// Median p50 over the runs, ms.
    pub p50_ms: f64,
    /// Median p99 over the runs, ms.
    pub p99_ms: f64,
    /// Median p99.9 over the runs, ms.
    pub p999_ms: f64,
    /// Median slow-pod share.
    pub slow_share: f64,
    /// Failed calls over all runs.
    pub errors: u64,
    /// Open loop, over all runs: late, never sent and unfinished calls.
    pub late: u64,
    /// See `late`.
    pub not_sent: u64,
    /// See `late`.
    pub unfinished: u64,
    /// Proxy CPU, cores per 1,000 RPS (None for direct runs).
    pub cores_per_krps: Option<Spread>,
    /// Largest proxy peak RSS over the runs, MiB.
    pub peak_rss_mib: Option<f64>,
}

/// The targets in table and chart order. Names not listed (second builds, `skewless@LABEL`)
/// come after them, in name order.
pub const TARGET_ORDER: &[&str] = &[
    "direct-healthy",
    "direct-slow",
    "l4-roundrobin",
    "haproxy",
    "nginx",
    "skewless",
    "skewless-connection",
];

/// A target's place in [`TARGET_ORDER`] (after them for the others).
#[must_use]
pub fn target_index(target: &str) -> usize {
    TARGET_ORDER
        .iter()
        .position(|n| *n == target)
        .unwrap_or(TARGET_ORDER.len())
}

/// Folds repeated runs into one [`Summary`] per cell, closed-loop cells first, then by delay,
/// connections and target (in chart order).
#[must_use]
pub fn summarize(rows: &[Row]) -> Vec<Summary> {
    let key = |r: &Row| {
        (
            r.offered_rps.is_some(),
            r.delay_ms,
            r.connections,
            target_index(&r.target),
            r.target.clone(),
        )
    };
    let mut keys: Vec<_> = rows.iter().map(key).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter_map(|k| {
            let runs: Vec<&Row> = rows.iter().filter(|r| key(r) == k).collect();
            let first = runs.first()?;
            let median =
                |f: fn(&Row) -> f64| Spread::of(runs.iter().map(|r| f(r))).map(|s| s.median);
            Some(Summary {
                delay_ms: first.delay_ms,
                connections: first.connections,
                target: first.target.clone(),
                offered_rps: median(|r| r.offered_rps.unwrap_or(0.0)).filter(|_| k.0),
                runs: runs.len(),
                rps: Spread::of(runs.iter().map(|r| r.rps))?,
                p50_ms: median(|r| r.p50_ms)?,
                p99_ms: median(|r| r.p99_ms)?,
                p999_ms: median(|r| r.p999_ms)?,
                slow_share: median(|r| r.slow_share)?,
                errors: runs.iter().map(|r| r.errors).sum(),
                late: runs.iter().map(|r| r.late).sum(),
                not_sent: runs.iter().map(|r| r.not_sent).sum(),
                unfinished: runs.iter().map(|r| r.unfinished).sum(),
                cores_per_krps: Spread::of(runs.iter().filter_map(|r| r.cores_per_krps)),
                peak_rss_mib: runs.iter().filter_map(|r| r.peak_rss_mib).reduce(f64::max),
            })
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn row(
        target: &str,
        rps: f64,
        p99: f64,
        cores: Option<f64>,
        rss: Option<f64>,
    ) -> Row {
        Row {
            delay_ms: 50,
            connections: 1,
            target: target.to_owned(),
            rps,
            p99_ms: p99,
            cores_per_krps: cores,
            peak_rss_mib: rss,
            ..Row::default()
        }
    }

    #[test]
    fn the_median_interval_widens_to_the_order_statistics_the_binomial_tail_allows() {
        let values = |n: usize| (1..=n).map(|i| i as f64);
        assert_eq!(
            Spread::median_interval(values(5)),
            None,
            "5 runs: no 95% interval"
        );
        // 6 runs: P(all 6 on one side) = 2/64, so only min..max holds 95%.
        assert_eq!(Spread::median_interval(values(6)), Some((1.0, 6.0)));
        // 16 runs: P(Bin(16, 1/2) <= 3) = 1.1%, P(<= 4) = 3.8%.
        assert_eq!(Spread::median_interval(values(16)), Some((4.0, 13.0)));
        // Unsorted input is sorted first.
        assert_eq!(
            Spread::median_interval([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]),
            Some((1.0, 6.0))
        );
    }

    #[test]
    fn repeats_are_interleaved_with_rotated_targets() {
        let order = interleave(&[("a", vec!['x', 'y', 'z'], 3), ("b", vec!['x', 'y'], 1)]);
        assert_eq!(
            order,
            [
                ("a", 'x'),
                ("a", 'y'),
                ("a", 'z'),
                ("b", 'x'),
                ("b", 'y'),
                ("a", 'y'),
                ("a", 'z'),
                ("a", 'x'),
                ("a", 'z'),
                ("a", 'x'),
                ("a", 'y'),
            ]
        );
        // A bigger grid: every run happens as often as asked, never twice in a row, and each
        // target of a repeated cell leads a different pass.
        let targets: Vec<u8> = (0..6).collect();
        let cells: Vec<(usize, Vec<u8>, usize)> = (0..4).map(|c| (c, targets.clone(), 3)).collect();
        let order = interleave(&cells);
        assert_eq!(order.len(), 4 * 6 * 3);
        for c in 0..4 {
            for t in &targets {
                let n = order.iter().filter(|r| **r == (c, *t)).count();
                assert_eq!(n, 3, "cell {c} target {t} runs 3 times");
            }
        }
        assert!(
            order.windows(2).all(|w| w[0] != w[1]),
            "no run repeats back to back"
        );
        let leaders: Vec<u8> = order.chunks(4 * 6).map(|pass| pass[0].1).collect();
        assert_eq!(leaders, [0, 1, 2], "the first slot rotates");
        assert!(interleave::<u8, u8>(&[(1, vec![], 3)]).is_empty());
    }

    #[test]
    fn spread_is_median_and_range() {
        let s = Spread::of([3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(Spread::of([4.0, 1.0, 2.0, 3.0]).unwrap().median, 2.5);
        assert!(Spread::of([]).is_none());
        assert_eq!(s.show(1), "2.0 (1.0–3.0)");
        assert_eq!(Spread::of([5.0]).unwrap().show(0), "5");
    }

    #[test]
    fn loadgen_report_fills_a_row() {
        let json = r#"{"mode": "closed", "ok": 1000, "elapsed_s": 2.0, "rps": 500.0,
            "p50_us": 1500, "p90_us": 5000, "p99_us": 9000, "p999_us": 12000, "max_us": 13000,
            "pods": {"pod-0": 800, "pod-4": 200}, "errors": {"Unavailable": 3}}"#;
        let report: Report = serde_json::from_str(json).unwrap();
        let mut r = Row::default();
        r.set_load(&report, "pod-4");
        assert!((r.slow_share - 0.2).abs() < 1e-9);
        assert!((r.p99_ms - 9.0).abs() < 1e-9);
        assert_eq!(r.errors, 3);
        assert_eq!(r.offered_rps, None);
        let open = json.replace(
            r#""mode": "closed""#,
            r#""mode": "open", "target_rps": 600.0, "scheduled": 1000, "sent": 998,
               "late": 4, "not_sent": 2, "unfinished": 1"#,
        );
        let report: Report = serde_json::from_str(&open).unwrap();
        let mut r = Row::default();
        r.set_load(&report, "pod-4");
        assert_eq!(r.offered_rps, Some(600.0));
        assert_eq!((r.late, r.not_sent, r.unfinished), (4, 2, 1));
    }
}
