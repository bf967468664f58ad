//! The Service VIPs: kube-proxy-style nftables DNAT (`numgen random`, one choice per
//! connection) in every node namespace, rewritten in one transaction on every change.

use std::{
    fmt::Write as _,
    io::Write as _,
    process::{Command, Stdio},
};

use crate::{Error, Result, Testbed};

const NFT_TABLE: &str = "skewless_testbed";
/// `ip6` family table of the IPv6 DNAT (a separate family, same name).
const NFT_TABLE6: &str = "skewless_testbed";

impl Testbed {
    /// Writes the kube-proxy-style DNAT for every Service into every node, replacing the
    /// previous rules in one nft transaction.
    pub(crate) fn write_nat_rules(&self) -> Result<()> {
        let (mut rules, mut rules6) = (String::new(), String::new());
        for svc in self.services.values() {
            if svc.backends.is_empty() {
                // kube-proxy rejects connections to a Service without endpoints.
                let _ = writeln!(
                    rules,
                    "ip daddr {} tcp dport {} reject with tcp reset",
                    svc.vip, svc.port
                );
                let _ = writeln!(
                    rules6,
                    "ip6 daddr {} tcp dport {} reject with tcp reset",
                    svc.vip6(),
                    svc.port
                );
                continue;
            }
            let (mut map, mut map6) = (String::new(), String::new());
            for (i, b) in svc.backends.iter().enumerate() {
                let pod = self.pod(b)?;
                let sep = if i > 0 { ", " } else { "" };
                let _ = write!(map, "{sep}{i} : {} . {}", pod.ip, svc.target_port);
                let _ = write!(map6, "{sep}{i} : {} . {}", pod.ip6, svc.target_port);
            }
            let n = svc.backends.len();
            let _ = writeln!(
                rules,
                "ip daddr {} tcp dport {} dnat ip to numgen random mod {n} map {{ {map} }}",
                svc.vip, svc.port,
            );
            let _ = writeln!(
                rules6,
                "ip6 daddr {} tcp dport {} dnat ip6 to numgen random mod {n} map {{ {map6} }}",
                svc.vip6(),
                svc.port,
            );
        }
        let script = format!(
            "table ip {NFT_TABLE}\ndelete table ip {NFT_TABLE}\ntable ip {NFT_TABLE} {{\n\
             chain prerouting {{ type nat hook prerouting priority dstnat; policy accept;\n{rules}}}\n\
             chain output {{ type nat hook output priority -100; policy accept;\n{rules}}}\n}}\n\
             table ip6 {NFT_TABLE6}\ndelete table ip6 {NFT_TABLE6}\ntable ip6 {NFT_TABLE6} {{\n\
             chain prerouting {{ type nat hook prerouting priority dstnat; policy accept;\n{rules6}}}\n\
             chain output {{ type nat hook output priority -100; policy accept;\n{rules6}}}\n}}\n"
        );
        for node in &self.nodes {
            nft(&node.netns, &script)?;
        }
        Ok(())
    }
}

fn nft(netns: &str, script: &str) -> Result<()> {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/run/netns/{netns}"))
        .args(["nft", "-f", "-"]);
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| Error::Spawn {
            cmd: "nft -f -".into(),
            source,
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|source| Error::Spawn {
                cmd: "nft -f -".into(),
                source,
            })?;
    }
    let out = child.wait_with_output().map_err(|source| Error::Spawn {
        cmd: "nft -f -".into(),
        source,
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Command {
            cmd: format!("nft -f - <<EOF\n{script}EOF"),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}
