//! Why a data-plane worker stalled, as the kernel saw its thread (Linux `/proc`): on a CPU
//! (a task that does not yield), runnable but waiting for a CPU (the machine or the process's
//! CPU share is starved), or neither (blocked in a system call or on a lock). The agent reads
//! a sample of each worker thread at every heartbeat and tells the cause when one stalls.

use std::fmt;
use std::time::Duration;

/// One thread's scheduler counters at one moment (`/proc/self/task/<tid>/{stat,schedstat}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadSample {
    /// The scheduler state: `R` running or runnable, `S` sleeping, `D` uninterruptible
    /// sleep (I/O), ...
    pub state: char,
    /// Time spent on a CPU so far.
    pub on_cpu: Duration,
    /// Time spent runnable, waiting on a run queue for a CPU, so far.
    pub waiting: Duration,
}

/// Where a stalled thread's time went between two samples (see [`StallTimes::cause`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StallCause {
    /// Mostly on a CPU: a task ran without yielding to the runtime.
    Busy,
    /// Mostly runnable but waiting for a CPU: the thread was starved of CPU time.
    Starved,
    /// Mostly neither: blocked in a system call (a write to a full pipe, a file, a lock).
    Blocked,
}

impl StallCause {
    /// The name the logs use.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Busy => "busy",
            Self::Starved => "starved",
            Self::Blocked => "blocked",
        }
    }
}

impl fmt::Display for StallCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A thread's time between two samples `over` apart: on a CPU, waiting for one, and the
/// rest (sleeping or blocked), and whether it was runnable at the later one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallTimes {
    pub on_cpu: Duration,
    pub waiting: Duration,
    pub off_cpu: Duration,
    /// State `R` at the later sample. The kernel adds a wait on the run queue to `schedstat`
    /// when the wait ends, so a thread still waiting shows that wait as `off_cpu`.
    pub runnable: bool,
}

impl StallTimes {
    /// Where most of the time went: on a CPU (busy); else runnable now or mostly waiting for
    /// a CPU (starved); else off the CPU (blocked).
    #[must_use]
    pub fn cause(&self) -> StallCause {
        if self.on_cpu >= self.waiting && self.on_cpu >= self.off_cpu {
            StallCause::Busy
        } else if self.runnable || self.waiting >= self.off_cpu {
            StallCause::Starved
        } else {
            StallCause::Blocked
        }
    }
}

impl ThreadSample {
    /// Reads the sample of thread `tid` of this process; `None` when `/proc` does not have
    /// it (not Linux, the thread is gone).
    #[must_use]
    pub fn read(tid: u32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
        let schedstat = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
        Self::parse(&stat, &schedstat)
    }

    /// Parses `stat` (its state field, after the parenthesised command name, which may hold
    /// spaces and parentheses) and `schedstat` (ns on a CPU, ns waiting on a run queue,
    /// timeslices).
    #[must_use]
    pub fn parse(stat: &str, schedstat: &str) -> Option<Self> {
        let state = stat[stat.rfind(')')? + 1..].trim_start().chars().next()?;
        let mut fields = schedstat.split_ascii_whitespace();
        let on_cpu = Duration::from_nanos(fields.next()?.parse().ok()?);
        let waiting = Duration::from_nanos(fields.next()?.parse().ok()?);
        Some(Self {
            state,
            on_cpu,
            waiting,
        })
    }

    /// The thread's times from `earlier` to this sample, `over` apart.
    #[must_use]
    pub fn since(&self, earlier: &Self, over: Duration) -> StallTimes {
        let on_cpu = self.on_cpu.saturating_sub(earlier.on_cpu);
        let waiting = self.waiting.saturating_sub(earlier.waiting);
        StallTimes {
            on_cpu,
            waiting,
            off_cpu: over.saturating_sub(on_cpu + waiting),
            runnable: self.state == 'R',
        }
    }
}

/// The kernel function thread `tid` sleeps in (`/proc/self/task/<tid>/wchan`; `0` while it
/// runs), and the system call it is in (`syscall`'s first field: a number, or `running`).
#[must_use]
pub fn blocked_in(tid: u32) -> (String, String) {
    let read = |file: &str| {
        std::fs::read_to_string(format!("/proc/self/task/{tid}/{file}"))
            .map(|s| s.split_ascii_whitespace().next().unwrap_or("").to_owned())
            .unwrap_or_else(|_| "unknown".to_owned())
    };
    (read("wchan"), read("syscall"))
}

/// This thread's id (`/proc/thread-self` links to `<pid>/task/<tid>`).
#[must_use]
pub fn current_tid() -> Option<u32> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_parses_the_state_after_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (skewless-dp (0) x) S 1 4242 4242 0 -1 4194560 0 0 0 0 3 1 0 0 20 0";
        let s = ThreadSample::parse(stat, "1500000000 250000000 77\n").expect("parses");
        assert_eq!(s.state, 'S');
        assert_eq!(s.on_cpu, Duration::from_millis(1500));
        assert_eq!(s.waiting, Duration::from_millis(250));
        assert_eq!(ThreadSample::parse("4242 (x)", "1 2 3"), None, "no state");
        assert_eq!(ThreadSample::parse(stat, "1"), None, "no run-queue time");
    }

    #[test]
    fn a_stall_is_told_by_where_most_of_its_time_went() {
        let at = |on_cpu_ms, waiting_ms| ThreadSample {
            state: 'S',
            on_cpu: Duration::from_millis(on_cpu_ms),
            waiting: Duration::from_millis(waiting_ms),
        };
        let over = Duration::from_millis(600);
        let before = at(1000, 1000);
        let cause = |now: ThreadSample| now.since(&before, over).cause();
        assert_eq!(cause(at(1500, 1050)), StallCause::Busy);
        assert_eq!(cause(at(1050, 1450)), StallCause::Starved);
        assert_eq!(cause(at(1010, 1010)), StallCause::Blocked);
        // Still waiting for a CPU: its wait is not in schedstat yet, but its state says so.
        let waiting_now = ThreadSample {
            state: 'R',
            ..at(1010, 1010)
        };
        assert_eq!(cause(waiting_now), StallCause::Starved);
        let t = at(1100, 1200).since(&before, over);
        assert_eq!(
            (t.on_cpu, t.waiting, t.off_cpu),
            (
                Duration::from_millis(100),
                Duration::from_millis(200),
                Duration::from_millis(300)
            )
        );
        // Counters that went backwards (a reused thread id) count as nothing, not a panic.
        assert_eq!(at(0, 0).since(&before, over).off_cpu, over);
    }

    #[test]
    fn this_threads_sample_is_readable() {
        let tid = current_tid().expect("a thread id");
        let s = ThreadSample::read(tid).expect("a sample of this thread");
        assert_eq!(
            s.state, 'R',
            "this thread runs while it reads its own sample"
        );
    }
}
