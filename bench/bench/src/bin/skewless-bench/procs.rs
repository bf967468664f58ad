//! The processes the benchmark starts (echo pods, proxies, load generators, clients): each
//! ended by its pid when dropped, also on errors; and the small helpers around them.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use skewless_bench::sampling::tree;

/// A process this benchmark started; ended by its pid (SIGTERM, then SIGKILL) when dropped.
pub struct Proc {
    name: String,
    /// The process.
    pub child: Child,
}

impl Proc {
    /// Starts `cmd`, named `name` in errors.
    ///
    /// # Errors
    /// When it cannot start.
    pub fn spawn(name: &str, cmd: &mut Command) -> anyhow::Result<Self> {
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({cmd:?})"))?;
        Ok(Self {
            name: name.to_owned(),
            child,
        })
    }

    /// Its pid.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until `addr` accepts connections, failing if the process exits first.
    ///
    /// # Errors
    /// When it exits first or is not listening after 10 s.
    pub fn wait_listening(&mut self, addr: SocketAddr) -> anyhow::Result<()> {
        self.wait_listening_for(addr, Duration::from_secs(10))
    }

    /// [`Proc::wait_listening`], at most `limit`.
    ///
    /// # Errors
    /// When it exits first or is not listening after `limit`.
    pub fn wait_listening_for(&mut self, addr: SocketAddr, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("{} exited before listening: {status}", self.name);
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{} is not listening on {addr} after {limit:?}", self.name);
            }
            sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the process to exit, at most `limit`.
    ///
    /// # Errors
    /// When it is still running after `limit`.
    pub fn wait_for(&mut self, limit: Duration) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait()? {
                return Ok(s);
            }
            if Instant::now() > deadline {
                bail!("{} did not finish within {limit:?}", self.name);
            }
            sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let pids = tree(self.pid());
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            sleep(Duration::from_millis(20));
        }
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            eprintln!("{} ignored SIGTERM; killing it", self.name);
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // Workers of a multi-process proxy that outlived their master (started by it, so
        // by this benchmark).
        for pid in pids.into_iter().skip(1) {
            if Path::new(&format!("/proc/{pid}")).exists() {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
    }
}

/// A free port on 127.0.0.1 (bound and released).
///
/// # Errors
/// When no port can be bound.
pub fn free_addr() -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?)
}

/// Sets an echo pod's delay through its admin port.
///
/// # Errors
/// When the pod does not accept it.
pub fn set_delay(admin: SocketAddr, ms: u64) -> anyhow::Result<()> {
    let mut s = TcpStream::connect_timeout(&admin, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(
        s,
        "PUT /delay/{ms} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    if !reply.starts_with("HTTP/1.1 2") {
        bail!("setting the delay at {admin}: {reply:?}");
    }
    Ok(())
}

/// A system tool (haproxy, nginx) in the usual directories.
#[must_use]
pub fn find_tool(name: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
}
