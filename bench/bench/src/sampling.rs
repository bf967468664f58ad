//! What the benchmark reads of a running proxy from `/proc`: CPU time (utime + stime) and peak
//! resident set, summed over the process and its descendants (HAProxy's and nginx's workers).

use std::process::Command;

/// utime + stime (clock ticks) from the text of `/proc/<pid>/stat`. The command name is in
/// parentheses and may contain spaces, so fields are counted after the last `)`.
#[must_use]
pub fn stat_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ")": state(3) ppid(4) ... utime(14) stime(15): indexes 11 and 12 from field 3.
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Parent pid from the text of `/proc/<pid>/stat`.
#[must_use]
pub fn stat_ppid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Peak resident set (`VmHWM`, KiB) from the text of `/proc/<pid>/status`.
#[must_use]
pub fn status_vm_hwm_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `root` and its descendants, from the parent pids in `/proc`.
#[must_use]
pub fn tree(root: u32) -> Vec<u32> {
    let mut all: Vec<(u32, u32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(ppid) = std::fs::read_to_string(e.path().join("stat"))
                .ok()
                .as_deref()
                .and_then(stat_ppid)
            {
                all.push((pid, ppid));
            }
        }
    }
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        out.extend(all.iter().filter(|(_, pp)| *pp == parent).map(|(p, _)| *p));
        i += 1;
    }
    out
}

/// utime + stime of `pids`, clock ticks (processes that ended count nothing).
#[must_use]
pub fn cpu_ticks(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .filter_map(|s| stat_cpu_ticks(&s))
        .sum()
}

/// Peak resident set of `pids`, summed, KiB.
#[must_use]
pub fn peak_rss_kib(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .filter_map(|s| status_vm_hwm_kib(&s))
        .sum()
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 when that fails).
#[must_use]
pub fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_parsing() {
        let stat =
            "1234 (my (odd) proc) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 1 2 3";
        assert_eq!(stat_cpu_ticks(stat), Some(300));
        assert_eq!(stat_ppid(stat), Some(1));
        let status = "Name:\tx\nVmPeak:\t  1000 kB\nVmHWM:\t    5120 kB\nVmRSS:\t 4000 kB\n";
        assert_eq!(status_vm_hwm_kib(status), Some(5120));
        assert_eq!(status_vm_hwm_kib("Name: x\n"), None);
    }
}
