//! The third-party load section: h2load (nghttp2's HTTP/2 benchmarking tool) sends a fixed
//! number of small unary gRPC calls through each proxy, so the CPU comparison with HAProxy
//! does not rest on the project's own load generator alone. This module holds the parts that
//! spawn nothing: the request body h2load posts, the reading of its report, and the table.
//!
//! h2load knows HTTP/2, not gRPC: it posts the body file with the gRPC headers and counts a
//! call done when its stream ends, by HTTP status. A gRPC failure would still be a 200 with a
//! status in the trailers, which h2load does not read: the echo pods answer every well-formed
//! call with OK, and the proxies' own failures (no endpoint, deadline) are 200s with a status
//! too, so the table shows h2load's counts as they are and the bench's own load generator
//! (which reads every status) stays the check of correctness.

use std::fmt::Write as _;

use prost::Message as _;

use crate::stats::Spread;

/// The gRPC method the calls go to.
pub const PATH: &str = "/skewless.echo.v1.Echo/Echo";

/// What one h2load run reported, from its text output.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Report {
    /// Requests h2load was told to send.
    pub total: u64,
    /// Requests whose stream ended (any status).
    pub done: u64,
    /// Requests answered with a 2xx or 3xx status.
    pub succeeded: u64,
    /// Requests that failed (stream reset, connection lost) or errored.
    pub failed: u64,
    /// Responses with a 2xx status.
    pub status_2xx: u64,
    /// Wall time of the run, seconds.
    pub seconds: f64,
}

/// One h2load run against one target: its report and the proxy's cost over the run.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    /// The target's name in the tables.
    pub target: String,
    /// The pass it ran in (runs of one pass are compared pairwise).
    pub pass: usize,
    /// What h2load said.
    pub report: Report,
    /// The proxy's utime+stime over the run (all its processes), milliseconds.
    pub cpu_ms: f64,
    /// The proxy's peak RSS (`VmHWM`, summed over its processes), MiB.
    pub peak_rss_mib: f64,
}

impl Run {
    /// The proxy's CPU per 1,000 requests done, milliseconds.
    #[must_use]
    pub fn cpu_per_k(&self) -> f64 {
        #[expect(clippy::cast_precision_loss, reason = "request counts far below 2^52")]
        let done = self.report.done.max(1) as f64;
        self.cpu_ms / (done / 1000.0)
    }

    /// Requests done per second.
    #[must_use]
    pub fn rps(&self) -> f64 {
        #[expect(clippy::cast_precision_loss, reason = "request counts far below 2^52")]
        let done = self.report.done as f64;
        done / self.report.seconds.max(1e-9)
    }
}

/// The body h2load posts: one gRPC message (uncompressed, length-prefixed) holding an
/// `EchoRequest` with `payload` bytes, as the bench's own load generator sends.
///
/// # Panics
/// When the message is 4 GiB or more (gRPC's length prefix is 32 bits).
#[must_use]
pub fn grpc_body(payload: usize) -> Vec<u8> {
    let message = skewless_echo::pb::EchoRequest {
        payload: vec![b'x'; payload],
        ..Default::default()
    }
    .encode_to_vec();
    let len = u32::try_from(message.len()).expect("a gRPC message is under 4 GiB");
    let mut body = Vec::with_capacity(5 + message.len());
    body.push(0);
    body.extend_from_slice(&len.to_be_bytes());
    body.extend_from_slice(&message);
    body
}

/// Reads h2load's text report: the `finished in`, `requests:` and `status codes:` lines.
/// None when one of them is missing (h2load failed before it ran).
#[must_use]
pub fn parse(text: &str) -> Option<Report> {
    // "finished in 3.48s, 57430.91 req/s, 3.34MB/s"
    let finished = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("finished in "))?;
    let secs = finished.split(',').next()?.trim();
    let seconds = if let Some(ms) = secs.strip_suffix("ms") {
        ms.parse::<f64>().ok()? / 1000.0
    } else {
        secs.strip_suffix('s')?.parse::<f64>().ok()?
    };
    // "requests: 200000 total, 200000 started, 200000 done, 200000 succeeded, 0 failed, 0
    // errored, 0 timeout"
    let counts = |prefix: &str| -> Option<Vec<(String, u64)>> {
        let line = text.lines().find_map(|l| l.trim().strip_prefix(prefix))?;
        line.split(',')
            .map(|part| {
                let mut words = part.split_whitespace();
                let n = words.next()?.parse().ok()?;
                Some((words.next()?.to_owned(), n))
            })
            .collect()
    };
    let requests = counts("requests:")?;
    let statuses = counts("status codes:")?;
    let get = |list: &[(String, u64)], key: &str| {
        list.iter().find(|(k, _)| k == key).map_or(0, |(_, n)| *n)
    };
    Some(Report {
        total: get(&requests, "total"),
        done: get(&requests, "done"),
        succeeded: get(&requests, "succeeded"),
        failed: get(&requests, "failed") + get(&requests, "errored") + get(&requests, "timeout"),
        status_2xx: get(&statuses, "2xx"),
        seconds,
    })
}

/// The table of the runs, one row per target, and the verdict of every skewless target
/// against `haproxy`: its CPU per 1,000 requests below HAProxy's, by the median of the
/// pairwise ratios of the passes. The verdict is None when either side has no run.
#[must_use]
pub fn table(runs: &[Run], haproxy: &str) -> (String, Option<bool>) {
    let mut targets: Vec<&str> = Vec::new();
    for r in runs {
        if !targets.contains(&r.target.as_str()) {
            targets.push(&r.target);
        }
    }
    let mut out = String::from(
        "| target | runs | requests done per run | failed | 2xx | requests/s | CPU ms per 1,000 requests | peak RSS MiB |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for t in &targets {
        let these: Vec<&Run> = runs.iter().filter(|r| r.target == *t).collect();
        let spread = |f: fn(&Run) -> f64| Spread::of(these.iter().map(|r| f(r)));
        let (Some(rps), Some(cpu)) = (spread(Run::rps), spread(Run::cpu_per_k)) else {
            continue;
        };
        let done = Spread::of(these.iter().map(|r| {
            #[expect(clippy::cast_precision_loss, reason = "request counts far below 2^52")]
            let d = r.report.done as f64;
            d
        }))
        .map_or_else(String::new, |s| s.show(0));
        let failed: u64 = these.iter().map(|r| r.report.failed).sum();
        let ok: u64 = these.iter().map(|r| r.report.status_2xx).sum();
        let rss = these.iter().map(|r| r.peak_rss_mib).fold(0.0, f64::max);
        let _ = writeln!(
            out,
            "| {t} | {} | {done} | {failed} | {ok} | {} | {} | {rss:.1} |",
            these.len(),
            rps.show(0),
            cpu.show(2),
        );
    }
    let mut verdict = None;
    let mut lines = String::new();
    for t in targets.iter().filter(|t| t.starts_with("skewless")) {
        let ratios: Vec<f64> = runs
            .iter()
            .filter(|r| r.target == *t)
            .filter_map(|r| {
                let h = runs
                    .iter()
                    .find(|h| h.target == haproxy && h.pass == r.pass)?;
                Some(r.cpu_per_k() / h.cpu_per_k().max(1e-9))
            })
            .collect();
        let Some(pair) = Spread::of(ratios.iter().copied()) else {
            continue;
        };
        let met = pair.median < 1.0;
        if *t == "skewless" {
            verdict = Some(met);
        }
        let _ = writeln!(
            lines,
            "| {t} | {} | {}x | {} |",
            ratios.len(),
            pair.show(3),
            if met { "met" } else { "NOT met" },
        );
    }
    if !lines.is_empty() {
        let _ = write!(
            out,
            "\n| target | pairs | CPU per 1,000 requests / HAProxy h2's, per pair | below HAProxy h2's |\n\
             |---|---:|---|---|\n{lines}"
        );
    }
    (out, verdict)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUTPUT: &str = "starting benchmark...
spawning thread #0: 4 total client(s). 200000 total requests
Application protocol: h2c
progress: 10% done

finished in 3.48s, 57430.91 req/s, 3.34MB/s
requests: 200000 total, 200000 started, 200000 done, 199990 succeeded, 4 failed, 6 errored, 0 timeout
status codes: 199990 2xx, 0 3xx, 0 4xx, 0 5xx
traffic: 11.62MB (12186334) total, 4.59MB (4811290) headers (space savings 0.00%), 4.39MB (4600000) data
";

    #[test]
    fn an_h2load_report_is_read_from_its_summary_lines() {
        let r = parse(OUTPUT).expect("a complete report");
        assert_eq!(r.total, 200_000);
        assert_eq!(r.done, 200_000);
        assert_eq!(r.succeeded, 199_990);
        assert_eq!(r.failed, 10, "failed and errored both count");
        assert_eq!(r.status_2xx, 199_990);
        assert!((r.seconds - 3.48).abs() < 1e-9);
        let ms = OUTPUT.replace("3.48s", "880.21ms");
        assert!((parse(&ms).unwrap().seconds - 0.880_21).abs() < 1e-9);
        assert_eq!(
            parse("starting benchmark...\n"),
            None,
            "h2load failed early"
        );
    }

    #[test]
    fn the_body_is_one_length_prefixed_echo_request() {
        let body = grpc_body(16);
        assert_eq!(body[0], 0, "not compressed");
        let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
        assert_eq!(len, body.len() - 5);
        let req = skewless_echo::pb::EchoRequest::decode(&body[5..]).unwrap();
        assert_eq!(req.payload, vec![b'x'; 16]);
    }

    fn run(target: &str, pass: usize, cpu_ms: f64) -> Run {
        Run {
            target: target.to_owned(),
            pass,
            report: Report {
                total: 200_000,
                done: 200_000,
                succeeded: 200_000,
                failed: 0,
                status_2xx: 200_000,
                seconds: 4.0,
            },
            cpu_ms,
            peak_rss_mib: 7.5,
        }
    }

    #[test]
    fn skewless_is_judged_by_the_median_of_its_pairs_with_haproxy() {
        // Pass by pass: 0.9, 1.1, 0.8 -> median 0.9: below HAProxy's.
        let runs = [
            run("haproxy", 0, 2000.0),
            run("skewless", 0, 1800.0),
            run("haproxy", 1, 1000.0),
            run("skewless", 1, 1100.0),
            run("haproxy", 2, 2500.0),
            run("skewless", 2, 2000.0),
        ];
        let (text, verdict) = table(&runs, "haproxy");
        assert_eq!(verdict, Some(true), "{text}");
        assert!(
            text.contains("| skewless | 3 | 0.900 (0.800–1.100)x | met |"),
            "{text}"
        );
        assert!(
            text.contains(
                "| haproxy | 3 | 200000 | 0 | 600000 | 50000 | 10.00 (5.00–12.50) | 7.5 |"
            ),
            "{text}"
        );
        // The second pass alone: 1.1, not below.
        let (_, verdict) = table(&runs[2..4], "haproxy");
        assert_eq!(verdict, Some(false));
        let (_, verdict) = table(&runs[1..2], "haproxy");
        assert_eq!(verdict, None, "no HAProxy run to compare with");
    }
}
