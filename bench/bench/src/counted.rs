//! Load-independent cost per call (issues 10 and 11): what valgrind's callgrind and `perf stat`
//! count while a proxy serves a known number of calls, read back from their output files, and
//! the table comparing builds.
//!
//! CPU time per call on a shared machine moves by more than a few percent from run to run;
//! user-space instructions per call (callgrind) and syscalls per call (the kernel's
//! `raw_syscalls:sys_enter` tracepoint) do not depend on what else the machine runs. Neither
//! says what an instruction or a syscall costs, so they complement the CPU-time pairs of
//! [`crate::report::builds_table`], they do not replace them.

use std::fmt::Write as _;

use crate::stats::Spread;

/// What one callgrind dump counted over its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dump {
    /// Instructions executed in user space (the `Ir` event's total).
    pub instructions: u64,
    /// Calls into the C library's `clock_gettime` (what `Instant::now` costs outside the vDSO
    /// fast path), counted at their callers: calls among `clock_gettime`'s own family are one
    /// clock read.
    pub clock_reads: u64,
}

/// Reads a callgrind output file (`--callgrind-out-file`, one dump): the total of its first
/// event, and the calls into `clock_gettime`. None when it has no total.
#[must_use]
pub fn parse_callgrind(text: &str) -> Option<Dump> {
    // Names are compressed: `fn=(7) name` the first time, `fn=(7)` afterwards; `cfn=` (the
    // callee of the next `calls=` line) shares the numbering.
    let mut names: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut resolve = |spec: &str| -> String {
        let spec = spec.trim();
        if let Some(rest) = spec.strip_prefix('(')
            && let Some((id, name)) = rest.split_once(')')
        {
            let name = name.trim();
            if name.is_empty() {
                return names.get(id).cloned().unwrap_or_default();
            }
            names.insert(id.to_owned(), name.to_owned());
            return name.to_owned();
        }
        spec.to_owned()
    };
    let is_clock = |name: &str| name.contains("clock_gettime");
    let (mut caller, mut callee) = (String::new(), String::new());
    let (mut totals, mut summary, mut clock_reads) = (None, None, 0u64);
    let first = |rest: &str| rest.split_whitespace().next()?.parse::<u64>().ok();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("fn=") {
            caller = resolve(rest);
        } else if let Some(rest) = line.strip_prefix("cfn=") {
            callee = resolve(rest);
        } else if let Some(rest) = line.strip_prefix("calls=") {
            if is_clock(&callee) && !is_clock(&caller) {
                clock_reads += first(rest).unwrap_or(0);
            }
        } else if let Some(rest) = line.strip_prefix("totals:") {
            totals = first(rest);
        } else if let Some(rest) = line.strip_prefix("summary:") {
            summary = first(rest);
        }
    }
    Some(Dump {
        instructions: totals.or(summary)?,
        clock_reads,
    })
}

/// Reads `perf stat -x, -e raw_syscalls:sys_enter` output: the syscalls counted. None when
/// the event was not counted (no permission, no tracepoint).
#[must_use]
pub fn parse_perf_syscalls(text: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.contains("raw_syscalls:sys_enter"))?
        .split(',')
        .next()?
        .trim()
        .parse()
        .ok()
}

/// One build's counted runs.
#[derive(Debug, Clone, Default)]
pub struct Counted {
    /// The target's name (`skewless`, `skewless@LABEL`).
    pub target: String,
    /// Per callgrind run: calls served in the window, and the dump.
    pub callgrind: Vec<(u64, Dump)>,
    /// Per `perf stat` run: calls served in the window, and syscalls counted.
    pub syscalls: Vec<(u64, u64)>,
}

impl Counted {
    /// `count` over the calls of each run with calls.
    fn per_call<'a>(runs: impl Iterator<Item = (&'a u64, u64)>) -> Vec<f64> {
        #[expect(clippy::cast_precision_loss, reason = "counts far below 2^52")]
        runs.filter(|(calls, _)| **calls > 0)
            .map(|(calls, n)| n as f64 / *calls as f64)
            .collect()
    }

    /// Instructions per call, one value per run.
    #[must_use]
    pub fn instructions(&self) -> Vec<f64> {
        Self::per_call(self.callgrind.iter().map(|(c, d)| (c, d.instructions)))
    }

    /// Clock reads per call, one value per run.
    #[must_use]
    pub fn clock_reads(&self) -> Vec<f64> {
        Self::per_call(self.callgrind.iter().map(|(c, d)| (c, d.clock_reads)))
    }

    /// Syscalls per call, one value per run.
    #[must_use]
    pub fn syscalls(&self) -> Vec<f64> {
        Self::per_call(self.syscalls.iter().map(|(c, n)| (c, *n)))
    }
}

fn each(values: &[f64], digits: usize) -> String {
    if values.is_empty() {
        return "-".to_owned();
    }
    values
        .iter()
        .map(|v| format!("{v:.digits$}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

fn ratio(ours: &[f64], theirs: &[f64]) -> String {
    match (
        Spread::of(ours.iter().copied()),
        Spread::of(theirs.iter().copied()),
    ) {
        (Some(a), Some(b)) if b.median > 0.0 => format!("{:.3}x", a.median / b.median),
        _ => "-".to_owned(),
    }
}

/// The table: one row per build, each run's figures, and `skewless` over each other build
/// (medians of the runs). The first entry of `counted` is `skewless`.
#[must_use]
pub fn counted_table(counted: &[Counted]) -> String {
    let mut t = String::new();
    t.push_str("| target | instructions per call, each run | skewless / target | clock reads per call | calls counted | syscalls per call, each run | skewless / target |\n");
    t.push_str("|---|---|---|---|---|---|---|\n");
    let Some(ours) = counted.first() else {
        return t;
    };
    for c in counted {
        let (vs_i, vs_s) = if c.target == ours.target {
            ("-".to_owned(), "-".to_owned())
        } else {
            (
                ratio(&ours.instructions(), &c.instructions()),
                ratio(&ours.syscalls(), &c.syscalls()),
            )
        };
        let calls = c
            .callgrind
            .iter()
            .map(|(n, _)| n.to_string())
            .collect::<Vec<_>>()
            .join(" / ");
        let _ = writeln!(
            t,
            "| {} | {} | {vs_i} | {} | {} | {} | {vs_s} |",
            c.target,
            each(&c.instructions(), 0),
            each(&c.clock_reads(), 2),
            if calls.is_empty() { "-" } else { &calls },
            each(&c.syscalls(), 2),
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    const DUMP: &str = "\
version: 1
creator: callgrind-3.19.0
cmd: skewless-proxy
events: Ir
summary: 1000

ob=(1) /usr/lib/x86_64-linux-gnu/libc.so.6
fl=(1) ???
fn=(1) clock_gettime
0 30
cfn=(2) __vdso_clock_gettime
calls=3 0
0 12

fl=(2) ???
fn=(3) std::time::Instant::now
0 8
cfn=(1)
calls=3 0
0 42
cfn=(4) memcpy
calls=5 0
0 50

fn=(5) skewless_balancer::metrics::CallGuard::drop
0 4
cfn=(1) clock_gettime
calls=2 0
0 28

totals: 1234
";

    #[test]
    fn a_dump_gives_its_total_and_the_calls_into_clock_gettime_from_outside() {
        let d = parse_callgrind(DUMP).expect("a total");
        assert_eq!(d.instructions, 1234, "totals wins over summary");
        // 3 from Instant::now and 2 from the guard; the 3 inside clock_gettime's own family
        // are the same reads.
        assert_eq!(d.clock_reads, 5);
    }

    #[test]
    fn a_dump_without_a_total_is_none_and_summary_alone_is_enough() {
        assert_eq!(parse_callgrind("events: Ir\nfn=(1) x\n0 5\n"), None);
        let only_summary = parse_callgrind("events: Ir\nsummary: 77\n").expect("summary");
        assert_eq!(only_summary.instructions, 77);
    }

    #[test]
    fn perf_stat_csv_gives_the_syscall_count() {
        let out = "# started on Tue Dec  1 18:00:00 2026\n\n\
                   73021,,raw_syscalls:sys_enter,4001956410,100.00,,\n";
        assert_eq!(parse_perf_syscalls(out), Some(73_021));
        assert_eq!(
            parse_perf_syscalls("<not counted>,,raw_syscalls:sys_enter,0,0.00,,\n"),
            None
        );
    }

    #[test]
    fn the_table_compares_every_build_with_the_first_by_medians() {
        let build = |target: &str, instructions: u64, syscalls: u64| Counted {
            target: target.to_owned(),
            callgrind: vec![(
                100,
                Dump {
                    instructions,
                    clock_reads: 330,
                },
            )],
            syscalls: vec![(1000, syscalls)],
        };
        let t = counted_table(&[
            build("skewless", 6_850_000, 4_750),
            build("skewless@c609fba", 6_715_000, 4_210),
        ]);
        let rows: Vec<&str> = t.lines().skip(2).collect();
        assert_eq!(rows.len(), 2, "{t}");
        assert!(
            rows[0].starts_with("| skewless | 68500 | - | 3.30 | 100 | 4.75 | - |"),
            "{t}"
        );
        assert!(
            rows[1]
                .starts_with("| skewless@c609fba | 67150 | 1.020x | 3.30 | 100 | 4.21 | 1.128x |"),
            "{t}"
        );
    }
}
