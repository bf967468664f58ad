//! Tearing down: on drop (also while unwinding from a panic), on Ctrl-C/SIGTERM for every
//! live testbed of the process, and [`clean_stale`] for what a killed run left behind. Only
//! names that start with [`PREFIX`] are ever touched.

use std::{
    fs,
    io::{self, Write as _},
    path::Path,
    process::Command,
    sync::{Mutex, Once},
    time::Duration,
};

use tracing::{debug, warn};

use crate::{CGROUP2_ROOT, PREFIX, Testbed, process::ip};

impl Testbed {
    fn teardown(&mut self) {
        for mut child in self.children.drain(..) {
            let _ = child.kill();
            let _ = child.wait();
        }
        teardown_named(&self.id);
        self.fabric = None;
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        self.teardown();
        unregister(&self.id);
    }
}

/// Removes every namespace, cgroup and process left by this testbed id.
pub(crate) fn teardown_named(id: &str) {
    let prefix = format!("{PREFIX}{id}");
    let cg_root = Path::new(CGROUP2_ROOT).join(&prefix);
    // Processes first: anything still in one of our cgroups or namespaces was started by us.
    kill_cgroup_tree(&cg_root);
    for ns in list_netns().into_iter().filter(|n| n.starts_with(&prefix)) {
        kill_netns_pids(&ns);
        if let Err(e) = ip(&["netns", "del", &ns]) {
            warn!(netns = %ns, error = %e, "removing network namespace");
        }
    }
    remove_cgroup_tree(&cg_root);
    let _ = fs::remove_file(Path::new(OWNERS_DIR).join(id));
}

/// Removes what crashed runs left behind: every `sktb-*` network namespace and cgroup, and the
/// processes inside them, except those of testbeds that are still up: this process's, and
/// those whose owner (recorded under `/run/skewless-testbed`) is still running, so a cleanup in one
/// test run never tears down another run's testbeds. Returns how many namespaces and cgroups
/// were removed.
#[must_use]
pub fn clean_stale() -> (usize, usize) {
    let live: Vec<String> = LIVE.lock().map(|l| l.clone()).unwrap_or_default();
    let is_live = |name: &str| {
        let Some(id) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.get(..ID_LEN))
        else {
            return false;
        };
        live.iter().any(|l| l == id) || owner_running(Path::new(OWNERS_DIR), id)
    };
    let mut netns = 0;
    for ns in list_netns()
        .into_iter()
        .filter(|n| n.starts_with(PREFIX) && !is_live(n))
    {
        kill_netns_pids(&ns);
        if ip(&["netns", "del", &ns]).is_ok() {
            netns += 1;
        }
    }
    let mut cgroups = 0;
    if let Ok(entries) = fs::read_dir(CGROUP2_ROOT) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(PREFIX) && !is_live(&name) && e.path().is_dir() {
                kill_cgroup_tree(&e.path());
                remove_cgroup_tree(&e.path());
                cgroups += 1;
            }
        }
    }
    // Owner records of testbeds whose owner is gone (their namespaces and cgroups went above).
    if let Ok(entries) = fs::read_dir(OWNERS_DIR) {
        for e in entries.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            if !is_live(&format!("{PREFIX}{id}")) {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    (netns, cgroups)
}

fn kill_netns_pids(ns: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
}

fn kill_cgroup_tree(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.path().is_dir() {
            kill_cgroup_tree(&e.path());
        }
    }
    if let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) {
        for pid in procs.split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
}

fn remove_cgroup_tree(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.path().is_dir() {
            remove_cgroup_tree(&e.path());
        }
    }
    // A cgroup can only be removed once its processes have exited; give SIGKILLed ones a
    // moment to be reaped.
    for _ in 0..50 {
        match fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    warn!(cgroup = %dir.display(), "cgroup still busy; `cargo xtask testbed clean` removes it later");
}

fn list_netns() -> Vec<String> {
    fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

static LIVE: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Where each live testbed's id names the process that owns it (a file per id holding the
/// owner's PID): what lets [`clean_stale`] in one process leave another's testbeds alone.
const OWNERS_DIR: &str = "/run/skewless-testbed";

/// The length of a testbed id (see `builder::unique_id`).
const ID_LEN: usize = 6;

pub(crate) fn register(tb: &Testbed) {
    if let Ok(mut l) = LIVE.lock() {
        l.push(tb.id.clone());
    }
    let written = fs::create_dir_all(OWNERS_DIR).and_then(|()| {
        fs::write(
            Path::new(OWNERS_DIR).join(&tb.id),
            std::process::id().to_string(),
        )
    });
    if let Err(e) = written {
        warn!(id = %tb.id, error = %e, "recording the testbed's owner; another run's cleanup may remove it");
    }
}

fn unregister(id: &str) {
    if let Ok(mut l) = LIVE.lock() {
        l.retain(|i| i != id);
    }
    let _ = fs::remove_file(Path::new(OWNERS_DIR).join(id));
}

/// Whether the process recorded in `owners` as the owner of testbed `id` is still running
/// (and is not this process, whose own testbeds [`LIVE`] knows).
fn owner_running(owners: &Path, id: &str) -> bool {
    let Ok(pid) = fs::read_to_string(owners.join(id)) else {
        return false;
    };
    let pid = pid.trim();
    pid != std::process::id().to_string()
        && !pid.is_empty()
        && Path::new("/proc").join(pid).exists()
}

/// On Ctrl-C (or SIGTERM), removes every live testbed of this process before exiting, since
/// destructors do not run when a signal ends the process.
pub(crate) fn install_interrupt_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let result = ctrlc::set_handler(|| {
            let ids: Vec<String> = LIVE.lock().map(|l| l.clone()).unwrap_or_default();
            for id in &ids {
                teardown_named(id);
            }
            let _ = writeln!(
                io::stderr(),
                "interrupted: removed {} testbed(s)",
                ids.len()
            );
            std::process::exit(130);
        });
        if let Err(e) = result {
            // The host program installed its own handler; it must call `clean_stale`.
            debug!(error = %e, "interrupt handler not installed");
        }
    });
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::owner_running;

    #[test]
    fn a_testbed_is_another_runs_only_while_its_owner_runs() {
        let owners = tempfile::tempdir().expect("temp dir");
        // PID 1 always runs; a child that was waited for no longer does.
        fs::write(owners.path().join("aaaaaa"), "1").unwrap();
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let gone = child.id();
        child.wait().unwrap();
        fs::write(owners.path().join("bbbbbb"), gone.to_string()).unwrap();
        fs::write(owners.path().join("cccccc"), std::process::id().to_string()).unwrap();
        assert!(
            owner_running(owners.path(), "aaaaaa"),
            "a running owner keeps its testbed"
        );
        assert!(
            !owner_running(owners.path(), "bbbbbb"),
            "an owner that exited leaves its testbed stale"
        );
        assert!(
            !owner_running(owners.path(), "cccccc"),
            "this process's own testbeds are judged by its live list, not the record"
        );
        assert!(
            !owner_running(owners.path(), "dddddd"),
            "a testbed without a record is stale"
        );
    }
}
