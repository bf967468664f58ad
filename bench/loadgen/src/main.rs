//! `skewless-loadgen`: closed- or open-loop load against an echo target, or (`local`) against an
//! in-process balancer in front of in-process echo pods, one of them slowed down. The local
//! mode measures skewless alone; the side-by-side benchmark with HAProxy/nginx is separate.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use skewless_balancer::{Balancer, Config, Endpoint};
use skewless_echo::SpawnedEcho;
use skewless_loadgen::{Load as Issue, LoadConfig, run};

#[derive(Debug, Parser)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Load an existing target.
    Run {
        /// Address of the echo service (a pod, a proxy or a VIP).
        #[arg(long)]
        target: SocketAddr,
        #[command(flatten)]
        load: Load,
        /// Print the report as one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Start `pods` echo pods and a balancer in this process, then load the balancer.
    Local {
        /// Echo pods behind the balancer.
        #[arg(long, default_value_t = 5)]
        pods: usize,
        /// Delay of the last pod, in milliseconds (0: all healthy).
        #[arg(long, default_value_t = 0)]
        slow_ms: u64,
        /// Send the load straight to the first pod instead (the pinned baseline).
        #[arg(long)]
        direct: bool,
        #[command(flatten)]
        load: Load,
    },
}

#[derive(Debug, Args)]
struct Load {
    /// HTTP/2 connections.
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Closed loop: calls in flight per connection.
    #[arg(long, default_value_t = 200, conflicts_with = "rate")]
    in_flight: usize,
    /// Open loop instead: this many calls per second in total, each due at a fixed time and
    /// timed from then (no coordinated omission).
    #[arg(long)]
    rate: Option<f64>,
    /// Open loop: most calls outstanding per connection (the sender waits beyond it).
    #[arg(long, default_value_t = 1000)]
    max_in_flight: usize,
    /// Warm-up seconds (not measured).
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Measured seconds.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Request payload bytes.
    #[arg(long, default_value_t = 16)]
    payload: usize,
}

impl Load {
    fn config(&self, target: SocketAddr) -> LoadConfig {
        let Load {
            connections,
            in_flight,
            rate,
            max_in_flight,
            warmup,
            duration,
            payload,
        } = *self;
        LoadConfig {
            target,
            connections,
            load: match rate {
                Some(rate) => Issue::Open {
                    rate,
                    max_in_flight,
                },
                None => Issue::Closed { in_flight },
            },
            warmup: Duration::from_secs_f64(warmup),
            duration: Duration::from_secs_f64(duration),
            payload,
        }
    }
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let Cli { command } = Cli::parse();
    match command {
        Command::Run { target, load, json } => {
            let rt = tokio::runtime::Runtime::new().context("runtime")?;
            let report = rt.block_on(run(&load.config(target)))?.report();
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{report}");
            }
        }
        Command::Local {
            pods,
            slow_ms,
            direct,
            load,
        } => {
            // The servers get their own runtime (own threads), so the load generator's work
            // is not scheduled in between theirs.
            let servers = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .context("server runtime")?;
            let (target, keep) = servers.block_on(async {
                let mut echo = Vec::new();
                for i in 0..pods {
                    let pod = SpawnedEcho::start("127.0.0.1:0".parse()?, &format!("pod-{i}"))
                        .await
                        .context("echo pod")?;
                    echo.push(pod);
                }
                if let Some(last) = echo.last() {
                    last.control.set_delay(Duration::from_millis(slow_ms));
                }
                let endpoints: Vec<Endpoint> = echo
                    .iter()
                    .map(|p| Endpoint::new(p.addr, &p.name))
                    .collect();
                if direct {
                    let addr = echo[0].addr;
                    return anyhow::Ok((addr, (echo, None)));
                }
                let (tx, rx) = tokio::sync::watch::channel(endpoints);
                let balancer = std::sync::Arc::new(Balancer::new(Config::default(), rx));
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                let addr = listener.local_addr()?;
                let b = balancer.clone();
                tokio::spawn(async move { b.serve(listener, std::future::pending()).await });
                anyhow::Ok((addr, (echo, Some((tx, balancer)))))
            })?;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .context("load runtime")?;
            let report = rt.block_on(run(&load.config(target)))?.report();
            print!("{report}");
            if let (_, Some((_, balancer))) = &keep {
                for s in balancer.stats() {
                    println!(
                        "  balancer: {} {:?} requests {} probes {} failures {}",
                        s.name, s.state, s.requests, s.probes, s.failures
                    );
                }
            }
            drop(keep);
            servers.shutdown_timeout(Duration::from_secs(1));
        }
    }
    Ok(())
}
