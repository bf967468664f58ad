//! The independent gRPC peers: grpcio (Python) echo servers and pick_first clients, from the
//! venv that `cargo xtask setup` creates.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use crate::{Error, Place, Result, Testbed, checked_output};

/// The venv's Python (grpcio, grpcio-tools, grpcio-health-checking).
#[must_use]
pub fn python() -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/skewless/venv/bin/python")
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Path of a script in `testing/py`.
#[must_use]
pub fn script(name: &str) -> PathBuf {
    workspace_root().join("testing/py").join(name)
}

/// Generates the Python stubs of the echo proto into `target/py-gen` and returns that
/// directory (pass it as `--gen` to the scripts).
///
/// Test processes run side by side and each asks for the stubs: under a lock on
/// `target/py-gen.lock`, they are written only when missing or older than the proto, so no
/// process rewrites a file another one's Python is importing.
///
/// # Errors
/// When grpc_tools fails (is the venv installed? `cargo xtask setup`).
pub fn generate_stubs() -> Result<PathBuf> {
    let root = workspace_root();
    let out = root.join("target/py-gen");
    let io = |path: &Path, source| Error::Io {
        path: path.to_owned(),
        source,
    };
    std::fs::create_dir_all(&out).map_err(|e| io(&out, e))?;
    let lock_path = root.join("target/py-gen.lock");
    let lock = std::fs::File::create(&lock_path).map_err(|e| io(&lock_path, e))?;
    lock.lock().map_err(|e| io(&lock_path, e))?;
    let proto_dir = root.join("proto");
    let proto = proto_dir.join("skewless/echo/v1/echo.proto");
    // Written after the stubs: their generation finished, from a proto no newer than it.
    let stamp = out.join("generated");
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if let (Some(made), Some(source)) = (modified(&stamp), modified(&proto))
        && made >= source
    {
        return Ok(out);
    }
    checked_output(
        Command::new(python())
            .args(["-m", "grpc_tools.protoc"])
            .arg(format!("-I{}", proto_dir.display()))
            .arg(format!("--python_out={}", out.display()))
            .arg(format!("--grpc_python_out={}", out.display()))
            .arg(proto_dir.join("skewless/echo/v1/echo.proto")),
    )?;
    // grpc_tools emits absolute `from skewless.echo.v1 import ...`; make them packages.
    for dir in ["skewless", "skewless/echo", "skewless/echo/v1"] {
        let init = out.join(dir).join("__init__.py");
        if !init.exists() {
            std::fs::write(&init, b"").map_err(|e| io(&init, e))?;
        }
    }
    std::fs::write(&stamp, b"").map_err(|e| io(&stamp, e))?;
    Ok(out)
}

/// Starts a grpcio echo server in `pod` on `port`, naming itself `pod`, with an optional
/// per-call delay. Returns its PID.
///
/// # Errors
/// If it cannot start.
pub fn spawn_echo_server(
    tb: &mut Testbed,
    gen_dir: &Path,
    pod: &str,
    port: u16,
    delay_ms: u32,
) -> Result<u32> {
    let (py, server) = (python(), script("echo_server.py"));
    let (gen_dir, port, delay) = (
        gen_dir.display().to_string(),
        port.to_string(),
        delay_ms.to_string(),
    );
    let argv = [
        py.to_str().unwrap_or("python3"),
        server.to_str().unwrap_or_default(),
        "--gen",
        &gen_dir,
        "--name",
        pod,
        "--port",
        &port,
        "--delay-ms",
        &delay,
    ];
    tb.spawn(Place::Pod(pod), &argv)
}

/// What one client run reported.
#[derive(Clone, Debug, Default)]
pub struct ClientReport {
    pub ok: u64,
    /// gRPC status name -> count.
    pub errors: BTreeMap<String, u64>,
    /// Pod name -> calls it served.
    pub pods: BTreeMap<String, u64>,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

/// Runs a grpcio client with the default channel (pick_first: one HTTP/2 connection) in
/// `place`: `calls` unary calls to `target` with `concurrency` threads.
///
/// # Errors
/// If the client fails to run or prints something unexpected.
pub fn run_client(
    tb: &Testbed,
    gen_dir: &Path,
    place: Place<'_>,
    target: &str,
    calls: u32,
    concurrency: u32,
) -> Result<ClientReport> {
    let (py, client) = (python(), script("echo_client.py"));
    let (gen_dir, calls, conc) = (
        gen_dir.display().to_string(),
        calls.to_string(),
        concurrency.to_string(),
    );
    let argv = [
        py.to_str().unwrap_or("python3"),
        client.to_str().unwrap_or_default(),
        "--gen",
        &gen_dir,
        "--target",
        target,
        "--calls",
        &calls,
        "--concurrency",
        &conc,
    ];
    let out = tb.run(place, &argv)?;
    parse_report(&String::from_utf8_lossy(&out.stdout))
}

/// Parses the client's one-line summary: `ok=N p50=X p99=Y pods=a:1,b:2 errors=C:1`.
fn parse_report(text: &str) -> Result<ClientReport> {
    let bad = || Error::Invalid(format!("client output {text:?}"), "not a client summary");
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with("ok="))
        .ok_or_else(bad)?;
    let mut report = ClientReport::default();
    let pairs = |v: &str| -> BTreeMap<String, u64> {
        v.split(',')
            .filter_map(|kv| kv.split_once(':'))
            .filter_map(|(k, n)| Some((k.to_owned(), n.parse().ok()?)))
            .collect()
    };
    for field in line.split_whitespace() {
        let (k, v) = field.split_once('=').ok_or_else(bad)?;
        match k {
            "ok" => report.ok = v.parse().map_err(|_| bad())?,
            "p50" => report.p50_ms = v.parse().ok(),
            "p99" => report.p99_ms = v.parse().ok(),
            "pods" => report.pods = pairs(v),
            "errors" => report.errors = pairs(v),
            _ => {}
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::parse_report;

    #[test]
    fn client_summary_parses() {
        let r = parse_report(
            "noise\nok=10 p50=1.5 p99=9.25 pods=echo-0:4,echo-1:6 errors=UNAVAILABLE:2\n",
        )
        .unwrap();
        assert_eq!(r.ok, 10);
        assert_eq!(r.pods.get("echo-1"), Some(&6));
        assert_eq!(r.errors.get("UNAVAILABLE"), Some(&2));
        assert_eq!(r.p99_ms, Some(9.25));
        assert!(
            parse_report("garbage").is_err(),
            "output without a summary must be an error"
        );
    }
}
