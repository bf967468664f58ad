//! `cargo xtask demo`: the pinning problem and the fix, from real traffic on one machine.
//!
//! Echo pods (grpcio servers, each naming itself in its replies; one of them slow) sit behind
//! a ClusterIP VIP that exists only as a kube-proxy-style nftables DNAT (`numgen random`, one
//! choice per connection). Clients in their own pods use grpcio's default channel (pick_first,
//! one HTTP/2 connection) and count which pod answered each call. First without skewless, then
//! with `skewless agent` running in the node: same clients, same VIP, no client change. Last,
//! connection mode and the seed's scale-up ([`connection`]).

mod connection;

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use skewless_testbed::{
    Place, Testbed,
    grpc::{self, ClientReport},
};

use crate::target_dir;

const VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const PORT: u16 = 50051;
const ADMIN: &str = "127.0.0.1:9990";

#[derive(clap::Args)]
pub struct Args {
    /// Echo pods behind the Service.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u8).range(2..=20))]
    pods: u8,
    /// Extra delay of the last pod, in milliseconds (0: all pods healthy).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(0..=5_000))]
    slow_ms: u32,
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
        slow_ms,
        calls,
        clients,
    } = args;
    crate::build("demo: building the agent", &["--package", "skewless"])?;
    let agent_bin = target_dir().join("debug/skewless");
    let gen_dir = grpc::generate_stubs()?;
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
        "testbed {}: {pods} echo pods behind ClusterIP {VIP}:{PORT} (nftables DNAT, random per connection); {} is {slow_ms} ms slow",
        tb.id(),
        servers[servers.len() - 1]
    );
    for (i, name) in servers.iter().enumerate() {
        let delay = if i + 1 == servers.len() { slow_ms } else { 0 };
        grpc::spawn_echo_server(&mut tb, &gen_dir, name, PORT, delay)?;
    }
    for name in &servers {
        let ip = tb.pod(name)?.ip;
        tb.wait_for_tcp(
            Place::Node(0),
            SocketAddrV4::new(ip, PORT),
            Duration::from_secs(20),
        )?;
    }
    let target = format!("{VIP}:{PORT}");

    println!(
        "\n1) Without skewless: {clients} grpcio client(s), default channel (pick_first: one HTTP/2 connection), {calls} calls each"
    );
    for name in &client_names {
        let report = grpc::run_client(&tb, &gen_dir, Place::Pod(name), &target, calls, 4)?;
        print_report(name, &servers, &report)?;
    }

    println!(
        "\n2) With skewless: `skewless agent` in the node, the Service opted in with mode: request"
    );
    let services_file = target_dir().join(format!("demo-services-{}.yaml", tb.id()));
    write_services_file(&tb, &services_file, "request", &[], &servers)?;
    let mut argv: Vec<String> = vec![
        agent_bin.display().to_string(),
        "agent".into(),
        "--services-file".into(),
        services_file.display().to_string(),
        "--admin-addr".into(),
        ADMIN.into(),
    ];
    for name in &client_names {
        let pod = tb.pod(name)?;
        let [a, b, c, _] = pod.ip.octets();
        argv.extend(["--cgroup".into(), pod.cgroup.display().to_string()]);
        argv.extend(["--pod-cidr".into(), format!("{a}.{b}.{c}.0/24")]);
    }
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let agent = tb.spawn(Place::Node(0), &argv)?;
    wait_for_redirect(&mut tb, agent, &agent_bin)?;
    for name in &client_names {
        let report = grpc::run_client(&tb, &gen_dir, Place::Pod(name), &target, calls, 4)?;
        print_report(name, &servers, &report)?;
    }
    println!("\n`skewless status` in the node:");
    let out = tb.run(
        Place::Node(0),
        &[
            &agent_bin.display().to_string(),
            "status",
            "--admin-addr",
            ADMIN,
        ],
    )?;
    print!("{}", String::from_utf8_lossy(&out.stdout));

    println!(
        "\nWithout skewless every client's calls land on one pod, and a client pinned to the slow \
         pod sees its delay on every call. With the agent, the same clients (no change, same VIP) \
         are spread over every pod per request, and the slow pod gets only probe traffic."
    );

    let healthy = if slow_ms > 0 {
        &servers[..servers.len() - 1]
    } else {
        &servers[..]
    };
    connection::run(
        &mut tb,
        &connection::Act {
            gen_dir: &gen_dir,
            agent_bin: &agent_bin,
            services_file: &services_file,
            healthy,
            clients: &client_names,
        },
    )?;
    let graceful = tb.terminate(agent, Duration::from_secs(10));
    if !graceful {
        bail!("the agent did not exit within 10 s of SIGTERM");
    }
    Ok(())
}

/// The echo Service as the agent's services file describes it (what Kubernetes would say):
/// its mode, `skewless.io/` annotations and endpoints. Written whole, then renamed into place,
/// so the agent never reads half a file.
fn write_services_file(
    tb: &Testbed,
    path: &Path,
    mode: &str,
    annotations: &[(&str, &str)],
    endpoints: &[String],
) -> Result<()> {
    let mut yaml =
        format!("services:\n  - name: echo\n    clusterIPs: [\"{VIP}\"]\n    mode: {mode}\n");
    if !annotations.is_empty() {
        yaml.push_str("    annotations:\n");
        for (k, v) in annotations {
            yaml.push_str(&format!("      skewless.io/{k}: \"{v}\"\n"));
        }
    }
    yaml.push_str(&format!(
        "    ports:\n      - port: {PORT}\n        targetPort: {PORT}\n    endpoints:\n"
    ));
    for name in endpoints {
        yaml.push_str(&format!(
            "      - {{address: {}, target: {name}}}\n",
            tb.pod(name)?.ip
        ));
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, yaml).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Waits until the agent reports the Service redirected (or fails if the agent died).
fn wait_for_redirect(tb: &mut Testbed, agent: u32, agent_bin: &Path) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let bin = agent_bin.display().to_string();
    loop {
        if !tb.is_running(agent) {
            bail!("the agent exited during startup (see its log above)");
        }
        let mut cmd = tb.command(
            Place::Node(0),
            &[&bin, "status", "--json", "--admin-addr", ADMIN],
        )?;
        if let Ok(out) = cmd.output() {
            let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            if status["services"].as_array().is_some_and(|s| !s.is_empty()) {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("the agent did not redirect the Service within 20 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn print_report(client: &str, servers: &[String], report: &ClientReport) -> Result<()> {
    let ok = report.ok;
    if ok == 0 {
        bail!("{client}: no call succeeded: {report:?}");
    }
    let receiving = report.pods.values().filter(|&&n| n > 0).count();
    let largest = report.pods.values().copied().max().unwrap_or(0);
    println!("\n   {client}: {ok} ok, errors {:?}", report.errors);
    println!("   {:<10} {:>7} {:>7}", "pod", "calls", "share");
    for s in servers {
        let n = report.pods.get(s).copied().unwrap_or(0);
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
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    println!(
        "   backends receiving traffic: {receiving} of {}, largest share {largest_share:.2}, p50 {} ms, p99 {} ms",
        servers.len(),
        ms(report.p50_ms),
        ms(report.p99_ms)
    );
    Ok(())
}
