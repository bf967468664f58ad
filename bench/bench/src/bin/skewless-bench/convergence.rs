//! The rotation-convergence section: connection mode's skew over time while pinned clients
//! are rotated, interleaved over the targets, with its table and chart.

use anyhow::{Context as _, bail};
use skewless_bench::chart::skew_chart_svg;
use skewless_bench::replace_section;

use crate::{Bench, Target, rotation, utc_now};

/// The rotation-convergence runs (see `rotation`), interleaved over the targets, their table
/// and chart, written to the "Rotation convergence" section of --write.
pub(crate) fn convergence(bench: &Bench) -> anyhow::Result<()> {
    let a = &bench.args;
    let python = skewless_testbed::grpc::python();
    let gen_dir = skewless_testbed::grpc::generate_stubs()
        .context("generating the Python stubs (is the venv installed? `cargo xtask setup`)")?;
    let script = skewless_testbed::grpc::script("rotation_client.py");
    let proxy = bench.bin_dir.join("skewless-proxy");
    // Request mode spreads at once; connection mode has to rotate the pinned connections.
    let mut targets: Vec<(String, Vec<String>)> = vec![(a.name(Target::Skewless), Vec::new())];
    if a.connection_mode {
        let args = |extra: &[&str]| -> Vec<String> {
            ["--mode", "connection"]
                .iter()
                .chain(extra)
                .map(|s| (*s).to_owned())
                .collect()
        };
        // The annotations' defaults (hold 30 s, 6 rotations a minute, connections younger
        // than 10 s left alone), and a Service tuned to move faster.
        targets.push((a.name(Target::Connection), args(&[])));
        targets.push((
            format!("{} (hold 5 s, 30/min)", a.name(Target::Connection)),
            args(&[
                "--hold-time",
                "5",
                "--max-rotations-per-minute",
                "30",
                "--min-connection-age",
                "2",
            ]),
        ));
    }
    targets.retain(|(name, _)| {
        a.targets.is_empty() || a.targets.iter().any(|t| name.split(' ').next() == Some(t))
    });
    if targets.is_empty() {
        bail!("--targets leaves no convergence target (skewless, skewless-connection)");
    }
    let runs = a.convergence_repeats.max(1) * targets.len();
    eprintln!(
        "{runs} convergence runs of {} s: about {:.0} min",
        a.convergence_before + a.convergence_after,
        runs as f64 * (a.convergence_before + a.convergence_after + 2.0) / 60.0
    );
    let mut outcomes = Vec::new();
    for pass in 0..a.convergence_repeats.max(1) {
        let mut order = targets.clone();
        let n = pass % order.len();
        order.rotate_left(n);
        for (target, mode_args) in order {
            let plan = rotation::Plan {
                proxy: (&proxy, mode_args),
                target,
                pods: &bench.pods,
                python: (&python, &gen_dir, &script),
                channels: a.convergence_channels,
                concurrency: a.convergence_concurrency,
                before: a.convergence_before,
                after: a.convergence_after,
                threads: a.proxy_threads,
            };
            let outcome = rotation::run(&plan)?;
            rotation::log(&outcome);
            outcomes.push(outcome);
        }
    }
    let table = rotation::table(&outcomes);
    println!("{table}");
    let Some(path) = &a.write else {
        return Ok(());
    };
    let dir = path.parent().context("the results file has no directory")?;
    // One line per target: its first run.
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for o in &outcomes {
        if !series.iter().any(|(t, _)| *t == o.target) {
            series.push((o.target.clone(), o.convergence.skew.clone()));
        }
    }
    let file = format!("{}-convergence.svg", a.chart_prefix);
    let svg = skew_chart_svg(
        "Skew after the scale-up from 2 to 10 pods (1 s windows, first run of each target)",
        &series,
        rotation::THRESHOLD,
    )
    .with_context(|| format!("drawing {file}"))?;
    std::fs::write(dir.join(&file), svg).with_context(|| format!("writing {file}"))?;
    let doc = std::fs::read_to_string(path).unwrap_or_default();
    let section = format!(
        "{CONVERGENCE}\n\n\
         Run of {date} (`{cmd}`): {ch} pick_first grpcio channels (`testing/py/rotation_client.py`, \
         each one HTTP/2 connection, {conc} calls in flight on each) through skewless-proxy \
         ({t} workers) with pods 0-1 as its endpoints; after {before} s the benchmark sends \
         it the set of pods 0-9 (the seed-001 scale-up, timed at that moment) and the clients \
         go on for {after} s. From the clients' own tallies in 250 ms buckets, the skew of a \
         1 s window is the largest pod's share over the fair share of the 10 pods (1.0 is even, \
         5.0 is two pods taking everything). Times run from the scale-up to the start of the \
         first window that shows it (to the 250 ms bucket): every pod receiving calls, and the \
         skew under {th} in that window and every later one (`for good`); the same with 5 s \
         windows beside it, which average out the clients' own unevenness (with 10 connections \
         on 10 pods, one channel 50% faster than the others for a second is already skew 1.5 \
         in a 1 s window, however well the connections are placed). `connection moves`: \
         times a client channel's answering pod changed, i.e. its connection was rotated and \
         placed elsewhere (request mode moves every call). Runs are interleaved over the \
         targets.\n\n\
         {table}\n\
         ![skew after the scale-up]({file})\n",
        date = utc_now(),
        cmd = a.command,
        ch = a.convergence_channels,
        conc = a.convergence_concurrency,
        t = a.proxy_threads,
        before = a.convergence_before,
        after = a.convergence_after,
        th = rotation::THRESHOLD,
    );
    std::fs::write(path, replace_section(&doc, CONVERGENCE, &section))
        .with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

const CONVERGENCE: &str = "## Rotation convergence";
