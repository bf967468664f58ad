//! Running things in the topology: commands and background processes in a node's or a pod's
//! namespace (and cgroup), which the testbed owns and ends by PID.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use tracing::debug;

use crate::{Error, Place, Result, Testbed, scripts};

/// `sh -c` arguments that move the shell into the cgroup given next (`$0`), then exec the
/// rest of the command line in it: nothing the command runs escapes that cgroup's hooks.
const JOIN_CGROUP: [&str; 3] = ["sh", "-c", r#"echo $$ > "$0/cgroup.procs" && exec "$@""#];

impl Testbed {
    /// A command that runs `argv` in `place` (network namespace, and the pod's cgroup for
    /// pods). The process joins the cgroup before it execs `argv`, so no socket escapes the
    /// hooks attached there. Uses `nsenter --net` rather than `ip netns exec`, which remounts
    /// /sys and would hide the cgroup v2 mount.
    ///
    /// # Errors
    /// If the pod is unknown.
    pub fn command(&self, place: Place<'_>, argv: &[&str]) -> Result<Command> {
        let (netns, cgroup) = match place {
            Place::Node(i) => (self.nodes[i].netns.clone(), None),
            Place::Pod(name) => {
                let pod = self.pod(name)?;
                (pod.netns.clone(), Some(pod.cgroup.clone()))
            }
        };
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{netns}")).arg("--");
        if let Some(cg) = cgroup {
            cmd.args(JOIN_CGROUP).arg(cg);
        }
        cmd.args(argv);
        Ok(cmd)
    }

    /// A command like [`Testbed::command`] whose process then moves on into `cgroup` (a
    /// cgroup below a pod's, from [`Testbed::child_cgroup`]) before it execs `argv`: a
    /// container of its own inside the pod, or a process in a node's namespace whose cgroup
    /// is under a pod's (the agent's, below the cgroup its hooks attach to).
    ///
    /// # Errors
    /// If the pod is unknown.
    pub fn command_in(&self, place: Place<'_>, cgroup: &Path, argv: &[&str]) -> Result<Command> {
        let mut cmd = self.command(place, &JOIN_CGROUP)?;
        cmd.arg(cgroup).args(argv);
        Ok(cmd)
    }

    /// Creates the cgroup `name` below `pod`'s cgroup (on Kubernetes: a container's cgroup
    /// below its pod's, or a pod's below `kubepods`). Hooks attached to the pod's cgroup
    /// cover it; the testbed removes it with the pod's.
    ///
    /// # Errors
    /// If the pod is unknown or the directory cannot be made.
    pub fn child_cgroup(&self, pod: &str, name: &str) -> Result<PathBuf> {
        let dir = self.pod(pod)?.cgroup.join(name);
        std::fs::create_dir(&dir).map_err(|source| Error::Io {
            path: dir.clone(),
            source,
        })?;
        Ok(dir)
    }

    /// Runs `argv` in `place` to completion.
    ///
    /// # Errors
    /// If it cannot start or exits non-zero.
    pub fn run(&self, place: Place<'_>, argv: &[&str]) -> Result<Output> {
        let mut cmd = self.command(place, argv)?;
        checked_output(&mut cmd)
    }

    /// Starts `argv` in `place` in the background. The testbed owns the process and ends it
    /// (by PID) when dropped. Returns the PID.
    ///
    /// # Errors
    /// If it cannot start.
    pub fn spawn(&mut self, place: Place<'_>, argv: &[&str]) -> Result<u32> {
        let mut cmd = self.command(place, argv)?;
        self.spawn_command(&mut cmd)
    }

    /// Starts a prepared command (from [`Testbed::command`]) in the background, owned by the
    /// testbed like [`Testbed::spawn`].
    ///
    /// # Errors
    /// If it cannot start.
    pub fn spawn_command(&mut self, cmd: &mut Command) -> Result<u32> {
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .map_err(|source| Error::Spawn {
                cmd: format!("{cmd:?}"),
                source,
            })?;
        let pid = child.id();
        debug!(pid, "spawned");
        self.children.push(child);
        Ok(pid)
    }

    /// Ends a process started by this testbed (SIGKILL, by PID) and reaps it.
    pub fn kill(&mut self, pid: u32) {
        if let Some(pos) = self.children.iter().position(|c| c.id() == pid) {
            let mut child = self.children.swap_remove(pos);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends SIGTERM to a process started by this testbed and waits up to `grace` for it to
    /// exit, then SIGKILLs it. Returns whether it exited on its own.
    pub fn terminate(&mut self, pid: u32, grace: Duration) -> bool {
        let Some(pos) = self.children.iter().position(|c| c.id() == pid) else {
            return false;
        };
        let mut child = self.children.swap_remove(pos);
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// Sends a signal (`STOP`, `CONT`, `TERM`, ...) to a process started by this testbed.
    /// Returns false if the PID is not one of ours.
    pub fn signal(&self, pid: u32, signal: &str) -> bool {
        self.children.iter().any(|c| c.id() == pid)
            && Command::new("kill")
                .args([format!("-{signal}"), pid.to_string()])
                .status()
                .is_ok_and(|s| s.success())
    }

    /// Whether a process started by this testbed is still running.
    pub fn is_running(&mut self, pid: u32) -> bool {
        self.children
            .iter_mut()
            .find(|c| c.id() == pid)
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Waits until something accepts TCP connections on `addr` as seen from `place`.
    ///
    /// # Errors
    /// On timeout.
    pub fn wait_for_tcp(
        &self,
        place: Place<'_>,
        addr: impl Into<SocketAddr>,
        timeout: Duration,
    ) -> Result<()> {
        let addr = addr.into();
        let deadline = Instant::now() + timeout;
        let (host, port) = (addr.ip().to_string(), addr.port().to_string());
        loop {
            let mut cmd = self.command(place, &["python3", scripts::TCP_CHECK, &host, &port])?;
            if cmd
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("tcp {addr}"),
                    timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

pub(crate) fn ip(args: &[&str]) -> Result<()> {
    checked_output(Command::new("ip").args(args)).map(drop)
}

/// Runs a command, turning a non-zero exit into an error that carries its stderr.
///
/// # Errors
/// If the command cannot start or exits non-zero.
pub fn checked_output(cmd: &mut Command) -> Result<Output> {
    let out = cmd.output().map_err(|source| Error::Spawn {
        cmd: format!("{cmd:?}"),
        source,
    })?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(Error::Command {
            cmd: format!("{cmd:?}"),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}
