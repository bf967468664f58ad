//! The markdown output: results tables, the per-cell verdicts against the issues' targets, and
//! the section of docs/benchmarks.md the command rewrites.

use std::fmt::Write as _;

use crate::stats::Summary;

/// The `direct-healthy` cell with the same delay, connections and loop kind.
fn baseline<'a>(cells: &'a [Summary], s: &Summary) -> Option<&'a Summary> {
    cells.iter().find(|b| {
        b.target == "direct-healthy"
            && b.delay_ms == s.delay_ms
            && b.connections == s.connections
            && b.offered_rps.is_some() == s.offered_rps.is_some()
    })
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

fn ratio(v: f64, base: Option<f64>) -> String {
    base.filter(|b| *b > 0.0)
        .map_or_else(|| "n/a".to_owned(), |b| format!("{:.2}x", v / b))
}

/// The closed-loop results table: one line per cell, RPS and CPU as median (min–max) over the
/// runs, and RPS and p99 as multiples of the direct-healthy cell of the same delay and
/// connections.
#[must_use]
pub fn markdown_table(cells: &[Summary]) -> String {
    let mut t = String::new();
    t.push_str("| delay ms | conns | target | runs | RPS | RPS / direct-healthy | p50 ms | p99 ms | p99.9 ms | p99 / direct-healthy | slow pod share | errors | cores / 1k RPS | peak RSS MiB |\n");
    t.push_str("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for s in cells.iter().filter(|s| s.offered_rps.is_none()) {
        let base = baseline(cells, s);
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {} | {:.1}% | {} | {} | {} |",
            s.delay_ms,
            s.connections,
            s.target,
            s.runs,
            s.rps.show(0),
            ratio(s.rps.median, base.map(|b| b.rps.median)),
            s.p50_ms,
            s.p99_ms,
            s.p999_ms,
            ratio(s.p99_ms, base.map(|b| b.p99_ms)),
            s.slow_share * 100.0,
            s.errors,
            s.cores_per_krps
                .map_or_else(|| "-".to_owned(), |c| c.show(3)),
            opt(s.peak_rss_mib, 1),
        );
    }
    t
}

/// The open-loop table: every target at the same offered rate; latency counts from each
/// call's intended send time, so a target that falls behind shows it.
#[must_use]
pub fn open_table(cells: &[Summary]) -> String {
    let mut t = String::new();
    t.push_str("| delay ms | conns | target | runs | offered RPS | achieved RPS | p50 ms | p99 ms | p99.9 ms | p99 / direct-healthy | slow pod share | late | not sent | unfinished | errors | cores / 1k RPS | peak RSS MiB |\n");
    t.push_str(
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for s in cells.iter().filter(|s| s.offered_rps.is_some()) {
        let base = baseline(cells, s);
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {} | {:.1}% | {} | {} | {} | {} | {} | {} |",
            s.delay_ms,
            s.connections,
            s.target,
            s.runs,
            opt(s.offered_rps, 0),
            s.rps.show(0),
            s.p50_ms,
            s.p99_ms,
            s.p999_ms,
            ratio(s.p99_ms, base.map(|b| b.p99_ms)),
            s.slow_share * 100.0,
            s.late,
            s.not_sent,
            s.unfinished,
            s.errors,
            s.cores_per_krps
                .map_or_else(|| "-".to_owned(), |c| c.show(3)),
            opt(s.peak_rss_mib, 1),
        );
    }
    t
}

fn yes(b: bool) -> &'static str {
    if b { "met" } else { "NOT met" }
}

fn peer<'a>(cells: &'a [Summary], ours: &Summary, name: &str) -> Option<&'a Summary> {
    cells.iter().find(|r| {
        r.target == name
            && r.delay_ms == ours.delay_ms
            && r.connections == ours.connections
            && r.offered_rps.is_some() == ours.offered_rps.is_some()
    })
}

/// The issue-4 targets checked per closed-loop (delay, connections) cell on the medians:
/// skewless RPS >= 1.25x HAProxy's, skewless cores per 1k RPS <= HAProxy's, skewless peak RSS
/// < 40 MiB, and skewless p99 against the best L7 peer's. Returns the table and whether every
/// target was met in every cell.
#[must_use]
pub fn targets_table(cells: &[Summary]) -> (String, bool) {
    let mut t = String::new();
    let mut all = true;
    t.push_str("| delay ms | conns | runs | RPS skewless / HAProxy (>= 1.25) | cores/1k RPS skewless vs HAProxy (<=) | peak RSS skewless (< 40 MiB) | p99 skewless vs best of HAProxy/nginx |\n");
    t.push_str("|---:|---:|---:|---|---|---|---|\n");
    for ours in cells
        .iter()
        .filter(|r| r.target == "skewless" && r.offered_rps.is_none())
    {
        let Some(ha) = peer(cells, ours, "haproxy") else {
            continue;
        };
        let rps_ratio = ours.rps.median / ha.rps.median.max(1e-9);
        let (our_cpu, ha_cpu) = (
            ours.cores_per_krps.map(|c| c.median),
            ha.cores_per_krps.map(|c| c.median),
        );
        let cpu_ok = matches!((our_cpu, ha_cpu), (Some(a), Some(b)) if a <= b);
        let rss = ours.peak_rss_mib.unwrap_or(f64::INFINITY);
        let best_peer_p99 = [Some(ha), peer(cells, ours, "nginx")]
            .into_iter()
            .flatten()
            .map(|r| r.p99_ms)
            .fold(f64::INFINITY, f64::min);
        let p99_ok = ours.p99_ms <= best_peer_p99;
        all &= rps_ratio >= 1.25 && cpu_ok && rss < 40.0 && p99_ok;
        let _ = writeln!(
            t,
            "| {} | {} | {} | {:.2}x {} ({:.0} / {:.0}) | {} vs {} {} | {:.1} MiB {} | {:.2} vs {:.2} ms {} |",
            ours.delay_ms,
            ours.connections,
            ours.runs.min(ha.runs),
            rps_ratio,
            yes(rps_ratio >= 1.25),
            ours.rps.median,
            ha.rps.median,
            opt(our_cpu, 3),
            opt(ha_cpu, 3),
            yes(cpu_ok),
            rss,
            yes(rss < 40.0),
            ours.p99_ms,
            best_peer_p99,
            if p99_ok {
                "lower (met)"
            } else {
                "higher (NOT met)"
            },
        );
    }
    (t, all)
}

/// At equal offered load (open loop): skewless's p99 and p99.9 against the better of HAProxy
/// and nginx, and whether it kept the offered rate (nothing left unsent or unfinished).
#[must_use]
pub fn open_targets_table(cells: &[Summary]) -> String {
    let mut t = String::new();
    t.push_str("| delay ms | conns | offered RPS | p99 skewless vs best of HAProxy/nginx | p99.9 skewless vs best of HAProxy/nginx | skewless kept the rate |\n");
    t.push_str("|---:|---:|---:|---|---|---|\n");
    for ours in cells
        .iter()
        .filter(|r| r.target == "skewless" && r.offered_rps.is_some())
    {
        let peers: Vec<&Summary> = ["haproxy", "nginx"]
            .iter()
            .filter_map(|n| peer(cells, ours, n))
            .collect();
        if peers.is_empty() {
            continue;
        }
        let best =
            |f: fn(&Summary) -> f64| peers.iter().map(|p| f(p)).fold(f64::INFINITY, f64::min);
        let (p99, p999) = (best(|s| s.p99_ms), best(|s| s.p999_ms));
        let cmp = |ours: f64, best: f64| {
            if ours <= best {
                format!("{ours:.2} vs {best:.2} ms lower (met)")
            } else {
                format!("{ours:.2} vs {best:.2} ms higher (NOT met)")
            }
        };
        let kept = ours.not_sent == 0 && ours.unfinished == 0 && ours.errors == 0;
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {} |",
            ours.delay_ms,
            ours.connections,
            opt(ours.offered_rps, 0),
            cmp(ours.p99_ms, p99),
            cmp(ours.p999_ms, p999),
            if kept {
                "yes".to_owned()
            } else {
                format!(
                    "no ({} not sent, {} unfinished, {} errors)",
                    ours.not_sent, ours.unfinished, ours.errors
                )
            },
        );
    }
    t
}

/// Replaces the section that starts with the line `heading` (up to the next `## ` heading or
/// the end) by `section`, or appends `section` when there is none.
#[must_use]
pub fn replace_section(doc: &str, heading: &str, section: &str) -> String {
    let Some(start) = doc.lines().position(|l| l.trim_end() == heading) else {
        let mut out = doc.trim_end().to_owned();
        out.push_str("\n\n");
        out.push_str(section.trim_end());
        out.push('\n');
        return out;
    };
    let lines: Vec<&str> = doc.lines().collect();
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.starts_with("## "))
        .map_or(lines.len(), |i| start + 1 + i);
    let mut out = lines[..start].join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    out.push_str(section.trim_end());
    out.push('\n');
    if end < lines.len() {
        out.push('\n');
        out.push_str(&lines[end..].join("\n"));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::summarize;
    use crate::stats::tests::row;
    use crate::stats::{Row, Spread};

    #[test]
    fn tables_use_ratios_and_check_targets() {
        let rows = vec![
            row("direct-healthy", 10_000.0, 4.0, None, None),
            row("haproxy", 8_000.0, 12.0, Some(0.05), Some(20.0)),
            row("nginx", 7_000.0, 16.0, Some(0.06), Some(10.0)),
            row("skewless", 10_000.0, 8.0, Some(0.04), Some(12.0)),
        ];
        let cells = summarize(&rows);
        let t = markdown_table(&cells);
        assert!(
            t.contains("| 50 | 1 | skewless | 1 | 10000 | 1.00x |"),
            "{t}"
        );
        assert!(t.contains("| 2.00x |"), "p99 8 / 4: {t}");
        assert!(t.contains("| 3.00x |"), "p99 12 / 4: {t}");
        assert!(t.contains("| 0.80x |"), "RPS 8000 / 10000: {t}");
        let (targets, all) = targets_table(&cells);
        assert!(all, "{targets}");
        assert!(targets.contains("1.25x met"), "{targets}");
        let mut worse = rows.clone();
        worse[3].rps = 9_000.0;
        let (targets, all) = targets_table(&summarize(&worse));
        assert!(!all);
        assert!(targets.contains("1.12x NOT met"), "{targets}");
    }

    #[test]
    fn repeats_fold_into_medians_and_verdicts_use_them() {
        // Three interleaved repeats; one noisy skewless run must not decide the verdict.
        let mut rows = Vec::new();
        for (ha, ours) in [(8_000.0, 10_500.0), (8_100.0, 6_000.0), (7_900.0, 10_200.0)] {
            rows.push(row("direct-healthy", 12_000.0, 4.0, None, None));
            rows.push(row("skewless", ours, 8.0, Some(0.04), Some(12.0)));
            rows.push(row("haproxy", ha, 12.0, Some(0.05), Some(20.0)));
        }
        rows[1].peak_rss_mib = Some(41.0);
        let cells = summarize(&rows);
        assert_eq!(cells.len(), 3, "one cell per target");
        assert_eq!(
            cells.iter().map(|c| c.target.as_str()).collect::<Vec<_>>(),
            ["direct-healthy", "haproxy", "skewless"],
            "chart order, not run order"
        );
        let ours = &cells[2];
        assert_eq!(ours.runs, 3);
        assert_eq!(
            ours.rps,
            Spread {
                median: 10_200.0,
                min: 6_000.0,
                max: 10_500.0
            }
        );
        assert_eq!(
            ours.peak_rss_mib,
            Some(41.0),
            "peak RSS is the largest run's"
        );
        let t = markdown_table(&cells);
        assert!(t.contains("| 10200 (6000–10500) |"), "{t}");
        let (targets, all) = targets_table(&cells);
        assert!(targets.contains("1.27x met (10200 / 8000)"), "{targets}");
        assert!(targets.contains("41.0 MiB NOT met"), "{targets}");
        assert!(!all, "the RSS target fails");
    }

    #[test]
    fn open_loop_cells_are_compared_at_equal_offered_load() {
        let open = |target: &str, p99: f64, p999: f64, not_sent: u64| Row {
            offered_rps: Some(6_000.0),
            rps: 6_000.0,
            p99_ms: p99,
            p999_ms: p999,
            not_sent,
            ..row(target, 0.0, 0.0, None, None)
        };
        let rows = vec![
            row("haproxy", 10_000.0, 12.0, Some(0.05), Some(20.0)),
            open("direct-healthy", 5.0, 7.0, 0),
            open("haproxy", 55.0, 60.0, 0),
            open("nginx", 60.0, 65.0, 0),
            open("skewless", 9.0, 70.0, 3),
        ];
        let cells = summarize(&rows);
        let closed = markdown_table(&cells);
        assert_eq!(closed.lines().count(), 3, "only the closed cell: {closed}");
        let t = open_table(&cells);
        assert!(t.contains("| 50 | 1 | skewless | 1 | 6000 | 6000 |"), "{t}");
        assert!(
            t.contains("| 1.80x |"),
            "p99 9 / 5 against the open direct-healthy: {t}"
        );
        let v = open_targets_table(&cells);
        assert!(v.contains("9.00 vs 55.00 ms lower (met)"), "{v}");
        assert!(v.contains("70.00 vs 60.00 ms higher (NOT met)"), "{v}");
        assert!(v.contains("no (3 not sent"), "{v}");
        let (targets, _) = targets_table(&cells);
        assert_eq!(
            targets.lines().count(),
            2,
            "no closed skewless cell: {targets}"
        );
    }

    #[test]
    fn section_is_replaced_or_appended() {
        let doc = "# B\n\n## connect4\n\nold hook\n\n## Proxies side by side\n\nold\n";
        let new = replace_section(
            doc,
            "## Proxies side by side",
            "## Proxies side by side\n\nnew\n",
        );
        assert_eq!(
            new,
            "# B\n\n## connect4\n\nold hook\n\n## Proxies side by side\n\nnew\n"
        );
        let doc2 = "# B\n\n## connect4\n\nold hook\n";
        let appended = replace_section(
            doc2,
            "## Proxies side by side",
            "## Proxies side by side\n\nnew\n",
        );
        assert!(appended.starts_with(doc2.trim_end()));
        assert!(appended.ends_with("## Proxies side by side\n\nnew\n"));
        let mid = "## A\na\n## Proxies side by side\nold\n## C\nc\n";
        assert_eq!(
            replace_section(
                mid,
                "## Proxies side by side",
                "## Proxies side by side\nnew\n"
            ),
            "## A\na\n## Proxies side by side\nnew\n\n## C\nc\n"
        );
    }
}
