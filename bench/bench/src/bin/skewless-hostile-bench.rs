//! Memory under 1,000 hostile client connections (issue 11 section 3), in both modes: run by
//! `cargo xtask bench --hostile-only` (and by `cargo xtask bench`).
//!
//! The balancer runs in a child process of its own (this program with `serve`), so its
//! resident memory is measured alone, from `/proc/<pid>/status`; the echo pod and every client
//! live in this (the parent) process. Per mode: a good client calls Echo in a loop all along;
//! after a baseline, 500 clients connect and send nothing, then 500 more send the preface,
//! SETTINGS and 200 PINGs and then never read (their PONGs back up); the balancer's RSS is read
//! 2 s after each group is connected (and written), so each group's cost per connection is
//! seen on its own, all before the 10 s handshake timeout closes the silent ones. The good
//! client must lose no call.

use std::io::BufRead as _;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use skewless_balancer::connection::{ConnectionBalancer, ConnectionConfig};
use skewless_balancer::{Balancer, Config, Endpoint};
use skewless_echo::SpawnedEcho;
use skewless_echo::pb::EchoRequest;
use skewless_echo::pb::echo_client::EchoClient;
use skewless_frame::{PREFACE, Ping, Settings};
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpStream};

const SILENT: usize = 500;
const PINGERS: usize = 500;
const PINGS: usize = 200;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        let mode = args.get(2).expect("serve MODE ENDPOINT").clone();
        let endpoint: SocketAddr = args
            .get(3)
            .expect("serve MODE ENDPOINT")
            .parse()
            .expect("an endpoint address");
        serve(&mode, endpoint);
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run());
}

/// The child: one balancer of `mode` on a single-threaded runtime (as one agent worker),
/// its address on the first line of standard output.
fn serve(mode: &str, endpoint: SocketAddr) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        println!("{}", listener.local_addr().expect("addr"));
        let (_tx, rx) = tokio::sync::watch::channel(vec![Endpoint::new(endpoint, "pod-0")]);
        let never = std::future::pending::<()>();
        match mode {
            "request" => Balancer::new(Config::default(), rx)
                .serve(listener, never)
                .await
                .expect("serve"),
            _ => {
                let b = ConnectionBalancer::new(ConnectionConfig::default(), rx);
                skewless_balancer::server::serve(&b, listener, never, |_| true)
                    .await
                    .expect("serve");
            }
        }
    });
}

/// Resident and peak resident memory of `pid`, KiB.
fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("a /proc status field")
    };
    (field("VmRSS:"), field("VmHWM:"))
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_server(mode: &str, pod: SocketAddr) -> (Server, SocketAddr) {
    let mut child = Command::new(std::env::current_exe().expect("own path"))
        .args(["serve", mode, &pod.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("the balancer starts");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("its address");
    let addr = line.trim().parse().expect("an address");
    (Server(child), addr)
}

/// Calls Echo until `stop`; (calls, failed).
async fn good_client(addr: SocketAddr, stop: tokio::sync::watch::Receiver<bool>) -> (u64, u64) {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .expect("the good client connects");
    let mut c = EchoClient::new(channel);
    let (mut calls, mut failed) = (0, 0);
    while !*stop.borrow() {
        let r = c
            .echo(EchoRequest {
                payload: b"good".to_vec(),
                ..EchoRequest::default()
            })
            .await;
        calls += 1;
        failed += u64::from(r.is_err());
    }
    (calls, failed)
}

async fn run() {
    let pod = SpawnedEcho::start("127.0.0.1:0".parse().expect("addr"), "pod-0")
        .await
        .expect("echo starts");
    let mut pinger = PREFACE.to_vec();
    Settings::encode(false, &[], &mut pinger);
    for _ in 0..PINGS {
        Ping {
            ack: false,
            opaque: [7; 8],
        }
        .encode(&mut pinger);
    }
    println!(
        "| mode | balancer RSS before | with {SILENT} silent | per silent connection | with {PINGERS} PING-sending non-readers more | per PING-sending connection | peak RSS | good client calls (failed) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for mode in ["request", "connection"] {
        let (server, addr) = start_server(mode, pod.addr);
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let good = tokio::spawn(good_client(addr, stop));
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (before, _) = rss_kib(server.0.id());
        let mut hostile = Vec::with_capacity(SILENT + PINGERS);
        for _ in 0..SILENT {
            let s = TcpStream::connect(addr)
                .await
                .expect("a silent client connects");
            hostile.push(s);
        }
        // Let the balancer take them in (each step well before the 10 s handshake timeout).
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (with_silent, _) = rss_kib(server.0.id());
        for _ in 0..PINGERS {
            let mut s = TcpStream::connect(addr)
                .await
                .expect("a PING-sending client connects");
            s.write_all(&pinger).await.expect("the PINGs are written");
            hostile.push(s);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (with, peak) = rss_kib(server.0.id());
        stop_tx.send_replace(true);
        let (calls, failed) = good.await.expect("good client");
        drop(hostile);
        drop(server);
        let per = |from: u64, to: u64, n: usize| to.saturating_sub(from) as f64 / n as f64;
        let mib = |kib: u64| kib as f64 / 1024.0;
        println!(
            "| {mode} | {:.1} MiB | {:.1} MiB | {:.1} KiB | {:.1} MiB | {:.1} KiB | {:.1} MiB | {calls} ({failed}) |",
            mib(before),
            mib(with_silent),
            per(before, with_silent, SILENT),
            mib(with),
            per(with_silent, with, PINGERS),
            mib(peak),
        );
        assert_eq!(failed, 0, "{mode}: the good client lost calls");
    }
}
