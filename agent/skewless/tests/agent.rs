//! Privileged: runs the real `skewless agent` binary in a testbed node. Run with
//! `cargo xtask test` (as root).

use std::{net::SocketAddrV4, time::Duration};

use skewless_testbed::{Place, fixtures::IdentBed};

const ADMIN: &str = "127.0.0.1:9990";

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn agent_redirects_reports_status_and_fails_open_when_killed() {
    let mut bed = IdentBed::new().expect("testbed builds (needs root)");
    let vip = IdentBed::vip();
    let cgroup = bed.tb.pod("client").unwrap().cgroup.display().to_string();
    let redirect = format!("{vip}={}", IdentBed::balancer());
    let agent = bed
        .tb
        .spawn(
            Place::Node(0),
            &[
                env!("CARGO_BIN_EXE_skewless"),
                "agent",
                "--cgroup",
                &cgroup,
                "--redirect",
                &redirect,
                "--admin-addr",
                ADMIN,
            ],
        )
        .unwrap();
    bed.tb
        .wait_for_tcp(
            Place::Node(0),
            ADMIN.parse::<SocketAddrV4>().unwrap(),
            Duration::from_secs(10),
        )
        .expect("agent serves its admin API");

    let redirected = bed.probe("client", vip, 100).unwrap();
    assert!(
        redirected.only("balancer"),
        "the agent must redirect the listed Service: {redirected:?}"
    );

    let status = bed
        .tb
        .run(
            Place::Node(0),
            &[
                env!("CARGO_BIN_EXE_skewless"),
                "status",
                "--admin-addr",
                ADMIN,
            ],
        )
        .expect("skewless status runs");
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains(&vip.to_string()),
        "status must list the redirected Service: {status}"
    );
    assert!(
        status.contains("100 redirected"),
        "status must count redirected connects: {status}"
    );

    // SIGKILL: no cleanup code runs, yet the kernel closes the bpf_links with the process.
    // `kill` returns once the process is reaped; the probe's first connect follows at once.
    bed.tb.kill(agent);
    let after = bed.probe("client", vip, 50).unwrap();
    assert!(
        after.all_servers(),
        "after SIGKILL every connect must go direct: {after:?}"
    );
}

#[test]
fn agent_refuses_the_cgroup_root() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_skewless"))
        .args([
            "agent",
            "--cgroup",
            "/sys/fs/cgroup/unified",
            "--admin-addr",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "attaching to the hierarchy root must be refused"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("refusing to attach"),
        "the error must say why: {stderr}"
    );
}
