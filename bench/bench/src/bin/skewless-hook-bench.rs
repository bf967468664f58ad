//! Benchmark: run time of the connect4 hook per call, from the kernel's own accounting.
//!
//! Run by `cargo xtask bench` (root). A client pod makes single connects on command; between
//! two connects the benchmark reads connect4's cumulative run time and count, so every delta
//! is exactly one program run. Two cases: a redirected connect (map hit, rewrite, origdst
//! insert) and an untouched one (map miss). Prints a markdown table (ns).

use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::Stdio,
};

use hdrhistogram::Histogram;
use skewless_datapath::{Datapath, enable_stats};
use skewless_testbed::{Place, fixtures::IdentBed, scripts};

const SAMPLES: usize = 2000;
const WARMUP: usize = 100;

fn main() {
    let bed = IdentBed::new().expect("testbed builds (needs root)");
    let mut dp = Datapath::load().expect("eBPF programs load");
    dp.set_redirect(IdentBed::vip(), IdentBed::balancer())
        .unwrap();
    let _attachment = dp.attach(&bed.tb.pod("client").unwrap().cgroup).unwrap();
    let _stats = enable_stats().expect("enable BPF run time stats");

    let pod_ip = bed.tb.pod(IdentBed::SERVERS[0]).unwrap().ip;
    let cases = [
        ("redirected (VIP:port in map)", IdentBed::vip()),
        (
            "untouched (pod IP, map miss)",
            std::net::SocketAddrV4::new(pod_ip, IdentBed::PORT),
        ),
    ];
    println!("| connect4 case | samples | mean ns | p50 ns | p99 ns | max ns |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (label, addr) in cases {
        let hist = measure(&bed, &mut dp, addr);
        println!(
            "| {label} | {} | {:.0} | {} | {} | {} |",
            hist.len(),
            hist.mean(),
            hist.value_at_quantile(0.5),
            hist.value_at_quantile(0.99),
            hist.max()
        );
    }
}

fn measure(bed: &IdentBed, dp: &mut Datapath, addr: std::net::SocketAddrV4) -> Histogram<u64> {
    let (host, port) = (addr.ip().to_string(), addr.port().to_string());
    let mut cmd = bed
        .tb
        .command(
            Place::Pod("client"),
            &["python3", scripts::STEP_CONNECT, &host, &port],
        )
        .unwrap();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut hist = Histogram::<u64>::new_with_bounds(1, 10_000_000, 3).unwrap();
    let mut line = String::new();
    for i in 0..WARMUP + SAMPLES {
        let before = dp.program_stats("connect4").unwrap();
        stdin.write_all(b"go\n").unwrap();
        stdin.flush().unwrap();
        line.clear();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ok", "connect to {addr} failed");
        let after = dp.program_stats("connect4").unwrap();
        assert_eq!(
            after.run_count - before.run_count,
            1,
            "exactly one connect4 run per step"
        );
        if i >= WARMUP {
            let ns = (after.run_time - before.run_time).as_nanos();
            hist.record(u64::try_from(ns).unwrap_or(u64::MAX).max(1))
                .unwrap();
        }
    }
    drop(stdin);
    let _ = child.wait();
    hist
}
