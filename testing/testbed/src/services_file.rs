//! The agent's services file (`skewless --services-file`): what the privileged agent tests
//! and the benches hand the agent instead of a Kubernetes API server. One entry per Service
//! over testbed pods, in the YAML `skewless-services-file` reads.

use std::fmt::Write as _;

use crate::{Result, Testbed};

/// One Service of a services file, listed under `services:` (see [`Testbed::services_entry`]).
#[derive(Debug, Clone, Copy)]
pub struct FileService<'a> {
    pub name: &'a str,
    /// Its ClusterIPs (a dual-stack Service lists both families).
    pub cluster_ips: &'a [String],
    /// The Service port, also the pods' target port.
    pub port: u16,
    /// `skewless.io/mode`: `request`, `connection` or `observe`.
    pub mode: &'a str,
    /// The testbed pods that are its endpoints.
    pub pods: &'a [&'a str],
    /// Also lists every pod with its IPv6 address (a dual-stack Service's IPv6 EndpointSlice).
    pub ipv6_endpoints: bool,
}

impl Testbed {
    /// `service`'s entry of a services file, to follow a `services:\n` line.
    ///
    /// # Errors
    /// If one of its pods is not in the testbed.
    pub fn services_entry(&self, service: &FileService<'_>) -> Result<String> {
        let FileService {
            name,
            cluster_ips,
            port,
            mode,
            pods,
            ipv6_endpoints,
        } = *service;
        let ips: Vec<String> = cluster_ips.iter().map(|ip| format!("\"{ip}\"")).collect();
        let mut yaml = format!(
            "  - name: {name}\n    clusterIPs: [{}]\n    mode: {mode}\n    ports:\n      - port: {port}\n        targetPort: {port}\n    endpoints:\n",
            ips.join(", ")
        );
        for p in pods {
            let pod = self.pod(p)?;
            let _ = writeln!(yaml, "      - {{address: {}, target: {p}}}", pod.ip);
            if ipv6_endpoints {
                let _ = writeln!(yaml, "      - {{address: \"{}\", target: {p}}}", pod.ip6);
            }
        }
        Ok(yaml)
    }
}
