//! The agent process's own figures, with the names and meanings of Prometheus' process
//! collector ([`crate::names::PROCESS`]), parsed from the text of Linux's `/proc` files (the
//! binary reads them; this module only parses, so tests feed it any text).
//!
//! Times in `/proc/<pid>/stat` are in clock ticks: `USER_HZ`, 100 on every Linux architecture
//! Prometheus supports (its procfs library assumes the same), so no `sysconf` call is needed.

/// Clock ticks per second of `/proc/<pid>/stat`'s times (`USER_HZ`).
const USER_HZ: f64 = 100.0;

/// One reading of the process (see [`crate::names`]'s `PROCESS_*` families).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Process {
    /// User and system CPU time so far.
    pub cpu_seconds: f64,
    pub open_fds: u64,
    /// The soft limit on open files (`u64::MAX` when unlimited).
    pub max_fds: u64,
    pub virtual_memory_bytes: u64,
    /// The soft limit on the address space (`u64::MAX` when unlimited).
    pub virtual_memory_max_bytes: u64,
    pub resident_memory_bytes: u64,
    /// Seconds since the Unix epoch.
    pub start_time_seconds: f64,
    pub threads: u64,
}

/// What is wrong with a `/proc` text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProcError {
    #[error("{file}: no {field} in it")]
    Missing {
        file: &'static str,
        field: &'static str,
    },
}

/// The `/proc` texts one reading is made of.
#[derive(Clone, Copy, Debug)]
pub struct ProcTexts<'a> {
    /// `/proc/self/stat`.
    pub stat: &'a str,
    /// `/proc/self/status`.
    pub status: &'a str,
    /// `/proc/self/limits`.
    pub limits: &'a str,
    /// `/proc/stat` (its `btime` line: the boot time).
    pub system_stat: &'a str,
    /// Entries of `/proc/self/fd`.
    pub open_fds: u64,
}

impl Process {
    /// Parses one reading.
    ///
    /// # Errors
    /// When a file lacks a field (a kernel that writes them differently).
    pub fn parse(texts: &ProcTexts<'_>) -> Result<Self, ProcError> {
        let missing = |file, field| ProcError::Missing { file, field };
        // The command name in parentheses may hold spaces and parentheses: fields count from
        // the last `)`. After it: state (3), ..., utime (14), stime (15), ..., starttime (22).
        let after = &texts.stat[texts
            .stat
            .rfind(')')
            .ok_or(missing("stat", "command name"))?
            + 1..];
        let fields: Vec<&str> = after.split_ascii_whitespace().collect();
        let field = |n: usize, name| -> Result<f64, ProcError> {
            fields
                .get(n - 3)
                .and_then(|f| f.parse::<f64>().ok())
                .ok_or(missing("stat", name))
        };
        let ticks = field(14, "utime")? + field(15, "stime")?;
        let started = field(22, "starttime")?;
        let boot = texts
            .system_stat
            .lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .ok_or(missing("/proc/stat", "btime"))?;
        let status = |key: &'static str| -> Result<u64, ProcError> {
            texts
                .status
                .lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
                .and_then(|v| v.split_ascii_whitespace().next()?.parse().ok())
                .ok_or(missing("status", key))
        };
        let limit = |name: &'static str| -> Result<u64, ProcError> {
            let line = texts
                .limits
                .lines()
                .find(|l| l.starts_with(name))
                .ok_or(missing("limits", name))?;
            match line[name.len()..].split_ascii_whitespace().next() {
                Some("unlimited") => Ok(u64::MAX),
                Some(v) => v.parse().map_err(|_| missing("limits", name)),
                None => Err(missing("limits", name)),
            }
        };
        Ok(Self {
            cpu_seconds: ticks / USER_HZ,
            open_fds: texts.open_fds,
            max_fds: limit("Max open files")?,
            // status gives sizes in kB (KiB).
            virtual_memory_bytes: status("VmSize")? * 1024,
            virtual_memory_max_bytes: limit("Max address space")?,
            resident_memory_bytes: status("VmRSS")? * 1024,
            start_time_seconds: boot + started / USER_HZ,
            threads: status("Threads")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "4242 (skewless (a) b) S 1 4242 4242 0 -1 4194560 2171 0 0 0 \
                        250 75 0 0 20 0 9 0 123456 1048576000 5000 18446744073709551615";
    const STATUS: &str = "Name:\tskewless\nState:\tS (sleeping)\nVmPeak:\t  1100000 kB\n\
                          VmSize:\t  1024000 kB\nVmRSS:\t    20480 kB\nThreads:\t9\n";
    const LIMITS: &str = "Limit                     Soft Limit           Hard Limit           Units     \n\
                          Max cpu time              unlimited            unlimited            seconds   \n\
                          Max address space         unlimited            unlimited            bytes     \n\
                          Max open files            1024                 524288               files     \n";
    const SYSTEM: &str = "cpu  1 2 3\nbtime 1764700000\nprocesses 42\n";

    fn texts() -> ProcTexts<'static> {
        ProcTexts {
            stat: STAT,
            status: STATUS,
            limits: LIMITS,
            system_stat: SYSTEM,
            open_fds: 17,
        }
    }

    #[test]
    fn a_reading_has_the_process_collectors_units() {
        let p = Process::parse(&texts()).unwrap();
        assert_eq!(
            p,
            Process {
                cpu_seconds: 3.25,
                open_fds: 17,
                max_fds: 1024,
                virtual_memory_bytes: 1_024_000 * 1024,
                virtual_memory_max_bytes: u64::MAX,
                resident_memory_bytes: 20_480 * 1024,
                start_time_seconds: 1_764_700_000.0 + 1234.56,
                threads: 9,
            }
        );
    }

    #[test]
    fn a_text_without_a_field_is_an_error_naming_it() {
        let mut t = texts();
        t.status = "Name:\tskewless\nVmSize:\t1 kB\nThreads:\t1\n";
        assert_eq!(
            Process::parse(&t),
            Err(ProcError::Missing {
                file: "status",
                field: "VmRSS"
            })
        );
        let mut t = texts();
        t.stat = "4242 (x) S 1 2";
        assert!(matches!(
            Process::parse(&t),
            Err(ProcError::Missing { field: "utime", .. })
        ));
        let mut t = texts();
        t.system_stat = "cpu 1\n";
        assert!(Process::parse(&t).is_err(), "no boot time");
    }

    #[test]
    fn this_process_parses() {
        let read = |p| std::fs::read_to_string(p).unwrap();
        let (stat, status, limits, system) = (
            read("/proc/self/stat"),
            read("/proc/self/status"),
            read("/proc/self/limits"),
            read("/proc/stat"),
        );
        let fds = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        let p = Process::parse(&ProcTexts {
            stat: &stat,
            status: &status,
            limits: &limits,
            system_stat: &system,
            open_fds: fds,
        })
        .unwrap();
        assert!(p.resident_memory_bytes > 0 && p.threads >= 1, "{p:?}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            p.start_time_seconds <= now + 1.0 && p.start_time_seconds > now - 3600.0,
            "started within the hour: {p:?}"
        );
    }
}
