//! The markdown output: results tables, the per-cell verdicts against the issues' targets, and
//! the section of docs/benchmarks.md the command rewrites.

use std::fmt::Write as _;

use crate::stats::{Row, Spread, Summary, pairs};

/// The most request-mode CPU per call may rise against the baseline build (issues 10 and 11).
pub const BUILD_CPU_BAR: f64 = 1.03;

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

/// Connection mode's CPU per call may be at most this share of HAProxy h2's (issue 13).
pub const CONNECTION_CPU_BAR: f64 = 0.35;
/// Connection mode may add at most this much p50 over direct at low load, ms (issue 13).
pub const CONNECTION_P50_BAR_MS: f64 = 0.1;
/// Connection mode's peak RSS at 8 connections must stay under this, MiB (issue 13).
pub const CONNECTION_RSS_BAR_MIB: f64 = 40.0;

/// The connection-mode targets of issue 13 per closed-loop cell, on the medians: CPU per
/// call against HAProxy h2's (at most [`CONNECTION_CPU_BAR`] of it) and, for reference,
/// against HAProxy tcp's (`l4-roundrobin`, where the cell has it) and request mode's; peak
/// RSS, judged at 8 connections. Empty (header only) without `skewless-connection` cells.
#[must_use]
pub fn connection_targets_table(cells: &[Summary]) -> String {
    let mut t = String::new();
    t.push_str("| delay ms | conns | runs | cores/1k RPS connection mode | / HAProxy h2 (<= 0.35x) | / HAProxy tcp | / request mode | peak RSS MiB (< 40 at 8 conns) |\n");
    t.push_str("|---:|---:|---:|---:|---|---|---|---|\n");
    for ours in cells
        .iter()
        .filter(|r| r.target == "skewless-connection" && r.offered_rps.is_none())
    {
        let cpu = |s: Option<&Summary>| s.and_then(|s| s.cores_per_krps).map(|c| c.median);
        let Some(our_cpu) = cpu(Some(ours)) else {
            continue;
        };
        let vs = |name: &str| cpu(peer(cells, ours, name)).map(|c| our_cpu / c.max(1e-12));
        let h2 = vs("haproxy");
        let rss = ours.peak_rss_mib.unwrap_or(f64::INFINITY);
        let _ = writeln!(
            t,
            "| {} | {} | {} | {:.4} | {} | {} | {} | {:.1} {} |",
            ours.delay_ms,
            ours.connections,
            ours.runs,
            our_cpu,
            h2.map_or_else(
                || "-".to_owned(),
                |r| format!("{r:.2}x {}", yes(r <= CONNECTION_CPU_BAR))
            ),
            vs("l4-roundrobin").map_or_else(|| "-".to_owned(), |r| format!("{r:.2}x")),
            vs("skewless").map_or_else(|| "-".to_owned(), |r| format!("{r:.2}x")),
            rss,
            if ours.connections == 8 {
                yes(rss < CONNECTION_RSS_BAR_MIB)
            } else {
                "(judged at 8)"
            },
        );
    }
    t
}

/// The low-load runs (one call in flight on one connection, no slow pod): per target its p50
/// and p99 (medians over the runs) and the p50 it adds over `direct-healthy`, as the median
/// (min–max) of the differences of the runs of the same pass; connection mode's is judged
/// against [`CONNECTION_P50_BAR_MS`].
#[must_use]
pub fn low_load_table(rows: &[Row]) -> String {
    let mut targets: Vec<&str> = rows.iter().map(|r| r.target.as_str()).collect();
    targets.sort_by_key(|t| (crate::stats::target_index(t), *t));
    targets.dedup();
    let mut t = String::new();
    t.push_str("| target | runs | RPS | p50 ms | p99 ms | p50 added over direct-healthy, ms, per pass | connection mode: added p50 <= 0.1 ms |\n");
    t.push_str("|---|---:|---:|---:|---:|---|---|\n");
    for target in targets {
        let runs: Vec<&Row> = rows.iter().filter(|r| r.target == target).collect();
        let Some(first) = runs.first() else {
            continue;
        };
        let med = |f: fn(&Row) -> f64| Spread::of(runs.iter().map(|r| f(r)));
        let added = Spread::of(
            pairs(rows, first, target, "direct-healthy")
                .iter()
                .map(|(a, b)| a.p50_ms - b.p50_ms),
        );
        let verdict = match (target, added) {
            ("skewless-connection", Some(a)) => yes(a.median <= CONNECTION_P50_BAR_MS),
            _ => "",
        };
        let _ = writeln!(
            t,
            "| {target} | {} | {} | {} | {:.3} | {} | {verdict} |",
            runs.len(),
            med(|r| r.rps).map_or_else(|| "-".to_owned(), |s| s.show(0)),
            med(|r| r.p50_ms).map_or_else(|| "-".to_owned(), |s| s.show(3)),
            med(|r| r.p99_ms).map_or(f64::NAN, |s| s.median),
            if target == "direct-healthy" {
                "-".to_owned()
            } else {
                added.map_or_else(|| "-".to_owned(), |a| a.show(3))
            },
        );
    }
    t
}

/// Every second build (`skewless@LABEL`) against `skewless` of the same run, per cell: CPU per
/// call (microseconds, from the cores per 1,000 RPS) of both, the ratio skewless / build of
/// each pair of runs from the same pass (medians of ratios hold when the machine's speed
/// drifts between passes), RPS, p99 and peak RSS. The verdict is the median pair ratio against
/// [`BUILD_CPU_BAR`].
#[must_use]
pub fn builds_table(rows: &[Row]) -> String {
    let mut builds: Vec<&str> = rows
        .iter()
        .map(|r| r.target.as_str())
        .filter(|t| t.starts_with("skewless@"))
        .collect();
    builds.sort_unstable();
    builds.dedup();
    let mut cells: Vec<&Row> = Vec::new();
    for r in rows {
        if builds.contains(&r.target.as_str()) && !cells.iter().any(|c| c.same_cell(r)) {
            cells.push(r);
        }
    }
    cells.sort_by_key(|r| (r.offered_rps.is_some(), r.delay_ms, r.connections));
    let mut t = String::new();
    t.push_str("| delay ms | conns | loop | build | pairs | CPU us/call skewless | CPU us/call build | skewless / build, per pair | 95% interval of the median pair | pairs over 1.03x | RPS skewless / build | p99 ms skewless / build | peak RSS MiB skewless / build | CPU per call <= 1.03x build |\n");
    t.push_str("|---:|---:|---|---|---:|---:|---:|---|---|---:|---|---|---|---|\n");
    for cell in cells {
        for build in &builds {
            let p = pairs(rows, cell, "skewless", build);
            let us = |r: &Row| r.cores_per_krps.map(|c| c * 1000.0);
            let each: Vec<f64> = p
                .iter()
                .filter_map(|(a, b)| Some(us(a)? / us(b)?))
                .collect();
            let interval = Spread::median_interval(each.iter().copied())
                .map_or_else(|| "-".to_owned(), |(lo, hi)| format!("{lo:.3}–{hi:.3}x"));
            let over = each.iter().filter(|r| **r > BUILD_CPU_BAR).count();
            let (Some(ratio), Some(ours), Some(theirs)) = (
                Spread::of(each.iter().copied()),
                Spread::of(p.iter().filter_map(|(a, _)| us(a))),
                Spread::of(p.iter().filter_map(|(_, b)| us(b))),
            ) else {
                continue;
            };
            let med = |f: fn(&Row) -> f64, side: bool| {
                Spread::of(p.iter().map(|(a, b)| f(if side { a } else { b })))
                    .map_or(f64::NAN, |s| s.median)
            };
            let rss = |side: bool| {
                p.iter()
                    .filter_map(|(a, b)| if side { a } else { b }.peak_rss_mib)
                    .reduce(f64::max)
            };
            let _ = writeln!(
                t,
                "| {} | {} | {} | {} | {} | {} | {} | {}x | {interval} | {over} of {} | {:.0} / {:.0} | {:.2} / {:.2} | {} / {} | {} |",
                cell.delay_ms,
                cell.connections,
                if cell.offered_rps.is_some() {
                    "open"
                } else {
                    "closed"
                },
                build,
                p.len(),
                ours.show(2),
                theirs.show(2),
                ratio.show(3),
                each.len(),
                med(|r| r.rps, true),
                med(|r| r.rps, false),
                med(|r| r.p99_ms, true),
                med(|r| r.p99_ms, false),
                opt(rss(true), 1),
                opt(rss(false), 1),
                yes(ratio.median <= BUILD_CPU_BAR),
            );
        }
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
    fn connection_mode_is_judged_against_haproxy_h2_and_at_8_connections() {
        let mut rows = Vec::new();
        for conns in [1, 8] {
            for (target, cpu, rss) in [
                ("l4-roundrobin", 0.003, 14.0),
                ("haproxy", 0.011, 20.0),
                ("skewless", 0.009, 7.0),
                (
                    "skewless-connection",
                    0.0035,
                    if conns == 8 { 41.0 } else { 5.0 },
                ),
            ] {
                rows.push(Row {
                    connections: conns,
                    ..row(target, 40_000.0, 8.0, Some(cpu), Some(rss))
                });
            }
        }
        let t = connection_targets_table(&summarize(&rows));
        assert_eq!(t.lines().count(), 4, "{t}");
        // 0.0035 / 0.011 = 0.32x: met; against tcp 1.17x, request mode 0.39x.
        assert!(
            t.contains("| 50 | 1 | 1 | 0.0035 | 0.32x met | 1.17x | 0.39x | 5.0 (judged at 8) |"),
            "{t}"
        );
        assert!(
            t.contains("| 41.0 NOT met |"),
            "RSS over 40 MiB at 8 connections: {t}"
        );
        rows[3].cores_per_krps = Some(0.004);
        let t = connection_targets_table(&summarize(&rows));
        assert!(t.contains("0.36x NOT met"), "{t}");
        assert_eq!(
            connection_targets_table(&summarize(&rows[..3]))
                .lines()
                .count(),
            2,
            "no connection mode, no rows"
        );
    }

    #[test]
    fn low_load_adds_the_p50_over_direct_of_the_same_pass() {
        let mut rows = Vec::new();
        for (repeat, (direct, conn, req)) in
            [(0.10, 0.15, 0.30), (0.20, 0.26, 0.41), (0.12, 0.35, 0.31)]
                .into_iter()
                .enumerate()
        {
            for (target, p50) in [
                ("direct-healthy", direct),
                ("skewless-connection", conn),
                ("skewless", req),
            ] {
                rows.push(Row {
                    repeat,
                    p50_ms: p50,
                    ..row(target, 5_000.0, 1.0, None, None)
                });
            }
        }
        let t = low_load_table(&rows);
        // Connection mode adds 0.05, 0.06 and 0.23 ms: median 0.06, met.
        assert!(
            t.contains("| skewless-connection | 3 | 5000 | 0.260 (0.150–0.350) | 1.000 | 0.060 (0.050–0.230) | met |"),
            "{t}"
        );
        assert!(
            t.contains("| skewless | 3 |") && t.contains("0.200 (0.190–0.210) |  |"),
            "{t}"
        );
        rows[4].p50_ms = 0.40;
        assert!(low_load_table(&rows).contains("| NOT met |"));
    }

    #[test]
    fn a_second_build_is_compared_pair_by_pair() {
        let mut rows = Vec::new();
        // Three passes; the machine gets 20% slower in the second, for both builds alike.
        for (repeat, (ours, base)) in [(0.0100, 0.0098), (0.0120, 0.0118), (0.0101, 0.0099)]
            .into_iter()
            .enumerate()
        {
            for (target, cpu) in [("skewless", ours), ("skewless@base", base)] {
                rows.push(Row {
                    repeat,
                    ..row(target, 50_000.0, 8.0, Some(cpu), Some(7.0))
                });
            }
        }
        // A run of another cell that must not be paired in.
        rows.push(Row {
            connections: 8,
            ..row("skewless@base", 40_000.0, 80.0, Some(0.02), Some(19.0))
        });
        let t = builds_table(&rows);
        assert_eq!(t.lines().count(), 3, "one cell, one build: {t}");
        assert!(
            t.contains(
                "| 50 | 1 | closed | skewless@base | 3 | 10.10 (10.00–12.00) | 9.90 (9.80–11.80) |"
            ),
            "{t}"
        );
        // Per-pair ratios 1.0204, 1.0169, 1.0202: the median is within the 3% bar although
        // the spread of either build alone is 20%.
        assert!(t.contains("| 1.020 (1.017–1.020)x | - | 0 of 3 |"), "{t}");
        assert!(t.ends_with("| met |\n"), "{t}");
        let slower: Vec<Row> = rows
            .iter()
            .map(|r| Row {
                cores_per_krps: r
                    .cores_per_krps
                    .map(|c| if r.target == "skewless" { c * 1.05 } else { c }),
                ..r.clone()
            })
            .collect();
        assert!(builds_table(&slower).ends_with("| NOT met |\n"));
        assert_eq!(
            builds_table(&rows[..1]).lines().count(),
            2,
            "no build, no rows"
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
