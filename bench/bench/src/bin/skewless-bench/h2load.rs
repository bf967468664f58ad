//! The third-party load section (`--h2load`, on by default): h2load posts a fixed number of
//! small unary gRPC calls through HAProxy h2 and through skewless-proxy (and every
//! `--skewless-build`), one target at a time in interleaved passes, each proxy started fresh
//! for its run; the proxy's CPU over the run divided by the requests done is the figure.
//! Reading h2load's report and the table are in `skewless_bench::h2load`.

use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};
use skewless_bench::h2load::{self, Run};
use skewless_bench::sampling::{cpu_ticks, peak_rss_kib, tree};
use skewless_bench::{interleave, replace_section};

use crate::procs::find_tool;
use crate::{Args, Bench, Target, utc_now};

impl Bench {
    /// Every pass runs HAProxy h2 and the skewless builds once each, the order rotated from
    /// pass to pass.
    pub fn h2load_runs(&self) -> anyhow::Result<Vec<Run>> {
        let a = &self.args;
        let bin = find_tool("h2load")
            .context("h2load is not installed (Debian's nghttp2-client; `cargo xtask setup`)")?;
        let body = self.work.join("h2load-body.bin");
        std::fs::write(&body, h2load::grpc_body(a.h2load_payload))?;
        let targets = a.choose(&[Target::Haproxy, Target::Skewless]);
        let order = interleave(&[((), targets, a.h2load_runs.max(1))]);
        let mut passes = std::collections::HashMap::new();
        let mut runs = Vec::new();
        for (i, ((), target)) in order.iter().enumerate() {
            let name = a.name(*target);
            let pass = passes.entry(name.clone()).or_insert(0usize);
            let run = self
                .h2load_once(*target, &bin, &body, *pass)
                .with_context(|| format!("h2load against {name}"))?;
            eprintln!(
                "[h2load {}/{}] {name:<19} {:>8.0} requests/s  {:>6.2} ms CPU per 1,000 requests",
                i + 1,
                order.len(),
                run.rps(),
                run.cpu_per_k()
            );
            *pass += 1;
            runs.push(run);
        }
        Ok(runs)
    }

    fn h2load_once(
        &self,
        target: Target,
        bin: &std::path::Path,
        body: &std::path::Path,
        pass: usize,
    ) -> anyhow::Result<Run> {
        let a = &self.args;
        let (proxy, addr) = self.start_proxy_with(target, a.h2load_proxy_threads)?;
        let proxy = proxy.context("h2load runs only against proxies")?;
        let pids = tree(proxy.pid());
        let t0 = cpu_ticks(&pids);
        let out = Command::new(bin)
            .arg("-n")
            .arg(a.h2load_requests.to_string())
            .arg("-c")
            .arg(a.h2load_connections.to_string())
            .arg("-m")
            .arg(a.h2load_streams.to_string())
            .args(["-t", "1", "-d"])
            .arg(body)
            .args(["-H", "content-type: application/grpc", "-H", "te: trailers"])
            .arg(format!("http://{addr}{}", h2load::PATH))
            .stdin(Stdio::null())
            .output()
            .context("running h2load")?;
        // The proxy's CPU over the whole run: h2load has no warm-up with a request count.
        let t1 = cpu_ticks(&pids);
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "h2load failed ({}): {}{}",
                out.status,
                text,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let report =
            h2load::parse(&text).with_context(|| format!("reading h2load's report: {text:?}"))?;
        #[expect(clippy::cast_precision_loss, reason = "ticks and KiB far below 2^52")]
        let (cpu_ms, peak_rss_mib) = (
            (t1 - t0) as f64 / self.tck * 1000.0,
            peak_rss_kib(&pids) as f64 / 1024.0,
        );
        drop(proxy);
        Ok(Run {
            target: a.name(target),
            pass,
            report,
            cpu_ms,
            peak_rss_mib,
        })
    }
}

/// The section's text: how the runs were made, the table and the verdict.
pub fn text(a: &Args, table: &str, verdict: Option<bool>, load: &str) -> String {
    let verdict = match verdict {
        Some(true) => "skewless-proxy's CPU per 1,000 requests below HAProxy h2's: **met**",
        Some(false) => "skewless-proxy's CPU per 1,000 requests below HAProxy h2's: **NOT met**",
        None => "No verdict: the run had not both skewless and HAProxy.",
    };
    format!(
        "{heading}\n\n\
         Run of {date} (`{cmd}`; load average {load} at the start), everything on 127.0.0.1, \
         all 5 `skewless-echo` pods healthy. \
         h2load (Debian's nghttp2-client) posts {n} unary gRPC calls (`{path}`, an \
         `EchoRequest` of {payload} bytes as a length-prefixed message from a file, headers \
         `content-type: application/grpc` and `te: trailers`) over {c} connections x {m} \
         streams, with one thread (`-t 1`), against one proxy at a time, started fresh for its \
         run with {t} worker thread(s). {runs} pass(es), each running every target once, the \
         order rotated from pass to pass. CPU: the proxy's utime+stime over h2load's whole run \
         (all its processes) per 1,000 requests done; the ratio is taken pass by pass and its \
         median (min–max) judged. h2load reads HTTP statuses, not gRPC's: `2xx` counts \
         responses, the bench's own load generator checks every call's status.\n\n\
         {table}\n{verdict}\n",
        heading = a.h2load_section,
        date = utc_now(),
        cmd = a.command,
        n = a.h2load_requests,
        path = h2load::PATH,
        payload = a.h2load_payload,
        c = a.h2load_connections,
        m = a.h2load_streams,
        t = a.h2load_proxy_threads,
        runs = a.h2load_runs.max(1),
    )
}

/// Runs the section, prints it, and writes it into its own section of `--write`.
pub fn section(bench: &Bench) -> anyhow::Result<()> {
    let a = &bench.args;
    // The 1-minute load average: the machine is shared, and CPU per request moves with it.
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".to_owned());
    let runs = bench.h2load_runs()?;
    let (table, verdict) = h2load::table(&runs, &a.name(Target::Haproxy));
    let text = text(a, &table, verdict, &load);
    println!("{text}");
    if let Some(path) = &a.write {
        let doc = std::fs::read_to_string(path).unwrap_or_default();
        std::fs::write(path, replace_section(&doc, &a.h2load_section, &text))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
