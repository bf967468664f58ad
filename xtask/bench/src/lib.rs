//! The side-by-side proxy benchmark of issue 4, the parts that do not spawn anything: peer
//! configurations (HAProxy, nginx), `/proc` accounting, and the markdown and SVG output.
//! The driver is `src/bin/skewless-bench.rs`.
#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;

/// A backend pod: its name (what the echo reply carries) and address.
#[derive(Debug, Clone)]
pub struct Pod {
    /// Pod name.
    pub name: String,
    /// gRPC address.
    pub addr: SocketAddr,
}

/// HAProxy in HTTP/2 cleartext on both sides, `balance leastconn` (per request: HAProxy counts
/// each H2 stream as one connection of the server). With `l4` it is the per-connection
/// baseline instead: `mode tcp`, `balance roundrobin`, every request of a connection pinned.
#[must_use]
pub fn haproxy_config(listen: SocketAddr, pods: &[Pod], threads: usize, l4: bool) -> String {
    let mut c = String::new();
    let _ = writeln!(c, "global");
    let _ = writeln!(c, "    nbthread {threads}");
    let _ = writeln!(c, "    maxconn 4096");
    // The default (100) would cap a 200-stream client connection below the load's in-flight.
    let _ = writeln!(c, "    tune.h2.max-concurrent-streams 1000");
    let _ = writeln!(c, "defaults");
    let _ = writeln!(c, "    mode {}", if l4 { "tcp" } else { "http" });
    let _ = writeln!(c, "    timeout connect 2s");
    let _ = writeln!(c, "    timeout client 60s");
    let _ = writeln!(c, "    timeout server 60s");
    let _ = writeln!(c, "frontend grpc");
    if l4 {
        let _ = writeln!(c, "    bind {listen}");
    } else {
        let _ = writeln!(c, "    bind {listen} proto h2");
    }
    let _ = writeln!(c, "    default_backend echo");
    let _ = writeln!(c, "backend echo");
    let _ = writeln!(
        c,
        "    balance {}",
        if l4 { "roundrobin" } else { "leastconn" }
    );
    for p in pods {
        if l4 {
            let _ = writeln!(c, "    server {} {}", p.name, p.addr);
        } else {
            let _ = writeln!(c, "    server {} {} proto h2", p.name, p.addr);
        }
    }
    c
}

/// nginx with `grpc_pass` to a `least_conn` upstream, an HTTP/2 cleartext listener, upstream
/// keepalive (nginx sends one request per upstream connection at a time, so it needs a pool),
/// and the per-connection request limits raised so a long run is not cut by GOAWAYs. All
/// paths it writes are under `dir`.
#[must_use]
pub fn nginx_config(dir: &Path, listen: SocketAddr, pods: &[Pod], workers: usize) -> String {
    let d = dir.display();
    let mut c = String::new();
    let _ = writeln!(c, "daemon off;");
    let _ = writeln!(c, "worker_processes {workers};");
    let _ = writeln!(c, "pid {d}/nginx.pid;");
    let _ = writeln!(c, "error_log stderr warn;");
    let _ = writeln!(c, "events {{ worker_connections 8192; }}");
    let _ = writeln!(c, "http {{");
    let _ = writeln!(c, "    access_log off;");
    for t in ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"] {
        let _ = writeln!(c, "    {t}_temp_path {d}/{t};");
    }
    let _ = writeln!(c, "    upstream echo {{");
    let _ = writeln!(c, "        least_conn;");
    for p in pods {
        let _ = writeln!(c, "        server {};", p.addr);
    }
    let _ = writeln!(c, "        keepalive 512;");
    let _ = writeln!(c, "        keepalive_requests 100000000;");
    let _ = writeln!(c, "    }}");
    let _ = writeln!(c, "    server {{");
    let _ = writeln!(c, "        listen {listen} http2;");
    let _ = writeln!(c, "        http2_max_concurrent_streams 1000;");
    let _ = writeln!(c, "        keepalive_requests 100000000;");
    let _ = writeln!(c, "        location / {{ grpc_pass grpc://echo; }}");
    let _ = writeln!(c, "    }}");
    let _ = writeln!(c, "}}");
    c
}

/// utime + stime (clock ticks) from the text of `/proc/<pid>/stat`. The command name is in
/// parentheses and may contain spaces, so fields are counted after the last `)`.
#[must_use]
pub fn stat_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ")": state(3) ppid(4) ... utime(14) stime(15): indexes 11 and 12 from field 3.
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Parent pid from the text of `/proc/<pid>/stat`.
#[must_use]
pub fn stat_ppid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Peak resident set (`VmHWM`, KiB) from the text of `/proc/<pid>/status`.
#[must_use]
pub fn status_vm_hwm_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// One measured run.
#[derive(Debug, Clone, Default)]
pub struct Row {
    /// Delay of the slow pod, ms.
    pub delay_ms: u64,
    /// Client HTTP/2 connections.
    pub connections: usize,
    /// What was loaded: `direct-healthy`, `direct-slow`, `l4-roundrobin`, `haproxy`, `nginx`,
    /// `skewless`.
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
}

impl Row {
    /// Fills the load generator's fields from `skewless-loadgen run --json` output.
    ///
    /// # Errors
    /// When a field is missing.
    pub fn set_load(&mut self, v: &serde_json::Value, slow_pod: &str) -> anyhow::Result<()> {
        let num = |k: &str| {
            v[k].as_f64()
                .ok_or_else(|| anyhow::anyhow!("loadgen JSON lacks {k}"))
        };
        self.rps = num("rps")?;
        self.p50_ms = num("p50_us")? / 1e3;
        self.p99_ms = num("p99_us")? / 1e3;
        self.p999_ms = num("p999_us")? / 1e3;
        let ok = num("ok")?;
        let slow = v["pods"][slow_pod].as_f64().unwrap_or(0.0);
        self.slow_share = if ok > 0.0 { slow / ok } else { 0.0 };
        self.errors = v["errors"].as_object().map_or(0, |m| {
            m.values().filter_map(serde_json::Value::as_u64).sum()
        });
        if v["mode"] == "open" {
            let count = |k: &str| {
                v[k].as_u64()
                    .ok_or_else(|| anyhow::anyhow!("open-loop JSON lacks {k}"))
            };
            self.offered_rps = Some(num("target_rps")?);
            self.late = count("late")?;
            self.not_sent = count("not_sent")?;
            self.unfinished = count("unfinished")?;
        }
        Ok(())
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

fn series_index(target: &str) -> usize {
    SERIES
        .iter()
        .position(|(n, _)| *n == target)
        .unwrap_or(SERIES.len())
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
            series_index(&r.target),
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

/// Order and colour of the targets in the charts.
const SERIES: &[(&str, &str)] = &[
    ("direct-healthy", "#4c78a8"),
    ("direct-slow", "#9d755d"),
    ("l4-roundrobin", "#bab0ac"),
    ("haproxy", "#f58518"),
    ("nginx", "#54a24b"),
    ("skewless", "#e45756"),
];

/// A grouped bar chart (one group per delay and connection count, one bar per target) of
/// `value` of every cell (use medians), as a standalone SVG. With `log` the y axis is log10 (for latencies
/// that span 1 ms to 200 ms).
#[must_use]
pub fn bar_chart_svg(
    title: &str,
    unit: &str,
    rows: &[Summary],
    value: fn(&Summary) -> f64,
    log: bool,
) -> String {
    let mut groups: Vec<(u64, usize)> = Vec::new();
    for r in rows {
        if !groups.contains(&(r.delay_ms, r.connections)) {
            groups.push((r.delay_ms, r.connections));
        }
    }
    let series: Vec<(&str, &str)> = SERIES
        .iter()
        .copied()
        .filter(|(n, _)| rows.iter().any(|r| r.target == *n))
        .collect();
    // Wide enough for about 14 px per bar.
    let bars = (groups.len() * series.len().max(1)) as f64;
    let w = (90.0 + bars * 14.0 / 0.8).max(760.0);
    let (h, left, top, bottom) = (360.0_f64, 70.0_f64, 40.0_f64, 70.0_f64);
    let plot_h = h - top - bottom;
    let max = rows.iter().map(value).fold(0.0_f64, f64::max).max(1e-9);
    let min_log = rows
        .iter()
        .map(value)
        .filter(|v| *v > 0.0)
        .fold(f64::INFINITY, f64::min)
        .log10()
        .floor();
    let (lo, hi) = if log {
        (min_log, max.log10().ceil().max(min_log + 1.0))
    } else {
        (0.0, max * 1.1)
    };
    let y = |v: f64| {
        let t = if log {
            (v.max(10f64.powf(lo)).log10() - lo) / (hi - lo)
        } else {
            v / hi
        };
        top + plot_h * (1.0 - t)
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{title}</text>"#,
        w / 2.0
    );
    // Grid lines and y labels.
    let ticks: Vec<f64> = if log {
        (lo as i32..=hi as i32).map(|e| 10f64.powi(e)).collect()
    } else {
        (0..=4).map(|i| hi * f64::from(i) / 4.0).collect()
    };
    for t in ticks {
        let ty = y(t);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{}" y1="{ty:.1}" y2="{ty:.1}" stroke="#ddd"/>"##,
            w - 10.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            left - 6.0,
            ty + 4.0,
            fmt_tick(t)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="16" y="{:.1}" transform="rotate(-90 16 {:.1})" text-anchor="middle">{unit}</text>"#,
        top + plot_h / 2.0,
        top + plot_h / 2.0
    );
    let group_w = (w - left - 10.0) / groups.len().max(1) as f64;
    let bar_w = group_w * 0.8 / series.len().max(1) as f64;
    for (gi, (delay, conns)) in groups.iter().enumerate() {
        let gx = left + group_w * gi as f64 + group_w * 0.1;
        for (si, (name, colour)) in series.iter().enumerate() {
            let Some(r) = rows
                .iter()
                .find(|r| r.target == *name && r.delay_ms == *delay && r.connections == *conns)
            else {
                continue;
            };
            let v = value(r);
            let (bx, by) = (gx + bar_w * si as f64, y(v));
            let _ = writeln!(
                s,
                r#"<rect x="{bx:.1}" y="{by:.1}" width="{:.1}" height="{:.1}" fill="{colour}"><title>{name}: {v:.2} {unit}</title></rect>"#,
                bar_w * 0.9,
                (top + plot_h - by).max(0.0)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{delay} ms, {conns} conn</text>"#,
            gx + group_w * 0.4,
            top + plot_h + 16.0
        );
    }
    for (si, (name, colour)) in series.iter().enumerate() {
        let lx = left + 115.0 * si as f64;
        let ly = h - 18.0;
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.1}" y="{:.1}" width="10" height="10" fill="{colour}"/>"#,
            ly - 9.0
        );
        let _ = writeln!(s, r#"<text x="{:.1}" y="{ly:.1}">{name}</text>"#, lx + 14.0);
    }
    s.push_str("</svg>\n");
    s
}

fn fmt_tick(v: f64) -> String {
    if v >= 1000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
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

    fn pods() -> Vec<Pod> {
        (0..2)
            .map(|i| Pod {
                name: format!("pod-{i}"),
                addr: format!("127.0.0.1:{}", 9000 + i).parse().unwrap(),
            })
            .collect()
    }

    #[test]
    fn haproxy_h2_leastconn_and_l4_roundrobin() {
        let listen = "127.0.0.1:8000".parse().unwrap();
        let h2 = haproxy_config(listen, &pods(), 2, false);
        assert!(h2.contains("bind 127.0.0.1:8000 proto h2"));
        assert!(h2.contains("balance leastconn"));
        assert!(h2.contains("server pod-1 127.0.0.1:9001 proto h2"));
        assert!(h2.contains("mode http"));
        let l4 = haproxy_config(listen, &pods(), 2, true);
        assert!(l4.contains("mode tcp") && l4.contains("balance roundrobin"));
        assert!(!l4.contains("proto h2"));
    }

    #[test]
    fn nginx_grpc_pass_least_conn() {
        let c = nginx_config(
            Path::new("/tmp/x"),
            "127.0.0.1:8000".parse().unwrap(),
            &pods(),
            2,
        );
        assert!(c.contains("listen 127.0.0.1:8000 http2;"));
        assert!(c.contains("least_conn;"));
        assert!(c.contains("grpc_pass grpc://echo;"));
        assert!(c.contains("server 127.0.0.1:9000;"));
        assert!(c.contains("pid /tmp/x/nginx.pid;"));
    }

    #[test]
    fn proc_parsing() {
        let stat =
            "1234 (my (odd) proc) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 1 2 3";
        assert_eq!(stat_cpu_ticks(stat), Some(300));
        assert_eq!(stat_ppid(stat), Some(1));
        let status = "Name:\tx\nVmPeak:\t  1000 kB\nVmHWM:\t    5120 kB\nVmRSS:\t 4000 kB\n";
        assert_eq!(status_vm_hwm_kib(status), Some(5120));
        assert_eq!(status_vm_hwm_kib("Name: x\n"), None);
    }

    fn row(target: &str, rps: f64, p99: f64, cores: Option<f64>, rss: Option<f64>) -> Row {
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
    fn loadgen_json_fills_a_row() {
        let v = serde_json::json!({
            "mode": "closed",
            "ok": 1000, "rps": 500.0, "p50_us": 1500, "p99_us": 9000, "p999_us": 12000,
            "pods": {"pod-0": 800, "pod-4": 200}, "errors": {"Unavailable": 3},
        });
        let mut r = Row::default();
        r.set_load(&v, "pod-4").unwrap();
        assert!((r.slow_share - 0.2).abs() < 1e-9);
        assert!((r.p99_ms - 9.0).abs() < 1e-9);
        assert_eq!(r.errors, 3);
        assert_eq!(r.offered_rps, None);
        let mut open = v.clone();
        open["mode"] = "open".into();
        let mut r = Row::default();
        assert!(
            r.set_load(&open, "pod-4").is_err(),
            "open loop needs its counts"
        );
        open["target_rps"] = 600.0.into();
        open["late"] = 4.into();
        open["not_sent"] = 2.into();
        open["unfinished"] = 1.into();
        r.set_load(&open, "pod-4").unwrap();
        assert_eq!(r.offered_rps, Some(600.0));
        assert_eq!((r.late, r.not_sent, r.unfinished), (4, 2, 1));
    }

    #[test]
    fn charts_are_svg_with_one_bar_per_cell() {
        let rows = vec![
            row("direct-healthy", 10_000.0, 4.0, None, None),
            row("haproxy", 8_000.0, 120.0, Some(0.05), Some(20.0)),
            row("haproxy", 8_000.0, 100.0, Some(0.05), Some(20.0)),
            row("skewless", 10_000.0, 8.0, Some(0.04), Some(12.0)),
        ];
        let cells = summarize(&rows);
        for log in [false, true] {
            let svg = bar_chart_svg("p99", "ms", &cells, |r| r.p99_ms, log);
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
            assert_eq!(svg.matches("<title>").count(), 3);
            assert!(svg.contains("haproxy: 110.00 ms"), "median of 120 and 100");
            assert!(svg.contains("50 ms, 1 conn"));
        }
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
