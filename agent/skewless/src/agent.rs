//! `skewless agent`.
//!
//! Today the agent takes its redirects and pod cgroups from flags; the Kubernetes and
//! local-file sources (issue 5) will feed the same datapath calls.

use std::{
    net::SocketAddr,
    net::SocketAddrV4,
    path::PathBuf,
    str::FromStr,
    sync::{Arc, Mutex},
};

use anyhow::{Context as _, Result};
use skewless_datapath::Datapath;
use tokio::signal::unix::{SignalKind, signal};
use tracing::info;

use crate::admin;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Pod cgroup (cgroup v2 directory) to attach the socket hooks to. Repeatable. Never the
    /// root of the hierarchy: that would redirect every process on the machine.
    #[arg(long = "cgroup", value_name = "DIR")]
    cgroups: Vec<PathBuf>,
    /// Redirect connect()s to a Service address to a balancer listener:
    /// `VIP:PORT=LISTENER_IP:PORT`. Repeatable.
    #[arg(long = "redirect", value_name = "VIP:PORT=ADDR:PORT")]
    redirects: Vec<Redirect>,
    /// Address of the admin API (/live, /ready, /status).
    #[arg(long, default_value = "127.0.0.1:9990", env = "SKEWLESS_ADMIN_ADDR")]
    admin_addr: SocketAddr,
    /// This node's name (from the downward API in the DaemonSet).
    #[arg(long, env = "NODE_NAME", default_value = "local")]
    node_name: String,
}

#[derive(Clone, Copy, Debug)]
pub struct Redirect {
    service: SocketAddrV4,
    target: SocketAddrV4,
}

impl FromStr for Redirect {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (service, target) = s
            .split_once('=')
            .ok_or_else(|| format!("expected VIP:PORT=ADDR:PORT, got {s:?}"))?;
        let parse = |a: &str| {
            a.parse::<SocketAddrV4>()
                .map_err(|e| format!("{a:?} is not an IPv4 address:port ({e})"))
        };
        Ok(Self {
            service: parse(service)?,
            target: parse(target)?,
        })
    }
}

pub async fn run(args: Args) -> Result<()> {
    let Args {
        cgroups,
        redirects,
        admin_addr,
        node_name,
    } = args;
    for cg in &cgroups {
        // A cgroup's parent is itself a cgroup (it has cgroup.procs) unless it is the root of
        // the hierarchy, where a hook would catch every process on the machine.
        let is_child_cgroup = cg.join("cgroup.procs").is_file()
            && cg
                .parent()
                .is_some_and(|p| p.join("cgroup.procs").is_file());
        anyhow::ensure!(
            is_child_cgroup,
            "refusing to attach to {}: not a child cgroup below the cgroup v2 root",
            cg.display()
        );
    }
    let mut datapath = Datapath::load()
        .context("loading the eBPF programs (needs root or CAP_BPF+CAP_NET_ADMIN)")?;
    for Redirect { service, target } in &redirects {
        datapath.set_redirect(*service, *target)?;
    }
    for cg in &cgroups {
        // Attachments stay for the agent's lifetime; they end with the process.
        let _attachment = datapath.attach(cg)?;
    }
    info!(node = %node_name, cgroups = cgroups.len(), redirects = redirects.len(), "agent ready");
    let state = Arc::new(admin::State {
        node: node_name,
        datapath: Mutex::new(datapath),
        ready: true.into(),
    });
    let server = tokio::spawn(admin::serve(admin_addr, Arc::clone(&state)));

    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => info!("interrupted: shutting down"),
        res = server => res.context("admin server task")?.context("admin server")?,
    }
    // Returning drops the datapath, which closes every bpf_link: pods connect directly again.
    // A SIGKILL has the same effect, because the kernel closes the links with the process.
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirect_flag_parses_and_rejects_garbage() {
        let r: Redirect = "198.19.0.10:8080=169.254.77.1:15001".parse().unwrap();
        assert_eq!(r.service, "198.19.0.10:8080".parse().unwrap());
        assert_eq!(r.target, "169.254.77.1:15001".parse().unwrap());
        assert!(
            "198.19.0.10:8080".parse::<Redirect>().is_err(),
            "missing target must fail"
        );
        assert!(
            "a=b".parse::<Redirect>().is_err(),
            "non-addresses must fail"
        );
    }
}
