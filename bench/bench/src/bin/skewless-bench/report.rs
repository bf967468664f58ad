//! The proxies section of --write: the grid's tables, verdicts and charts in markdown, and
//! the load-independent counts.

use std::fmt::Write as _;

use anyhow::Context as _;

use skewless_bench::replace_section;

use crate::{Args, counting, utc_now};

/// The tables beyond the grid's, when the run has them.
pub(crate) struct Extra<'a> {
    pub(crate) connection: Option<&'a str>,
    pub(crate) low: Option<&'a str>,
    pub(crate) builds: Option<&'a str>,
    pub(crate) counted: Option<&'a str>,
}

pub(crate) fn section(
    a: &Args,
    table: &str,
    targets: &str,
    open: Option<(&String, &String)>,
    extra: Extra<'_>,
) -> String {
    let Extra {
        connection,
        low,
        builds,
        counted,
    } = extra;
    let date = utc_now();
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    // The cargo profile the binaries were built with (`dist` from `cargo xtask bench`).
    let profile = a
        .bin_dir
        .clone()
        .or_else(|| std::env::current_exe().ok()?.parent().map(Into::into))
        .and_then(|d| Some(d.file_name()?.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let repeated: Vec<String> = a
        .repeat_connections
        .iter()
        .filter(|c| a.connections.contains(c))
        .map(ToString::to_string)
        .collect();
    let repeats = if a.repeats > 1 && !repeated.is_empty() {
        let which = if repeated.len() == a.connections.len() {
            "Every cell".to_owned()
        } else {
            format!(
                "Cells with {} connection(s) (the others once)",
                repeated.join("/")
            )
        };
        format!(
            "{which} ran {} times, interleaved (each pass runs every cell once, the target \
             order rotated from pass to pass); RPS and CPU show the median and the min–max \
             range, latencies are the median of the runs' percentiles, peak RSS the largest \
             run's, errors the sum, and the verdicts use the medians.",
            a.repeats
        )
    } else {
        "Every cell ran once.".to_owned()
    };
    let only = if a.targets.is_empty() {
        String::new()
    } else {
        format!(" Targets run: {} (`--targets`).", a.targets.join(", "))
    };
    let second = a
        .builds
        .iter()
        .map(|(label, path)| format!(" `skewless@{label}` is `{}`.", path.display()))
        .collect::<String>();
    // The issue-4 verdicts need skewless and HAProxy in the run: header lines only otherwise.
    let targets = if targets.lines().count() > 2 {
        format!(
            "Targets (issue 4), skewless against the peers of the same run, per cell:\n\n{targets}"
        )
    } else {
        String::new()
    };
    let mut out = format!(
        "{heading}\n\n\
         Run of {date} (`{cmd}`), {cpus} CPUs, everything on 127.0.0.1: 5 `skewless-echo` pods \
         (the 5th delayed by the row's delay), `skewless-loadgen run` ({w} s warm-up, {d} s \
         measured per run), and one proxy at a time, started fresh for its run with {t} worker \
         threads/processes; our binaries from `target/{profile}`. `direct-healthy` and `direct-slow` load one pod without a proxy: \
         the two outcomes of an L4 coin flip, never averaged; `l4-roundrobin` (HAProxy `mode \
         tcp`) is per-connection balancing, run with more than one connection (and with one \
         beside connection mode, which relays one connection too). Ratios divide by \
         the direct-healthy cell of the same delay and connections. CPU is the proxy's \
         utime+stime over the measured window (all its processes), as cores per 1,000 RPS; \
         peak RSS is `VmHWM` summed over its processes.{only}{second} {repeats}\n\n\
         ### Closed loop\n\n\
         {inf} calls in flight per connection (like ghz `-c`), a call starts when one ends.\n\n\
         {table}\n\
         ![p99 by target]({prefix}-p99.svg) ![RPS by target]({prefix}-rps.svg)\n\n\
         {targets}",
        heading = a.section,
        prefix = a.chart_prefix,
        cmd = a.command,
        inf = a.in_flight,
        w = a.warmup,
        d = a.duration,
        t = a.proxy_threads,
    );
    if let Some((open, open_targets)) = open {
        let rate = a.open_rate.map_or_else(
            || {
                format!(
                    "{:.0}% of HAProxy's closed-loop median RPS at {} ms and {} connection(s) \
                     in this run",
                    a.open_fraction * 100.0,
                    a.open_delay,
                    a.open_connections
                )
            },
            |r| format!("{r:.0} calls/s (`--open-rate`)"),
        );
        let _ = write!(
            out,
            "\n### Open loop at equal offered load\n\n\
             Every target gets the same fixed rate, {rate}, dealt round-robin over the \
             connections; each call's latency counts from its intended send time, so a target \
             that falls behind is charged for every call it delayed (no coordinated omission). \
             `late`: calls sent more than 5 ms after their intended time; `not sent`: due in \
             the window but never sent (at most 1,000 outstanding per connection); \
             `unfinished`: no answer within 5 s after the window. `direct-healthy` is one pod \
             without a proxy while the proxies spread the rate over five, so a rate above one \
             pod's capacity overloads the baseline itself (it then shows `not sent`).\n\n\
             {open}\n\
             ![open-loop p99 by target]({prefix}-open-p99.svg)\n\n\
             {open_targets}",
            prefix = a.chart_prefix,
        );
    }
    if let Some(connection) = connection {
        let _ = write!(
            out,
            "\nConnection mode (issue 13), against HAProxy h2 and tcp and request mode of the \
             same run, per cell (medians):\n\n{connection}"
        );
    }
    if let Some(low) = low {
        let _ = write!(
            out,
            "\n### Low load\n\n\
             One connection with one call in flight (each call starts when the last ends), no \
             slow pod: the latency each proxy adds to a call. `p50 added` is the median \
             (min–max) over the passes of the target's p50 minus direct-healthy's in the same \
             pass.\n\n{low}"
        );
    }
    if let Some(builds) = builds {
        let _ = write!(
            out,
            "\n### Second builds against this one\n\n\
             Each `skewless@LABEL` target is another build of `skewless-proxy`, run in the same \
             cells and passes as `skewless`. CPU per call is the proxy's CPU over the measured \
             window divided by the calls served (cores per 1,000 RPS x 1,000, in \
             microseconds); `skewless / build, per pair` is the median (min–max) of the ratios \
             of the two runs of each pass, which holds when the machine's speed drifts between \
             passes; `95% interval of the median pair` is a distribution-free interval (the \
             order statistics of the pair ratios that a binomial with p = 1/2 allows) holding \
             the true median ratio with at least 95% confidence, shown from 6 pairs on; `pairs \
             over` counts the single pairs above the bar. The bar: CPU per call at most \
             {bar:.2}x the build's (issues 10 and 11), judged by the median; it is shown \
             beyond this machine's noise only where the interval's upper end is within it \
             too.\n\n\
             {builds}",
            bar = skewless_bench::report::BUILD_CPU_BAR,
        );
    }
    if let Some(counted) = counted {
        let _ = write!(out, "\n{}", counted_text(a, counted));
    }
    out
}

/// The load-independent subsection: how the counts were made, and their table.
fn counted_text(a: &Args, table: &str) -> String {
    format!(
        "### Instructions and syscalls per call (load-independent)\n\n\
         With all pods healthy (before the grid, if any), {runs} run(s) per build, interleaved. \
         Instructions: the build's skewless-proxy ({t} workers) under `valgrind \
         --tool=callgrind`, warmed up by {warm} s of closed loop, its counters zeroed \
         (`callgrind_control -z`), then `skewless-loadgen` with 1 connection x {inf} calls in \
         flight for {d} s and no warm-up window (every call it sends is counted), then \
         `callgrind_control -d`: the dump's user-space instructions (`Ir`) over the calls \
         served. Clock reads: calls into `clock_gettime` in the same dump (under valgrind it \
         is a syscall, natively a vDSO call: counted, not timed). Syscalls: the native build \
         at an offered {rate:.0} calls/s (1 connection, open loop) for {d} s, counted with \
         `perf stat -e raw_syscalls:sys_enter -p PID` over the load generator's window. Under \
         callgrind the proxy is the bottleneck (it serves a few thousand calls a second), so \
         batching is like the closed-loop runs'. These counts do not move with the machine's \
         load, but they leave out what an instruction or a syscall costs (caches, locks, \
         the kernel's own work): CPU time per call is the bar's measure; these are beside it.\n\n\
         {table}",
        runs = a.instructions_runs.max(1),
        t = a.proxy_threads,
        warm = counting::CALLGRIND_WARMUP_S,
        inf = a.in_flight,
        d = a.instructions_duration,
        rate = a.instructions_rate,
    )
}

/// `--instructions-only`: the counts alone, as the section `--section` of `--write`.
pub(crate) fn write_counted(a: &Args, table: &str) -> anyhow::Result<()> {
    let Some(path) = &a.write else {
        return Ok(());
    };
    let doc = std::fs::read_to_string(path).unwrap_or_default();
    let section = format!(
        "{}\n\nRun of {} (`{}`).\n\n{}",
        a.section,
        utc_now(),
        a.command,
        counted_text(a, table)
    );
    std::fs::write(path, replace_section(&doc, &a.section, &section))
        .with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}
