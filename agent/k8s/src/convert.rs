//! Kubernetes objects -> model inputs. Everything skewless does not read is dropped here, while
//! decoding: [`ServiceObject`] and [`SliceObject`] are the API's Service and EndpointSlice with
//! only the fields the model reads (annotations: only `skewless.io/*`; labels: only
//! `kubernetes.io/service-name`), so a Service or slice skewless does not want costs no
//! allocation beyond its names while its watch event is decoded.

use std::{borrow::Cow, collections::BTreeMap, fmt};

use k8s_openapi::{
    NamespaceResourceScope, api::core::v1::Node, apimachinery::pkg::apis::meta::v1::ObjectMeta,
    apimachinery::pkg::util::intstr::IntOrString,
};
use serde::{
    Deserialize, Deserializer,
    de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor},
};
use skewless_model::{
    EndpointInput, NodeInfo, PortInput, ServiceInput, ServiceKey, SliceInput, SliceKey,
    SlicePortInput, TargetPort,
};

/// The label the EndpointSlice controller puts on every slice it manages for a Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// Annotations the model reads (every other annotation is skipped while decoding).
const ANNOTATION_PREFIX: &str = "skewless.io/";

/// A Service as the agent decodes it: metadata (names, uid, resourceVersion, `skewless.io/*`
/// annotations) and the spec's ClusterIPs and ports.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ServiceObject {
    #[serde(deserialize_with = "slim_meta")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    spec: Option<ServiceSpecWire>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ServiceSpecWire {
    #[serde(rename = "clusterIP")]
    cluster_ip: Option<String>,
    #[serde(rename = "clusterIPs")]
    cluster_ips: Option<Vec<String>>,
    ports: Option<Vec<ServicePortWire>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ServicePortWire {
    name: Option<String>,
    #[serde(default)]
    port: i32,
    protocol: Option<String>,
    target_port: Option<IntOrString>,
}

/// An EndpointSlice as the agent decodes it: metadata (names, resourceVersion, the
/// service-name label), ports, and each endpoint's addresses, conditions and target name.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SliceObject {
    #[serde(deserialize_with = "slim_meta")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    ports: Option<Vec<SlicePortWire>>,
    #[serde(default)]
    endpoints: Option<Vec<EndpointWire>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
struct SlicePortWire {
    name: Option<String>,
    port: Option<i32>,
    protocol: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct EndpointWire {
    #[serde(default)]
    addresses: Vec<String>,
    conditions: Option<ConditionsWire>,
    target_ref: Option<TargetRefWire>,
}

#[derive(Clone, Copy, Debug, Default, Deserialize)]
struct ConditionsWire {
    ready: Option<bool>,
    serving: Option<bool>,
    terminating: Option<bool>,
}

#[derive(Clone, Debug, Default, Deserialize)]
struct TargetRefWire {
    name: Option<String>,
}

/// Implements [`kube::Resource`] for a slim type of a namespaced built-in resource.
macro_rules! resource {
    ($ty:ty, $group:literal, $version:literal, $api_version:literal, $kind:literal, $plural:literal) => {
        impl kube::Resource for $ty {
            type DynamicType = ();
            type Scope = NamespaceResourceScope;

            fn kind((): &()) -> Cow<'_, str> {
                Cow::Borrowed($kind)
            }
            fn group((): &()) -> Cow<'_, str> {
                Cow::Borrowed($group)
            }
            fn version((): &()) -> Cow<'_, str> {
                Cow::Borrowed($version)
            }
            fn api_version((): &()) -> Cow<'_, str> {
                Cow::Borrowed($api_version)
            }
            fn plural((): &()) -> Cow<'_, str> {
                Cow::Borrowed($plural)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

resource!(ServiceObject, "", "v1", "v1", "Service", "services");
resource!(
    SliceObject,
    "discovery.k8s.io",
    "v1",
    "discovery.k8s.io/v1",
    "EndpointSlice",
    "endpointslices"
);

/// The part of `metadata` the agent reads.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetaWire {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    #[serde(default, deserialize_with = "skewless_annotations")]
    annotations: Option<BTreeMap<String, String>>,
    #[serde(default, deserialize_with = "service_name_label")]
    labels: Option<BTreeMap<String, String>>,
}

fn slim_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = MetaWire::deserialize(d)?;
    Ok(ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        annotations: m.annotations,
        labels: m.labels,
        ..ObjectMeta::default()
    })
}

fn skewless_annotations<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    d.deserialize_option(Filtered(|k: &str| k.starts_with(ANNOTATION_PREFIX)))
}

fn service_name_label<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    d.deserialize_option(Filtered(|k: &str| k == SERVICE_NAME_LABEL))
}

/// A string map keeping only the keys `.0` accepts; the values of the others are skipped
/// without being allocated.
struct Filtered<F>(F);

impl<'de, F: Fn(&str) -> bool> Visitor<'de> for Filtered<F> {
    type Value = Option<BTreeMap<String, String>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map of strings or null")
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut kept = BTreeMap::new();
        while let Some(key) = map.next_key_seed(KeyIf(&self.0))? {
            match key {
                Some(key) => {
                    kept.insert(key, map.next_value::<String>()?);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Some(kept))
    }
}

/// A map key, allocated only if `.0` accepts it.
struct KeyIf<'f, F>(&'f F);

impl<'de, F: Fn(&str) -> bool> DeserializeSeed<'de> for KeyIf<'_, F> {
    type Value = Option<String>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<F: Fn(&str) -> bool> Visitor<'_> for KeyIf<'_, F> {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok((self.0)(v).then(|| v.to_owned()))
    }
}

/// The Service this object is, as a key.
#[must_use]
pub fn service_key(svc: &ServiceObject) -> ServiceKey {
    let meta = &svc.metadata;
    ServiceKey::new(
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// The model's view of a Service.
#[must_use]
pub fn service_input(svc: &ServiceObject) -> ServiceInput {
    let key = service_key(svc);
    let annotations = svc.metadata.annotations.clone().unwrap_or_default();
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

/// The slice's key.
#[must_use]
pub fn slice_key(slice: &SliceObject) -> SliceKey {
    let meta = &slice.metadata;
    SliceKey {
        namespace: meta.namespace.clone().unwrap_or_default(),
        name: meta.name.clone().unwrap_or_default(),
    }
}

/// The Service a slice belongs to (its `kubernetes.io/service-name` label), if any.
#[must_use]
pub fn slice_owner(slice: &SliceObject) -> Option<ServiceKey> {
    let meta = &slice.metadata;
    let name = meta.labels.as_ref()?.get(SERVICE_NAME_LABEL)?;
    Some(ServiceKey::new(
        meta.namespace.clone().unwrap_or_default(),
        name.clone(),
    ))
}

/// The model's view of an EndpointSlice; consumes it (the strings move, nothing is copied).
#[must_use]
pub fn slice_input(slice: SliceObject) -> SliceInput {
    let SliceObject {
        metadata,
        ports,
        endpoints,
    } = slice;
    SliceInput {
        key: SliceKey {
            namespace: metadata.namespace.unwrap_or_default(),
            name: metadata.name.unwrap_or_default(),
        },
        service_name: metadata
            .labels
            .and_then(|mut l| l.remove(SERVICE_NAME_LABEL)),
        ports: ports
            .into_iter()
            .flatten()
            .map(|p| SlicePortInput {
                name: p.name.unwrap_or_default(),
                port: p.port,
                protocol: p.protocol.unwrap_or_default(),
            })
            .collect(),
        endpoints: endpoints
            .into_iter()
            .flatten()
            .map(|e| {
                let c = e.conditions.unwrap_or_default();
                EndpointInput {
                    addresses: e.addresses,
                    target_name: e.target_ref.and_then(|t| t.name),
                    ready: c.ready,
                    serving: c.serving,
                    terminating: c.terminating,
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
    use k8s_openapi::api::{
        core::v1::{Service, ServicePort, ServiceSpec},
        discovery::v1::EndpointSlice,
    };
    use skewless_model::ConfigError;

    use super::*;

    /// An API object as the agent decodes it off the wire.
    fn decoded<T: serde::de::DeserializeOwned>(obj: &impl serde::Serialize) -> T {
        let json = serde_json::to_vec(obj).expect("serialize");
        serde_json::from_slice(&json).expect("decode")
    }

    fn mk_service(spec: ServiceSpec) -> ServiceObject {
        decoded(&Service {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("ns".into()),
                annotations: Some([("skewless.io/mode".to_owned(), "request".to_owned())].into()),
                ..ObjectMeta::default()
            },
            spec: Some(spec),
            ..Service::default()
        })
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
        let input = slice_input(decoded(&EndpointSlice::default()));
        assert_eq!(input.service_name, None);
    }

    #[test]
    fn only_the_annotations_and_label_the_model_reads_are_decoded() {
        let mut slice = EndpointSlice::default();
        slice.metadata.name = Some("web-a".into());
        slice.metadata.labels = Some(
            [
                (SERVICE_NAME_LABEL.to_owned(), "web".to_owned()),
                ("app".to_owned(), "web".to_owned()),
            ]
            .into(),
        );
        slice.endpoints = vec![k8s_openapi::api::discovery::v1::Endpoint {
            addresses: vec!["10.0.0.1".into()],
            node_name: Some("node-a".into()),
            ..Default::default()
        }];
        let obj: SliceObject = decoded(&slice);
        assert_eq!(obj.metadata.labels.as_ref().map(BTreeMap::len), Some(1));
        let input = slice_input(obj);
        assert_eq!(input.service_name.as_deref(), Some("web"));
        assert_eq!(input.endpoints[0].addresses, vec!["10.0.0.1".to_owned()]);

        let svc = mk_service(ServiceSpec::default());
        let mut raw = serde_json::to_value(Service {
            metadata: ObjectMeta {
                annotations: Some(
                    [
                        ("skewless.io/mode".to_owned(), "request".to_owned()),
                        (
                            "kubectl.kubernetes.io/last-applied-configuration".to_owned(),
                            "{\"big\": true}".to_owned(),
                        ),
                    ]
                    .into(),
                ),
                ..svc.metadata.clone()
            },
            ..Service::default()
        })
        .unwrap();
        raw["metadata"]["managedFields"] = serde_json::json!([{"manager": "kubectl"}]);
        let svc: ServiceObject = serde_json::from_value(raw).unwrap();
        assert_eq!(
            svc.metadata
                .annotations
                .map(|a| a.into_keys().collect::<Vec<_>>()),
            Some(vec!["skewless.io/mode".to_owned()]),
            "only skewless.io/* annotations are kept"
        );
    }
}
