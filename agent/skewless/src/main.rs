//! `skewless`: the node agent (`skewless agent`) and its command-line tools.
//!
//! The binary wires the library crates together and owns only what needs all of them:
//! `agent` (flags, start-up, shutdown order), `reconcile` (model snapshots -> balancers and
//! eBPF redirects, listener before redirect and redirect removed before drain), `observer`
//! (observe mode's skew from the datapath's connection records), `report` (balancer numbers
//! -> the admin crate's plain types), `admin` (the HTTP server of `/live`, `/ready`,
//! `/status`, `/metrics`), `status` (the `skewless status` client) and `peers` (flag value
//! types). Balancing, the eBPF side and Kubernetes stay in their crates.
#![forbid(unsafe_code)]

mod admin;
mod agent;
mod node;
mod observer;
mod peers;
mod privileges;
mod reconcile;
mod report;
mod stall;
mod status;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    version,
    about = "skewless: per-request balancing for gRPC Services, without a mesh"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the node agent: load the eBPF hooks, attach them to pod cgroups, redirect opted-in
    /// Services, and serve the admin API.
    Agent(Box<agent::Args>),
    /// Print what the agent on this node is doing (queries its admin API).
    Status(status::StatusArgs),
}

fn main() -> anyhow::Result<()> {
    let Cli { cmd } = Cli::parse();
    // The data-plane workers log from their own threads: a write to stderr that blocks (a
    // pipe its reader drains late, a slow disk) must not stall them. Lines go through a
    // bounded queue to a writer thread; when it is full they are dropped and counted.
    let (writer, _flush_at_exit) = log_writer(std::io::stderr());
    let dropped = writer.error_counter();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(writer)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.spawn(report_dropped_log_lines(dropped));
    match cmd {
        Cmd::Agent(args) => rt.block_on(agent::run(*args)),
        Cmd::Status(args) => rt.block_on(status::status(args)),
    }
}

/// Log lines waiting for stderr at most (a few MiB); more are dropped and counted.
const LOG_QUEUE_LINES: usize = 8192;

/// The agent's log writer over `out`: bounded, lossy, on its own thread (see `main`).
fn log_writer<W: std::io::Write + Send + 'static>(
    out: W,
) -> (
    tracing_appender::non_blocking::NonBlocking,
    tracing_appender::non_blocking::WorkerGuard,
) {
    tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(LOG_QUEUE_LINES)
        .lossy(true)
        .thread_name("skewless-log")
        .finish(out)
}

/// Warns, at most every 10 s, when log lines were dropped because stderr was not read fast
/// enough (the warning itself goes through the same queue, once there is room).
async fn report_dropped_log_lines(dropped: tracing_appender::non_blocking::ErrorCounter) {
    let mut reported = 0;
    let mut every = tokio::time::interval(std::time::Duration::from_secs(10));
    loop {
        every.tick().await;
        let total = dropped.dropped_lines();
        if total > reported {
            tracing::warn!(
                dropped = total - reported,
                total,
                "log lines dropped: stderr is not read fast enough"
            );
            reported = total;
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::{Cli, Cmd, LOG_QUEUE_LINES, log_writer};

    /// A stderr nobody reads: every write blocks until the test ends.
    struct Stuck(std::sync::mpsc::Receiver<()>);

    impl std::io::Write for Stuck {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let _ = self.0.recv();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A data-plane worker logs from its own thread: with stderr stuck, its log calls must
    /// still return (the lines past the queue dropped and counted), not block the worker.
    #[test]
    fn logging_never_blocks_on_a_stderr_nobody_reads_and_counts_what_it_drops() {
        use std::io::Write as _;
        let (unstick, stuck) = std::sync::mpsc::channel();
        let (writer, guard) = log_writer(Stuck(stuck));
        let dropped = writer.error_counter();
        let lines = 4 * LOG_QUEUE_LINES;
        let (done, logged) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut writer = writer;
            for i in 0..lines {
                let _ = writeln!(writer, "line {i}");
            }
            let _ = done.send(());
        });
        // A bound on a hang, not a speed target: blocked, the thread never sends.
        logged
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("a log call blocked on the stuck stderr");
        assert!(
            dropped.dropped_lines() >= lines - LOG_QUEUE_LINES - 1,
            "lines past the queue are dropped and counted: {} of {lines}",
            dropped.dropped_lines()
        );
        drop(unstick);
        drop(guard);
    }

    /// The DaemonSet's container args must be flags this binary accepts.
    #[test]
    fn daemonset_args_parse() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/daemonset.yaml");
        let ds: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_sequence()
            .expect("the agent container has args");
        let argv: Vec<String> = std::iter::once("skewless".to_owned())
            .chain(
                args.iter()
                    .map(|a| a.as_str().unwrap().replace("$(NODE_NAME)", "node-a")),
            )
            .collect();
        let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?} rejected: {e}"));
        assert!(
            matches!(cli.cmd, Cmd::Agent(_)),
            "the DaemonSet must run `skewless agent`"
        );
        assert!(
            Cli::try_parse_from(["skewless", "agent", "--no-such-flag"]).is_err(),
            "unknown flags must be rejected"
        );
    }
}
