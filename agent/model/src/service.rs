//! Services as sources describe them ([`ServiceInput`]) and as the agent keeps them once
//! validated ([`ServiceConfig`]).

use std::{collections::BTreeMap, fmt, net::IpAddr};

use crate::{ConfigError, ConfigErrors, Mode, Tuning, annotations};

/// Identifies a Service (and everything derived from it) across sources.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    pub namespace: String,
    pub name: String,
}

impl ServiceKey {
    #[must_use]
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A Service as a source (Kubernetes or the local file) sees it, before validation. Only the
/// fields skewless reads; sources convert into this and drop the rest immediately.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceInput {
    pub key: ServiceKey,
    pub annotations: BTreeMap<String, String>,
    /// `spec.clusterIPs` (or `[spec.clusterIP]`), as written: `"None"` marks a headless Service.
    pub cluster_ips: Vec<String>,
    pub ports: Vec<PortInput>,
}

/// One `spec.ports[]` entry, unvalidated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PortInput {
    /// Empty for the single unnamed port a Service may have.
    pub name: String,
    pub port: i32,
    /// `TCP`, `UDP`, `SCTP`; empty means `TCP` (the API default).
    pub protocol: String,
    /// `None` means "same as `port`" (the API default).
    pub target_port: Option<TargetPort>,
}

/// `spec.ports[].targetPort`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TargetPort {
    Number(u16),
    /// A container port name; resolved per endpoint through the EndpointSlice port that carries
    /// the Service port's name (pods may use different numbers for the same name).
    Name(String),
}

/// A validated Service port.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServicePort {
    pub name: String,
    pub port: u16,
    pub target_port: TargetPort,
}

/// A validated, opted-in Service's config: what the index keeps as "last good".
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceConfig {
    pub mode: Mode,
    pub tuning: Tuning,
    /// All ClusterIPs, IPv4 and IPv6 for dual-stack Services, in `spec.clusterIPs` order.
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
}

impl ServiceInput {
    /// Validates the Service. `Ok(None)`: it has not opted in (no `skewless.io/mode`).
    ///
    /// # Errors
    /// Every problem found: the annotations first, then the spec (headless, non-TCP ports...).
    pub fn config(&self) -> Result<Option<ServiceConfig>, ConfigErrors> {
        let mode = match annotations::mode(&self.annotations) {
            Ok(None) => return Ok(None),
            Ok(Some(mode)) => Ok(mode),
            Err(error) => Err(error),
        };
        let mut errors = Vec::new();
        let tuning = annotations::tuning_into(&self.annotations, &mut errors);
        let cluster_ips = self.cluster_ips(&mut errors);
        let ports = self.ports(&mut errors);
        match mode {
            Err(first) => Err(ConfigErrors::new(first, errors)),
            Ok(mode) => match ConfigErrors::from_vec(errors) {
                Some(errors) => Err(errors),
                None => Ok(Some(ServiceConfig {
                    mode,
                    tuning,
                    cluster_ips,
                    ports,
                })),
            },
        }
    }

    /// The ClusterIPs; problems go to `errors`.
    fn cluster_ips(&self, errors: &mut Vec<ConfigError>) -> Vec<IpAddr> {
        let before = errors.len();
        let mut cluster_ips = Vec::with_capacity(self.cluster_ips.len());
        for ip in &self.cluster_ips {
            match ip.as_str() {
                "None" => {
                    errors.push(ConfigError::Headless);
                    return Vec::new();
                }
                "" => {}
                _ => match ip.parse() {
                    Ok(addr) => cluster_ips.push(addr),
                    Err(_) => errors.push(ConfigError::InvalidClusterIp { value: ip.clone() }),
                },
            }
        }
        if cluster_ips.is_empty() && errors.len() == before {
            errors.push(ConfigError::NoClusterIp);
        }
        cluster_ips
    }

    /// The ports; problems go to `errors`.
    fn ports(&self, errors: &mut Vec<ConfigError>) -> Vec<ServicePort> {
        if self.ports.is_empty() {
            errors.push(ConfigError::NoPorts);
        }
        let mut ports = Vec::with_capacity(self.ports.len());
        for p in &self.ports {
            if !(p.protocol.is_empty() || p.protocol == "TCP") {
                errors.push(ConfigError::UnsupportedProtocol {
                    port: p.port,
                    protocol: p.protocol.clone(),
                });
                continue;
            }
            let port = match valid_port(p.port) {
                Ok(port) => port,
                Err(error) => {
                    errors.push(error);
                    continue;
                }
            };
            let target_port = match &p.target_port {
                None => TargetPort::Number(port),
                Some(TargetPort::Number(0)) => {
                    errors.push(ConfigError::InvalidPort { port: 0 });
                    continue;
                }
                Some(t) => t.clone(),
            };
            ports.push(ServicePort {
                name: p.name.clone(),
                port,
                target_port,
            });
        }
        ports
    }
}

pub(crate) fn valid_port(port: i32) -> Result<u16, ConfigError> {
    match u16::try_from(port) {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(ConfigError::InvalidPort { port }),
    }
}
