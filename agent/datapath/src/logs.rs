//! The programs' log lines, forwarded into the agent's tracing.
//!
//! The programs log only their rare failure paths (a record insert the kernel refused, a
//! callback that could not be set), at most one line per failure kind and CPU a second
//! (`LOG_EVERY_NS`), into aya-log's ring buffer; the success paths never write to it. Each
//! line carries what a counter cannot: the address, the cgroup or socket, the errno.
//! [`ProgramLogs::forward`] moves the reader to a thread of its own that waits (poll(2)) for
//! the buffer to be readable and drains it; nothing else waits on it. A full ring buffer
//! drops lines in the kernel (the counters still count every failure).

use std::os::fd::{AsFd, BorrowedFd};

use aya::Ebpf;

use crate::Error;

/// The reader of the programs' log ring buffer. Keep it for as long as the programs run:
/// dropping it closes the map.
pub struct ProgramLogs(aya_log::EbpfLogger<Forward>);

impl std::fmt::Debug for ProgramLogs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProgramLogs").finish_non_exhaustive()
    }
}

impl ProgramLogs {
    /// Takes the programs' log map out of `ebpf`, before the programs are loaded.
    pub(crate) fn take(ebpf: &mut Ebpf) -> Result<Self, Error> {
        aya_log::EbpfLogger::init_with_logger(ebpf, Forward)
            .map(Self)
            .map_err(Error::Logs)
    }

    /// Forwards every line waiting in the ring buffer into tracing (target `skewless_ebpf`).
    pub fn drain(&mut self) {
        self.0.flush();
    }

    /// Forwards the lines for the rest of the process's life, from a thread named
    /// `skewless-ebpf-log` that sleeps in poll(2) until the buffer has some.
    ///
    /// # Errors
    /// When the thread cannot be started.
    pub fn forward(mut self) -> std::io::Result<()> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        std::thread::Builder::new()
            .name("skewless-ebpf-log".to_owned())
            .spawn(move || {
                loop {
                    let mut fds = [PollFd::new(self.as_fd(), PollFlags::POLLIN)];
                    match poll(&mut fds, PollTimeout::NONE) {
                        Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                        Err(error) => {
                            tracing::warn!(%error, "the programs' log lines cannot be read; their failures are still counted");
                            return;
                        }
                    }
                    self.drain();
                }
            })
            .map(drop)
    }
}

impl AsFd for ProgramLogs {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// aya-log's records as tracing events: the program's level, its text as `line`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Forward;

impl log::Log for Forward {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let line = record.args();
        match record.level() {
            log::Level::Error => {
                tracing::error!(target: "skewless_ebpf", %line, "eBPF program reported a failure");
            }
            log::Level::Warn => {
                tracing::warn!(target: "skewless_ebpf", %line, "eBPF program reported");
            }
            log::Level::Info => tracing::info!(target: "skewless_ebpf", %line, "eBPF program"),
            log::Level::Debug => tracing::debug!(target: "skewless_ebpf", %line, "eBPF program"),
            log::Level::Trace => tracing::trace!(target: "skewless_ebpf", %line, "eBPF program"),
        }
    }

    fn flush(&self) {}
}
