//! Running the clients: in a testbed pod (through its VIP and the eBPF redirect), or on
//! loopback, each bounded in time, each result parsed into a [`ClientResult`].

use std::{
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use skewless_testbed::{Place, Testbed, grpc};

use crate::{ClientKind, ClientResult, ClientSpec};

/// Errors of the harness.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("testbed")]
    Testbed(#[from] skewless_testbed::Error),
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("building the harness binaries failed: {stderr}")]
    Build { stderr: String },
    #[error(
        "{path} is missing: {BIN_DIR_ENV} names a directory without it (`cargo xtask test` \
         links its test build's binaries there)"
    )]
    MissingBin { path: PathBuf },
    #[error("the {kind} client printed no result; stdout {stdout:?}, stderr {stderr:?}")]
    Parse {
        kind: ClientKind,
        stdout: String,
        stderr: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("the {kind} client ran longer than its bound of {bound:?} and was killed")]
    Timeout { kind: ClientKind, bound: Duration },
}

pub type Result<T, E = HarnessError> = std::result::Result<T, E>;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> HarnessError + '_ {
    move |source| HarnessError::Io {
        path: path.to_owned(),
        source,
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace_root().join("target"), PathBuf::from)
}

/// Where `cargo xtask setup` puts the grpc-js client's npm packages (next to the venv).
#[must_use]
pub fn node_modules() -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/skewless/node/node_modules")
}

/// The binaries [`bin_dir`] provides: this crate's and the tonic echo backend.
pub const BINS: [&str; 3] = [
    "skewless-tonic-client",
    "skewless-framelog",
    "skewless-echo",
];

/// Names a directory that holds [`BINS`] as built by the test run's own build, so
/// [`bin_dir`] builds nothing. `cargo xtask test` sets it: its test build compiles these
/// binaries with the same features as the tests, where a `cargo build` of the two packages
/// alone would compile their dependencies a second time.
pub const BIN_DIR_ENV: &str = "SKEWLESS_TEST_BIN_DIR";

/// The directory that holds [`BINS`]. A test of another package cannot name them with
/// `CARGO_BIN_EXE_*`: under [`BIN_DIR_ENV`] they are taken from there (and must all be
/// there); without it they are built with cargo (once per process; a no-op when they are
/// fresh).
///
/// # Errors
/// When cargo fails, or a binary is missing from [`BIN_DIR_ENV`]'s directory.
pub fn bin_dir() -> Result<PathBuf> {
    static BUILT: Mutex<bool> = Mutex::new(false);
    if let Some(dir) = std::env::var_os(BIN_DIR_ENV) {
        return prebuilt(PathBuf::from(dir));
    }
    let mut built = BUILT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = target_dir().join("debug");
    if !*built {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let out = Command::new(cargo)
            .current_dir(workspace_root())
            .args(["build", "--quiet", "--bins"])
            .args([
                "--package",
                "skewless-clients",
                "--package",
                "skewless-echo",
            ])
            .stdin(Stdio::null())
            .output()
            .map_err(io(Path::new("cargo")))?;
        if !out.status.success() {
            return Err(HarnessError::Build {
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        *built = true;
    }
    Ok(dir)
}

/// `dir`, once every one of [`BINS`] is found in it.
fn prebuilt(dir: PathBuf) -> Result<PathBuf> {
    match BINS.iter().map(|bin| dir.join(bin)).find(|p| !p.exists()) {
        Some(path) => Err(HarnessError::MissingBin { path }),
        None => Ok(dir),
    }
}

/// What the clients need: the Python stubs, the proto for grpc-js, the tonic binary.
#[derive(Debug, Clone)]
pub struct Harness {
    gen_dir: PathBuf,
    bin_dir: PathBuf,
}

impl Harness {
    /// Generates the Python stubs and builds the tonic client.
    ///
    /// # Errors
    /// When the venv is missing (`cargo xtask setup`) or the build fails.
    pub fn new() -> Result<Self> {
        Ok(Self {
            gen_dir: grpc::generate_stubs()?,
            bin_dir: bin_dir()?,
        })
    }

    /// The Python stubs' directory (for grpcio servers next to the clients).
    #[must_use]
    pub fn gen_dir(&self) -> &Path {
        &self.gen_dir
    }

    /// A binary of this crate (`skewless-framelog`, `skewless-tonic-client`) or
    /// `skewless-echo`.
    #[must_use]
    pub fn bin(&self, name: &str) -> PathBuf {
        self.bin_dir.join(name)
    }

    /// The command line of a frame-logging tap (`skewless-framelog`) that listens on
    /// `listen`, relays to `upstream`, withholds what `withhold` says from the client, and
    /// logs to `log`.
    #[must_use]
    pub fn tap_argv(
        &self,
        listen: SocketAddr,
        upstream: SocketAddr,
        withhold: crate::framelog::Withhold,
        log: &Path,
    ) -> Vec<String> {
        let mut argv = vec![
            self.bin("skewless-framelog").display().to_string(),
            "--listen".into(),
            listen.to_string(),
            "--upstream".into(),
            upstream.to_string(),
            "--log".into(),
            log.display().to_string(),
        ];
        let crate::framelog::Withhold { goaway, ping } = withhold;
        if goaway {
            argv.push("--withhold-goaway".into());
        }
        if ping {
            argv.push("--withhold-ping".into());
        }
        argv
    }

    /// The client's command line.
    #[must_use]
    pub fn argv(&self, kind: ClientKind, spec: &ClientSpec) -> Vec<String> {
        let root = workspace_root();
        let mut argv: Vec<String> = match kind {
            ClientKind::Grpcio => vec![
                grpc::python().display().to_string(),
                grpc::script("echo_client.py").display().to_string(),
                "--json".into(),
                "--gen".into(),
                self.gen_dir.display().to_string(),
            ],
            ClientKind::GrpcJs => vec![
                "node".into(),
                root.join("testing/node/echo_client.js")
                    .display()
                    .to_string(),
                "--proto".into(),
                root.join("proto").display().to_string(),
            ],
            ClientKind::Tonic => vec![self.bin("skewless-tonic-client").display().to_string()],
        };
        argv.extend(spec.args());
        argv
    }

    /// Runs a client in `place` of the testbed to its end and returns its result.
    ///
    /// # Errors
    /// When it cannot start, overruns its bound, or prints no result.
    pub fn run(
        &self,
        tb: &mut Testbed,
        place: Place<'_>,
        kind: ClientKind,
        spec: &ClientSpec,
    ) -> Result<ClientResult> {
        self.spawn(tb, place, kind, spec)?.wait(tb)
    }

    /// Starts a client in `place` in the background (owned by the testbed, like every process
    /// it starts); [`Running::wait`] collects its result.
    ///
    /// # Errors
    /// When it cannot start.
    pub fn spawn(
        &self,
        tb: &mut Testbed,
        place: Place<'_>,
        kind: ClientKind,
        spec: &ClientSpec,
    ) -> Result<Running> {
        let argv = self.argv(kind, spec);
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let mut cmd = tb.command(place, &argv)?;
        let files = OutputFiles::new()?;
        files.attach(&mut cmd, kind)?;
        let pid = tb.spawn_command(&mut cmd)?;
        Ok(Running {
            pid,
            kind,
            files,
            bound: spec.time_bound(),
            started: Instant::now(),
        })
    }

    /// Runs a client on this machine's loopback, outside any testbed (unprivileged tests).
    ///
    /// # Errors
    /// When it cannot start, overruns its bound, or prints no result.
    pub fn run_local(&self, kind: ClientKind, spec: &ClientSpec) -> Result<ClientResult> {
        let argv = self.argv(kind, spec);
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]).stdin(Stdio::null());
        let files = OutputFiles::new()?;
        files.attach(&mut cmd, kind)?;
        let mut child = cmd.spawn().map_err(io(Path::new(&argv[0])))?;
        let (bound, started) = (spec.time_bound(), Instant::now());
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                return files.parse(kind);
            }
            if started.elapsed() > bound {
                let _ = child.kill();
                let _ = child.wait();
                return Err(HarnessError::Timeout { kind, bound });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A client started by [`Harness::spawn`].
#[derive(Debug)]
pub struct Running {
    pid: u32,
    kind: ClientKind,
    files: OutputFiles,
    bound: Duration,
    started: Instant,
}

impl Running {
    /// Its PID (the testbed owns the process).
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits for the client to end (killing it past its time bound) and parses its result.
    ///
    /// # Errors
    /// When it overran its bound or printed no result.
    pub fn wait(self, tb: &mut Testbed) -> Result<ClientResult> {
        while tb.is_running(self.pid) {
            if self.started.elapsed() > self.bound {
                tb.kill(self.pid);
                return Err(HarnessError::Timeout {
                    kind: self.kind,
                    bound: self.bound,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.files.parse(self.kind)
    }
}

/// The files a client's stdout and stderr go to, removed when dropped.
#[derive(Debug)]
struct OutputFiles {
    stdout: PathBuf,
    stderr: PathBuf,
}

impl OutputFiles {
    fn new() -> Result<Self> {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let base = std::env::temp_dir().join(format!("skewless-client-{}-{n}", std::process::id()));
        Ok(Self {
            stdout: base.with_extension("out"),
            stderr: base.with_extension("err"),
        })
    }

    fn attach(&self, cmd: &mut Command, kind: ClientKind) -> Result<()> {
        let out = fs::File::create(&self.stdout).map_err(io(&self.stdout))?;
        let err = fs::File::create(&self.stderr).map_err(io(&self.stderr))?;
        cmd.stdout(out).stderr(err);
        if kind == ClientKind::GrpcJs {
            cmd.env("NODE_PATH", node_modules());
        }
        Ok(())
    }

    fn parse(&self, kind: ClientKind) -> Result<ClientResult> {
        let stdout = fs::read_to_string(&self.stdout).map_err(io(&self.stdout))?;
        let stderr = fs::read_to_string(&self.stderr).unwrap_or_default();
        let line = stdout
            .lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .unwrap_or("");
        serde_json::from_str(line).map_err(|source| HarnessError::Parse {
            kind,
            stdout: stdout.clone(),
            stderr: tail(&stderr, 4000),
            source,
        })
    }
}

impl Drop for OutputFiles {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.stdout);
        let _ = fs::remove_file(&self.stderr);
    }
}

fn tail(s: &str, n: usize) -> String {
    let start = s.len().saturating_sub(n);
    let start = (start..s.len())
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(s.len());
    s[start..].to_owned()
}

#[cfg(test)]
mod tests {
    use super::{BINS, HarnessError, prebuilt};

    #[test]
    fn a_prebuilt_directory_must_hold_every_binary() {
        let dir = tempfile::tempdir().expect("tempdir");
        for bin in &BINS[..2] {
            std::fs::write(dir.path().join(bin), b"").expect("write");
        }
        match prebuilt(dir.path().to_owned()) {
            Err(HarnessError::MissingBin { path }) => {
                assert_eq!(path, dir.path().join(BINS[2]), "the missing one is named");
            }
            other => panic!("a directory without {} is refused: {other:?}", BINS[2]),
        }
        std::fs::write(dir.path().join(BINS[2]), b"").expect("write");
        assert_eq!(
            prebuilt(dir.path().to_owned()).expect("every binary is there"),
            dir.path()
        );
    }
}
