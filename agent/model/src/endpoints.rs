//! EndpointSlices as sources describe them ([`SliceInput`]), the compact form the index keeps
//! ([`SliceData`]), and the merge of many slices into one endpoint list per Service port.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use crate::service::{ServiceKey, ServicePort, valid_port};

/// Identifies an EndpointSlice.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SliceKey {
    pub namespace: String,
    pub name: String,
}

/// An EndpointSlice, unvalidated; only the fields skewless reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SliceInput {
    pub key: SliceKey,
    /// The owning Service's name (label `kubernetes.io/service-name`); `None` for slices that
    /// belong to no Service, which are ignored.
    pub service_name: Option<String>,
    pub ports: Vec<SlicePortInput>,
    pub endpoints: Vec<EndpointInput>,
}

impl SliceInput {
    /// The Service this slice belongs to, if any.
    #[must_use]
    pub fn owner(&self) -> Option<ServiceKey> {
        let name = self.service_name.as_ref()?;
        Some(ServiceKey::new(self.key.namespace.clone(), name.clone()))
    }
}

/// One `ports[]` entry of a slice. Its `name` is the Service port's name; its `port` is the
/// target port number resolved for the endpoints of this slice.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlicePortInput {
    pub name: String,
    /// `None` means "all ports" (selector-less slices); such ports cannot be dialled and are
    /// skipped.
    pub port: Option<i32>,
    /// Empty means `TCP`.
    pub protocol: String,
}

/// One `endpoints[]` entry of a slice.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointInput {
    /// IP addresses as strings; FQDN slices' names do not parse and are skipped.
    pub addresses: Vec<String>,
    /// `targetRef.name`, usually the pod.
    pub target_name: Option<String>,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
}

/// Endpoint conditions, with the API's defaults for absent values applied: unknown `ready` is
/// ready, unknown `serving` equals `ready`, unknown `terminating` is not terminating.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conditions {
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

impl Conditions {
    #[must_use]
    pub fn from_api(ready: Option<bool>, serving: Option<bool>, terminating: Option<bool>) -> Self {
        let ready = ready.unwrap_or(true);
        Self {
            ready,
            serving: serving.unwrap_or(ready),
            terminating: terminating.unwrap_or(false),
        }
    }
}

/// One backend of a Service port, merged from all the Service's slices.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub addr: SocketAddr,
    pub target_name: Option<String>,
    pub conditions: Conditions,
}

/// The part of a slice the index keeps: TCP ports with a number, IP endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SliceData {
    ports: Vec<(String, u16)>,
    endpoints: Vec<SliceEndpoint>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct SliceEndpoint {
    addrs: Vec<IpAddr>,
    target_name: Option<String>,
    conditions: Conditions,
}

impl SliceData {
    pub(crate) fn from_input(input: &SliceInput) -> Self {
        let ports = input
            .ports
            .iter()
            .filter(|p| p.protocol.is_empty() || p.protocol == "TCP")
            .filter_map(|p| Some((p.name.clone(), valid_port(p.port?).ok()?)))
            .collect();
        let endpoints = input
            .endpoints
            .iter()
            .map(|e| SliceEndpoint {
                addrs: e.addresses.iter().filter_map(|a| a.parse().ok()).collect(),
                target_name: e.target_name.clone(),
                conditions: Conditions::from_api(e.ready, e.serving, e.terminating),
            })
            .filter(|e| !e.addrs.is_empty())
            .collect();
        Self { ports, endpoints }
    }
}

/// Merges the slices of one Service into the endpoint list of one of its ports, sorted by
/// address. An endpoint present in several slices (slices are updated one at a time, so an
/// endpoint may briefly be in two) is kept once, with the most available conditions.
pub(crate) fn merge<'a>(
    port: &ServicePort,
    slices: impl IntoIterator<Item = &'a SliceData>,
) -> Vec<Endpoint> {
    let mut by_addr: BTreeMap<SocketAddr, Endpoint> = BTreeMap::new();
    for slice in slices {
        // The slice port carrying the Service port's name holds the resolved target port for
        // this slice's endpoints, whether targetPort is a number or a container port name.
        let Some(&(_, number)) = slice.ports.iter().find(|(name, _)| *name == port.name) else {
            continue;
        };
        for e in &slice.endpoints {
            for ip in &e.addrs {
                let addr = SocketAddr::new(*ip, number);
                by_addr
                    .entry(addr)
                    .and_modify(|old| {
                        old.conditions.ready |= e.conditions.ready;
                        old.conditions.serving |= e.conditions.serving;
                        old.conditions.terminating &= e.conditions.terminating;
                        if old.target_name.is_none() {
                            old.target_name.clone_from(&e.target_name);
                        }
                    })
                    .or_insert_with(|| Endpoint {
                        addr,
                        target_name: e.target_name.clone(),
                        conditions: e.conditions,
                    });
            }
        }
    }
    by_addr.into_values().collect()
}
