//! Kubernetes objects -> model inputs. Everything skewless does not read is dropped here.

use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use skewless_model::{
    EndpointInput, NodeInfo, PortInput, ServiceInput, ServiceKey, SliceInput, SliceKey,
    SlicePortInput, TargetPort,
};

/// The label the EndpointSlice controller puts on every slice it manages for a Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// The model's view of a Service.
#[must_use]
pub fn service_input(svc: &Service) -> ServiceInput {
    let meta = &svc.metadata;
    let key = ServiceKey::new(
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    );
    let annotations = meta.annotations.clone().unwrap_or_default();
    let Some(spec) = &svc.spec else {
        return ServiceInput {
            key,
            annotations,
            ..ServiceInput::default()
        };
    };
    let cluster_ips = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.clone(),
        (_, Some(ip)) => vec![ip.clone()],
        _ => Vec::new(),
    };
    let ports = spec
        .ports
        .iter()
        .flatten()
        .map(|p| PortInput {
            name: p.name.clone().unwrap_or_default(),
            port: p.port,
            protocol: p.protocol.clone().unwrap_or_default(),
            target_port: p.target_port.as_ref().map(|t| match t {
                // An out-of-range number becomes 0, which validation rejects.
                IntOrString::Int(n) => TargetPort::Number(u16::try_from(*n).unwrap_or(0)),
                IntOrString::String(name) => TargetPort::Name(name.clone()),
            }),
        })
        .collect();
    ServiceInput {
        key,
        annotations,
        cluster_ips,
        ports,
    }
}

/// The model's view of an EndpointSlice.
#[must_use]
pub fn slice_input(slice: &EndpointSlice) -> SliceInput {
    let meta = &slice.metadata;
    SliceInput {
        key: SliceKey {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
        },
        service_name: meta
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME_LABEL))
            .cloned(),
        ports: slice
            .ports
            .iter()
            .flatten()
            .map(|p| SlicePortInput {
                name: p.name.clone().unwrap_or_default(),
                port: p.port,
                protocol: p.protocol.clone().unwrap_or_default(),
            })
            .collect(),
        endpoints: slice
            .endpoints
            .iter()
            .map(|e| {
                let c = e.conditions.as_ref();
                EndpointInput {
                    addresses: e.addresses.clone(),
                    target_name: e.target_ref.as_ref().and_then(|t| t.name.clone()),
                    ready: c.and_then(|c| c.ready),
                    serving: c.and_then(|c| c.serving),
                    terminating: c.and_then(|c| c.terminating),
                }
            })
            .collect(),
    }
}

/// What the agent keeps about its own Node.
#[must_use]
pub fn node_info(node: &Node) -> NodeInfo {
    NodeInfo {
        name: node.metadata.name.clone().unwrap_or_default(),
        zone: node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(ZONE_LABEL))
            .cloned(),
        pod_cidrs: node
            .spec
            .as_ref()
            .and_then(|s| {
                s.pod_cidrs
                    .clone()
                    .or_else(|| s.pod_cidr.clone().map(|c| vec![c]))
            })
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::core::v1::{ServicePort, ServiceSpec},
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };
    use skewless_model::ConfigError;

    use super::*;

    fn mk_service(spec: ServiceSpec) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("ns".into()),
                annotations: Some([("skewless.io/mode".to_owned(), "request".to_owned())].into()),
                ..ObjectMeta::default()
            },
            spec: Some(spec),
            ..Service::default()
        }
    }

    fn mk_port(target: Option<IntOrString>) -> ServicePort {
        ServicePort {
            port: 80,
            target_port: target,
            ..ServicePort::default()
        }
    }

    #[test]
    fn dual_stack_cluster_ips_win_over_the_legacy_field() {
        let input = service_input(&mk_service(ServiceSpec {
            cluster_ip: Some("10.96.0.10".into()),
            cluster_ips: Some(vec!["10.96.0.10".into(), "fd00::10".into()]),
            ports: Some(vec![mk_port(None)]),
            ..ServiceSpec::default()
        }));
        let config = input.config().expect("valid").expect("opted in");
        assert_eq!(config.cluster_ips.len(), 2);
        assert_eq!(config.ports[0].target_port, TargetPort::Number(80));
    }

    #[test]
    fn external_name_service_has_no_cluster_ip() {
        let input = service_input(&mk_service(ServiceSpec {
            type_: Some("ExternalName".into()),
            external_name: Some("example.com".into()),
            ports: Some(vec![mk_port(None)]),
            ..ServiceSpec::default()
        }));
        assert_eq!(input.config(), Err(ConfigError::NoClusterIp.into()));
    }

    #[test]
    fn out_of_range_numeric_target_port_is_rejected() {
        let input = service_input(&mk_service(ServiceSpec {
            cluster_ip: Some("10.96.0.10".into()),
            ports: Some(vec![mk_port(Some(IntOrString::Int(70_000)))]),
            ..ServiceSpec::default()
        }));
        let error = input.config().expect_err("port out of range");
        assert!(matches!(
            error.as_slice(),
            [ConfigError::InvalidPort { .. }]
        ));
    }

    #[test]
    fn slice_without_service_label_belongs_to_no_service() {
        let input = slice_input(&EndpointSlice::default());
        assert_eq!(input.service_name, None);
    }
}
