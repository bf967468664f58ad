//! `cargo xtask demo`: the pinning problem from real traffic on one machine.
//!
//! Five echo pods (grpcio servers, each naming itself in its replies) sit behind a ClusterIP
//! VIP that exists only as a kube-proxy-style nftables DNAT (`numgen random`, one choice per
//! connection). Clients in their own pods use grpcio's default channel (pick_first, one HTTP/2
//! connection) and count which pod answered each call.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use serde_json::Value;
use skewless_testbed::{Place, Testbed};

use crate::{setup, workspace_root};

const VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const PORT: u16 = 50051;

#[derive(clap::Args)]
pub struct Args {
    /// Echo pods behind the Service.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u8).range(2..=20))]
    pods: u8,
    /// Calls per client.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    calls: u32,
    /// Independent clients (each its own pod, its own connection).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=10))]
    clients: u8,
}

pub fn run(args: &Args) -> Result<()> {
    let &Args {
        pods,
        calls,
        clients,
    } = args;
    let gen_dir = generate_stubs()?;
    let py = setup::venv_python();
    let py = py.to_str().context("venv path is not UTF-8")?;
    let script = |name: &str| {
        workspace_root()
            .join("xtask/py")
            .join(name)
            .display()
            .to_string()
    };
    let servers: Vec<String> = (0..pods).map(|i| format!("echo-{i}")).collect();
    let client_names: Vec<String> = (0..clients).map(|i| format!("client-{i}")).collect();

    let mut builder = Testbed::builder().nodes(1);
    for name in servers.iter().chain(&client_names) {
        builder = builder.pod(name, 0);
    }
    let backends: Vec<&str> = servers.iter().map(String::as_str).collect();
    let mut tb = builder
        .service("echo", VIP, PORT, PORT, &backends)
        .build()
        .context("building the testbed")?;
    println!(
        "testbed {}: {pods} echo pods behind ClusterIP {VIP}:{PORT} (nftables DNAT, random per connection)",
        tb.id()
    );

    let server_script = script("echo_server.py");
    let gen_arg = gen_dir.display().to_string();
    for name in &servers {
        tb.spawn(
            Place::Pod(name),
            &[
                py,
                &server_script,
                "--gen",
                &gen_arg,
                "--name",
                name,
                "--port",
                &PORT.to_string(),
            ],
        )?;
    }
    for name in &servers {
        let ip = tb.pod(name)?.ip;
        tb.wait_for_tcp(
            Place::Node(0),
            SocketAddrV4::new(ip, PORT),
            Duration::from_secs(20),
        )?;
    }

    println!(
        "\n1) Today: {clients} grpcio client(s) with the default channel (pick_first: one HTTP/2 connection), {calls} calls each"
    );
    let client_script = script("echo_client.py");
    let target = format!("{VIP}:{PORT}");
    for name in &client_names {
        let out = tb.run(
            Place::Pod(name),
            &[
                py,
                &client_script,
                "--gen",
                &gen_arg,
                "--target",
                &target,
                "--calls",
                &calls.to_string(),
            ],
        )?;
        let report: Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("client output: {}", String::from_utf8_lossy(&out.stdout)))?;
        print_report(name, &servers, &report)?;
    }
    println!(
        "\nEvery client's calls all land on one pod: the Service balances connections, and gRPC \
         uses one. Scaling the Deployment changes nothing for these clients; a slow pod keeps \
         its clients for the life of their connection."
    );
    Ok(())
}

fn print_report(client: &str, servers: &[String], report: &Value) -> Result<()> {
    let pods: BTreeMap<String, u64> = serde_json::from_value(report["pods"].clone())?;
    let ok = report["ok"].as_u64().unwrap_or(0);
    ensure!(ok > 0, "{client}: no call succeeded: {report}");
    let receiving = pods.values().filter(|&&n| n > 0).count();
    let largest = pods.values().copied().max().unwrap_or(0);
    println!("\n   {client}: {ok} ok, errors {}", report["errors"]);
    println!("   {:<10} {:>7} {:>7}", "pod", "calls", "share");
    for s in servers {
        let n = pods.get(s).copied().unwrap_or(0);
        #[expect(clippy::cast_precision_loss, reason = "call counts are far below 2^52")]
        let share = 100.0 * n as f64 / ok as f64;
        let bar = "#".repeat(usize::try_from(n * 30 / ok).unwrap_or(0));
        println!(
            "{}",
            format!("   {s:<10} {n:>7} {share:>6.1}% {bar}").trim_end()
        );
    }
    #[expect(clippy::cast_precision_loss, reason = "call counts are far below 2^52")]
    let largest_share = largest as f64 / ok as f64;
    println!(
        "   backends receiving traffic: {receiving} of {}, largest share {largest_share:.2}, p50 {} ms, p99 {} ms",
        servers.len(),
        report["p50_ms"],
        report["p99_ms"]
    );
    Ok(())
}

/// Generates the Python stubs for the echo proto into target/py-gen.
fn generate_stubs() -> Result<PathBuf> {
    let root = workspace_root();
    let out = root.join("target/py-gen");
    std::fs::create_dir_all(&out)?;
    let proto_dir = root.join("proto");
    setup::run(
        Command::new(setup::venv_python())
            .args(["-m", "grpc_tools.protoc"])
            .arg(format!("-I{}", proto_dir.display()))
            .arg(format!("--python_out={}", out.display()))
            .arg(format!("--grpc_python_out={}", out.display()))
            .arg(proto_dir.join("skewless/echo/v1/echo.proto")),
    )?;
    // grpc_tools emits absolute `from skewless.echo.v1 import ...`; make them packages.
    for dir in ["skewless", "skewless/echo", "skewless/echo/v1"] {
        touch(&out.join(dir).join("__init__.py"))?;
    }
    Ok(out)
}

fn touch(path: &Path) -> Result<()> {
    if !path.exists() {
        std::fs::write(path, b"")?;
    }
    Ok(())
}
