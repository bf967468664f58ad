//! The command line of `skewless-bench`, and what it says about the run (targets chosen,
//! names, repeats).

use std::path::PathBuf;

use anyhow::bail;
use clap::Parser;

use crate::{H2LOAD_SECTION, SECTION, Target};

#[derive(Debug, Parser)]
#[command(about = "Side-by-side gRPC balancing benchmark: direct, L4, HAProxy, nginx, skewless")]
pub(crate) struct Args {
    /// Delays of the 5th pod, ms.
    #[arg(long, value_delimiter = ',', default_value = "0,50,200")]
    pub(crate) delays: Vec<u64>,
    /// Client HTTP/2 connection counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub(crate) connections: Vec<usize>,
    /// Closed loop: calls in flight per connection.
    #[arg(long, default_value_t = 200)]
    pub(crate) in_flight: usize,
    /// Warm-up seconds per run (not measured).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) warmup: f64,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 4.0)]
    pub(crate) duration: f64,
    /// Runs per cell for the connection counts in --repeat-connections (the others run once);
    /// tables show the median and the min–max range, verdicts use the median.
    #[arg(long, default_value_t = 3)]
    pub(crate) repeats: usize,
    /// Connection counts whose cells are repeated (and the open-loop cells, when they use one
    /// of them).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub(crate) repeat_connections: Vec<usize>,
    /// Skip the open-loop section.
    #[arg(long)]
    pub(crate) no_open: bool,
    /// Open loop: offered calls per second (default: --open-fraction of HAProxy's closed-loop
    /// median RPS at --open-delay and --open-connections).
    #[arg(long)]
    pub(crate) open_rate: Option<f64>,
    /// Open loop: fraction of HAProxy's closed-loop RPS to offer.
    #[arg(long, default_value_t = 0.6)]
    pub(crate) open_fraction: f64,
    /// Open loop: delay of the slow pod, ms.
    #[arg(long, default_value_t = 50)]
    pub(crate) open_delay: u64,
    /// Open loop: client HTTP/2 connections.
    #[arg(long, default_value_t = 1)]
    pub(crate) open_connections: usize,
    /// Worker threads/processes of every proxy (HAProxy nbthread, nginx worker_processes,
    /// skewless-proxy data-plane workers).
    #[arg(long, default_value_t = 2)]
    pub(crate) proxy_threads: usize,
    /// Directory with skewless-echo, skewless-loadgen and skewless-proxy (default: this
    /// binary's).
    #[arg(long)]
    pub(crate) bin_dir: Option<PathBuf>,
    /// Markdown file whose "Proxies side by side" section gets the results.
    #[arg(long)]
    pub(crate) write: Option<PathBuf>,
    /// The command shown in the written section.
    #[arg(long, default_value = "cargo xtask bench --proxies-only")]
    pub(crate) command: String,
    /// The heading of the section of --write that gets the results (replaced, or appended).
    #[arg(long, default_value = SECTION)]
    pub(crate) section: String,
    /// File names of the charts written beside --write: PREFIX-p99.svg, PREFIX-rps.svg,
    /// PREFIX-open-p99.svg.
    #[arg(long, default_value = "bench")]
    pub(crate) chart_prefix: String,
    /// Another build of skewless-proxy to run beside this one, as LABEL=PATH (repeat for
    /// more): the target `skewless@LABEL`, in every cell skewless runs in, interleaved with the
    /// others, and compared with `skewless` run by run (`cargo xtask bench --baseline REV`
    /// builds one from a git revision).
    #[arg(long = "skewless-build", value_parser = parse_build)]
    pub(crate) builds: Vec<(String, PathBuf)>,
    /// Run only these targets (comma-separated names as in the tables, e.g.
    /// `skewless,skewless@ae9ca9d`); default: all.
    #[arg(long, value_delimiter = ',')]
    pub(crate) targets: Vec<String>,
    /// Low load: the runs with one call in flight on one connection (no slow pod), where the
    /// latency a proxy adds shows; skip them.
    #[arg(long)]
    pub(crate) no_low_load: bool,
    /// Whether this tree's skewless-proxy runs connection mode (its `--help` offers `--mode`):
    /// then `skewless-connection` runs beside `skewless`.
    #[arg(skip)]
    pub(crate) connection_mode: bool,
    /// Whether this tree's skewless-proxy has request mode's experimental data path on the
    /// frame codec (its `--help` offers `--data-path`): then `skewless-codec` runs beside
    /// `skewless`.
    #[arg(skip)]
    pub(crate) codec_path: bool,
    /// Also run the rotation-convergence figure: pick_first grpcio clients (the venv of
    /// `cargo xtask setup`) through skewless-proxy while its endpoint set grows from 2 to 10
    /// pods (seed 001), timed until the skew stays under 1.5.
    #[arg(long)]
    pub(crate) convergence: bool,
    /// Only the rotation-convergence figure (no closed- or open-loop grid).
    #[arg(long)]
    pub(crate) convergence_only: bool,
    /// Convergence: client channels, each one HTTP/2 connection.
    #[arg(long, default_value_t = 10)]
    pub(crate) convergence_channels: usize,
    /// Convergence: calls in flight per channel.
    #[arg(long, default_value_t = 2)]
    pub(crate) convergence_concurrency: usize,
    /// Convergence: seconds before the scale-up.
    #[arg(long, default_value_t = 5.0)]
    pub(crate) convergence_before: f64,
    /// Convergence: seconds after the scale-up (with the defaults connection mode holds 30 s,
    /// then rotates at most 6 connections a minute: 8 moves take about 110 s).
    #[arg(long, default_value_t = 150.0)]
    pub(crate) convergence_after: f64,
    /// Convergence: runs per target (interleaved).
    #[arg(long, default_value_t = 1)]
    pub(crate) convergence_repeats: usize,
    /// Also count, for skewless and every --skewless-build, user-space instructions and clock
    /// reads per call under valgrind's callgrind (1 connection, --in-flight calls, closed
    /// loop) and syscalls per call with `perf stat` (native, open loop at
    /// --instructions-rate): figures the machine's load does not move.
    #[arg(long)]
    pub(crate) instructions: bool,
    /// Only the counts of --instructions (no closed- or open-loop grid).
    #[arg(long)]
    pub(crate) instructions_only: bool,
    /// --instructions: runs per build (interleaved).
    #[arg(long, default_value_t = 2)]
    pub(crate) instructions_runs: usize,
    /// --instructions: seconds counted per run.
    #[arg(long, default_value_t = 10.0)]
    pub(crate) instructions_duration: f64,
    /// --instructions: the offered rate of the syscall runs, calls per second.
    #[arg(long, default_value_t = 1500.0)]
    pub(crate) instructions_rate: f64,
    /// Skip the third-party load section (h2load against HAProxy h2 and skewless-proxy, run
    /// after the grid).
    #[arg(long)]
    pub(crate) no_h2load: bool,
    /// Only the h2load section (no closed- or open-loop grid).
    #[arg(long)]
    pub(crate) h2load_only: bool,
    /// h2load: passes (each runs every target once, interleaved).
    #[arg(long, default_value_t = 3)]
    pub(crate) h2load_runs: usize,
    /// h2load: requests per run (`-n`).
    #[arg(long, default_value_t = 200_000)]
    pub(crate) h2load_requests: u64,
    /// h2load: client connections (`-c`).
    #[arg(long, default_value_t = 4)]
    pub(crate) h2load_connections: usize,
    /// h2load: concurrent streams per connection (`-m`).
    #[arg(long, default_value_t = 50)]
    pub(crate) h2load_streams: usize,
    /// h2load: request payload bytes (the `EchoRequest`'s `payload`).
    #[arg(long, default_value_t = 16)]
    pub(crate) h2load_payload: usize,
    /// h2load: worker threads/processes of every proxy in these runs.
    #[arg(long, default_value_t = 1)]
    pub(crate) h2load_proxy_threads: usize,
    /// The heading of the section of --write that gets the h2load results.
    #[arg(long, default_value = H2LOAD_SECTION)]
    pub(crate) h2load_section: String,
}

pub(crate) fn parse_build(s: &str) -> anyhow::Result<(String, PathBuf)> {
    let Some((label, path)) = s.split_once('=') else {
        bail!("expected LABEL=PATH, got {s:?}");
    };
    if label.is_empty() || label.contains([',', ' ', '|']) {
        bail!("the label of {s:?} must be non-empty, without commas, spaces or bars");
    }
    Ok((label.to_owned(), PathBuf::from(path)))
}

impl Args {
    /// The target's name in the tables.
    pub(crate) fn name(&self, t: Target) -> String {
        match t {
            Target::DirectHealthy => "direct-healthy".to_owned(),
            Target::DirectSlow => "direct-slow".to_owned(),
            Target::L4 => "l4-roundrobin".to_owned(),
            Target::Haproxy => "haproxy".to_owned(),
            Target::Nginx => "nginx".to_owned(),
            Target::Skewless => "skewless".to_owned(),
            Target::Connection => "skewless-connection".to_owned(),
            Target::Codec => "skewless-codec".to_owned(),
            Target::Build(i) => format!("skewless@{}", self.builds[i].0),
        }
    }

    /// Whether `--targets` selects `t` (everything when it is empty).
    pub(crate) fn selected(&self, t: Target) -> bool {
        self.targets.is_empty() || self.targets.contains(&self.name(t))
    }

    /// `targets` without the ones `--targets` leaves out; every build follows `skewless`.
    pub(crate) fn choose(&self, targets: &[Target]) -> Vec<Target> {
        let mut out = Vec::new();
        for &t in targets {
            out.push(t);
            if t == Target::Skewless {
                if self.connection_mode {
                    out.push(Target::Connection);
                }
                if self.codec_path {
                    out.push(Target::Codec);
                }
                out.extend((0..self.builds.len()).map(Target::Build));
            }
        }
        out.retain(|t| self.selected(*t));
        out
    }

    /// Whether this run has the `skewless-connection` target.
    pub(crate) fn runs_connection_mode(&self) -> bool {
        self.connection_mode && self.selected(Target::Connection)
    }

    /// Fails on a `--targets` name that is no target of this run.
    pub(crate) fn check_targets(&self) -> anyhow::Result<()> {
        let mut known: Vec<String> = [
            Target::DirectHealthy,
            Target::DirectSlow,
            Target::L4,
            Target::Haproxy,
            Target::Nginx,
            Target::Skewless,
            Target::Connection,
            Target::Codec,
        ]
        .into_iter()
        .map(|t| self.name(t))
        .collect();
        known.extend((0..self.builds.len()).map(|i| self.name(Target::Build(i))));
        for t in &self.targets {
            if !known.contains(t) {
                bail!(
                    "unknown target {t:?} in --targets (known: {})",
                    known.join(", ")
                );
            }
        }
        for (label, path) in &self.builds {
            if !path.is_file() {
                bail!("--skewless-build {label}={}: no such file", path.display());
            }
        }
        Ok(())
    }
}

impl Args {
    pub(crate) fn repeats_for(&self, connections: usize) -> usize {
        if self.repeat_connections.contains(&connections) {
            self.repeats.max(1)
        } else {
            1
        }
    }
}
