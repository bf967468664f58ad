//! Index behaviour with synthetic objects: what gets published for each source event.

use std::{collections::BTreeMap, net::SocketAddr};

use skewless_model::{
    ConfigError, EndpointInput, Index, Metrics, Mode, PortInput, ServiceInput, ServiceKey,
    SliceInput, SliceKey, SlicePortInput, Snapshot, TargetPort, annotations,
};
use tokio::sync::watch;

fn mk_key(name: &str) -> ServiceKey {
    ServiceKey::new("ns", name)
}

fn mk_service(name: &str, mode: Option<&str>) -> ServiceInput {
    let mut annotations = BTreeMap::new();
    if let Some(m) = mode {
        annotations.insert(annotations::MODE.to_owned(), m.to_owned());
    }
    ServiceInput {
        key: mk_key(name),
        annotations,
        cluster_ips: vec!["10.96.0.10".into()],
        ports: vec![PortInput {
            name: "grpc".into(),
            port: 80,
            protocol: "TCP".into(),
            target_port: Some(TargetPort::Name("grpc".into())),
        }],
    }
}

fn mk_endpoint(ip: &str, ready: Option<bool>, terminating: Option<bool>) -> EndpointInput {
    EndpointInput {
        addresses: vec![ip.into()],
        target_name: Some(format!("pod-{ip}")),
        ready,
        serving: None,
        terminating,
    }
}

fn mk_slice(name: &str, service: &str, port: i32, ips: &[&str]) -> SliceInput {
    SliceInput {
        key: SliceKey {
            namespace: "ns".into(),
            name: name.into(),
        },
        service_name: Some(service.into()),
        ports: vec![SlicePortInput {
            name: "grpc".into(),
            port: Some(port),
            protocol: "TCP".into(),
        }],
        endpoints: ips
            .iter()
            .map(|ip| mk_endpoint(ip, Some(true), None))
            .collect(),
    }
}

fn mk_ips(n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("10.0.0.{i}")).collect()
}

fn ready_addrs(snap: &Snapshot, name: &str) -> Vec<SocketAddr> {
    snap.get(&mk_key(name))
        .expect("service must be published")
        .port(80)
        .expect("port 80")
        .ready()
        .map(|e| e.addr)
        .collect()
}

fn changed(rx: &mut watch::Receiver<Snapshot>) -> bool {
    let c = rx.has_changed().expect("index alive");
    rx.mark_unchanged();
    c
}

#[test]
fn opted_in_service_is_published_with_its_endpoints() {
    let mut index = Index::new(Metrics::default());
    let mut rx = index.subscribe();
    index.apply_service(&mk_service("web", Some("request")));
    assert!(changed(&mut rx), "opting in must publish");
    index.apply_slice(&mk_slice("web-a", "web", 8080, &["10.0.0.1", "10.0.0.2"]));
    assert!(
        changed(&mut rx),
        "a slice of an opted-in Service must publish"
    );
    let snap = rx.borrow().clone();
    assert_eq!(
        ready_addrs(&snap, "web"),
        vec![
            "10.0.0.1:8080".parse::<SocketAddr>().unwrap(),
            "10.0.0.2:8080".parse().unwrap()
        ]
    );
    let vips = snap.vips();
    assert_eq!(vips.len(), 1);
    assert_eq!(vips[0].addr, "10.96.0.10:80".parse().unwrap());
    assert_eq!(vips[0].mode, Mode::Request);
}

#[test]
fn slices_of_services_not_opted_in_are_not_kept() {
    let mut index = Index::new(Metrics::default());
    let mut rx = index.subscribe();
    index.apply_service(&mk_service("other", None));
    index.apply_slice(&mk_slice("web-a", "web", 8080, &["10.0.0.1"]));
    index.apply_slice(&mk_slice("other-a", "other", 8080, &["10.0.0.2"]));
    assert!(!changed(&mut rx), "nothing opted in, nothing published");
    assert_eq!(
        index.slice_count(),
        0,
        "no slice of a Service without skewless.io/mode is kept"
    );
}

#[test]
fn opt_out_drops_the_services_slices() {
    let mut index = Index::new(Metrics::default());
    let rx = index.subscribe();
    index.apply_service(&mk_service("web", Some("request")));
    index.apply_slice(&mk_slice("web-a", "web", 8080, &["10.0.0.1"]));
    index.apply_slice(&mk_slice("web-b", "web", 8080, &["10.0.0.2"]));
    assert_eq!(index.slice_count(), 2);
    index.apply_service(&mk_service("web", None));
    assert_eq!(
        index.slice_count(),
        0,
        "opt-out must drop the slices from memory"
    );
    assert!(rx.borrow().is_empty());
    index.apply_service(&mk_service("web", Some("request")));
    index.apply_slice(&mk_slice("web-c", "web", 8080, &["10.0.0.3"]));
    index.delete_service(&mk_key("web"));
    assert_eq!(
        index.slice_count(),
        0,
        "deleting the Service drops its slices"
    );
}

#[test]
fn with_fetch_on_opt_in_a_new_opt_in_waits_for_its_slices() {
    let mut index = Index::new(Metrics::default());
    let mut rx = index.subscribe();
    index.apply_service(&mk_service("early", Some("request")));
    index.fetch_on_opt_in();
    assert!(
        index.take_fetches().is_empty(),
        "Services wanted before are not fetched"
    );
    changed(&mut rx);
    index.apply_service(&mk_service("web", Some("request")));
    assert!(index.awaits_slices(&mk_key("web")));
    assert!(
        !changed(&mut rx),
        "an opt-in waiting for its slices is not published"
    );
    index.apply_slice(&mk_slice("web-a", "web", 8080, &["10.0.0.9"]));
    assert_eq!(
        index.slice_count(),
        0,
        "the fetch brings its slices, not the stream"
    );
    assert_eq!(index.take_fetches(), vec![mk_key("web")]);
    assert!(
        index.take_fetches().is_empty(),
        "each opt-in is fetched once"
    );
    index.reset_service_slices(
        &mk_key("web"),
        &[
            mk_slice("web-a", "web", 8080, &["10.0.0.1"]),
            mk_slice("x-a", "x", 8080, &["10.0.0.2"]),
        ],
    );
    assert!(changed(&mut rx), "its slices in, it is published");
    assert_eq!(
        ready_addrs(&rx.borrow(), "web"),
        vec!["10.0.0.1:8080".parse::<SocketAddr>().unwrap()]
    );
    assert_eq!(
        index.slice_count(),
        1,
        "slices of another Service in the fetch are ignored"
    );
    index.apply_slice(&mk_slice("web-b", "web", 8080, &["10.0.0.3"]));
    assert_eq!(
        ready_addrs(&rx.borrow(), "web").len(),
        2,
        "then the stream's changes apply"
    );

    index.apply_service(&mk_service("gone", Some("request")));
    index.apply_service(&mk_service("gone", None));
    assert!(
        index.take_fetches().is_empty(),
        "an opt-out cancels its fetch"
    );
    index.reset_service_slices(
        &mk_key("gone"),
        &[mk_slice("gone-a", "gone", 8080, &["10.0.0.4"])],
    );
    assert_eq!(
        index.slice_count(),
        2,
        "a late fetch of an opted-out Service is ignored"
    );
}

#[test]
fn incremental_relists_apply_as_they_go_and_sweep_at_the_end() {
    let mut index = Index::new(Metrics::default());
    let rx = index.subscribe();
    for name in ["a", "b"] {
        index.apply_service(&mk_service(name, Some("request")));
    }
    index.apply_slice(&mk_slice("a-1", "a", 8080, &["10.0.0.1"]));
    index.apply_slice(&mk_slice("a-2", "a", 8080, &["10.0.0.2"]));
    index.fetch_on_opt_in();

    index.begin_services_relist();
    index.apply_service(&mk_service("a", Some("connection")));
    assert_eq!(
        rx.borrow().get(&mk_key("a")).unwrap().mode,
        Mode::Connection,
        "applied at once"
    );
    assert_eq!(rx.borrow().len(), 2, "nothing is forgotten before the end");
    index.end_services_relist();
    assert!(
        rx.borrow().get(&mk_key("b")).is_none(),
        "b was not relisted"
    );

    index.begin_slices_relist();
    index.apply_service(&mk_service("c", Some("request")));
    index.reset_service_slices(&mk_key("c"), &[mk_slice("c-1", "c", 8080, &["10.0.0.3"])]);
    index.apply_slice(&mk_slice("a-2", "a", 8080, &["10.0.0.5"]));
    index.end_slices_relist();
    assert_eq!(
        ready_addrs(&rx.borrow(), "a"),
        vec!["10.0.0.5:8080".parse::<SocketAddr>().unwrap()],
        "a-1 was not relisted"
    );
    assert_eq!(
        ready_addrs(&rx.borrow(), "c").len(),
        1,
        "a Service that opted in during the relist keeps what its fetch brought"
    );
}

#[test]
fn service_without_mode_annotation_is_ignored() {
    let mut index = Index::new(Metrics::default());
    let mut rx = index.subscribe();
    index.apply_service(&mk_service("web", None));
    assert!(!changed(&mut rx));
    assert!(rx.borrow().is_empty());
}

#[test]
fn mode_change_republishes_and_opt_out_removes() {
    let mut index = Index::new(Metrics::default());
    let mut rx = index.subscribe();
    index.apply_service(&mk_service("web", Some("request")));
    assert!(changed(&mut rx));
    index.apply_service(&mk_service("web", Some("request")));
    assert!(
        !changed(&mut rx),
        "re-applying the same config must not wake consumers"
    );
    index.apply_service(&mk_service("web", Some("observe")));
    assert!(changed(&mut rx));
    assert_eq!(rx.borrow().get(&mk_key("web")).unwrap().mode, Mode::Observe);
    index.apply_service(&mk_service("web", None));
    assert!(changed(&mut rx));
    assert!(
        rx.borrow().get(&mk_key("web")).is_none(),
        "opt-out must unpublish"
    );
}

#[test]
fn bad_annotation_keeps_last_good_config_and_is_reported_once() {
    let metrics = Metrics::default();
    let mut index = Index::new(metrics.clone());
    let mut rx = index.subscribe();
    index.apply_service(&mk_service("web", Some("connection")));
    assert!(changed(&mut rx));

    let mut bad = mk_service("web", Some("connection"));
    bad.annotations
        .insert(annotations::HOLD_TIME.into(), "soon".into());
    let r = index
        .apply_service(&bad)
        .expect("first bad config is reported");
    assert!(r.kept_last_good);
    assert!(matches!(
        r.error.as_slice(),
        [ConfigError::InvalidDuration { .. }]
    ));
    assert!(
        index.apply_service(&bad).is_none(),
        "same error is reported once"
    );
    assert!(
        !changed(&mut rx),
        "a rejected config must not change published state"
    );
    assert_eq!(
        rx.borrow().get(&mk_key("web")).unwrap().mode,
        Mode::Connection
    );
    assert_eq!(metrics.rejected_total("InvalidDuration"), 1);

    let unknown = mk_service("web", Some("fast"));
    let r = index
        .apply_service(&unknown)
        .expect("a different error is reported");
    assert_eq!(r.error.reason(), "UnknownMode");
    assert_eq!(metrics.rejected_total("UnknownMode"), 1);
    assert!(
        rx.borrow().get(&mk_key("web")).is_some(),
        "unknown mode must not opt the Service out"
    );
}

#[test]
fn bad_first_config_publishes_nothing() {
    let mut index = Index::new(Metrics::default());
    let mut rx = index.subscribe();
    let r = index
        .apply_service(&mk_service("web", Some("fast")))
        .expect("reported");
    assert!(!r.kept_last_good);
    assert!(!changed(&mut rx));
}

#[test]
fn headless_and_udp_services_are_rejected_with_reason() {
    let mut index = Index::new(Metrics::default());
    let mut headless = mk_service("h", Some("request"));
    headless.cluster_ips = vec!["None".into()];
    let r = index.apply_service(&headless).expect("headless rejected");
    assert_eq!(
        r.error.as_slice(),
        [ConfigError::Headless],
        "headless only, no 'no ClusterIP' on top"
    );

    let mut udp = mk_service("u", Some("request"));
    udp.ports.push(PortInput {
        name: "dns".into(),
        port: 53,
        protocol: "UDP".into(),
        target_port: None,
    });
    let r = index.apply_service(&udp).expect("udp rejected");
    assert!(matches!(
        r.error.as_slice(),
        [ConfigError::UnsupportedProtocol { port: 53, .. }]
    ));
    assert!(
        r.error.to_string().contains("TCP"),
        "reason must be clear: {}",
        r.error
    );
    assert!(index.subscribe().borrow().is_empty());
}

#[test]
fn every_problem_of_a_config_is_reported_in_one_rejection() {
    let metrics = Metrics::default();
    let mut index = Index::new(metrics.clone());
    let mut svc = mk_service("web", Some("request"));
    svc.annotations
        .insert("skewless.io/hold_time".into(), "1s".into());
    svc.annotations
        .insert(annotations::SKEW_THRESHOLD.into(), "lots".into());
    svc.ports.push(PortInput {
        name: "dns".into(),
        port: 53,
        protocol: "UDP".into(),
        target_port: None,
    });
    let r = index.apply_service(&svc).expect("rejected");
    let reasons: Vec<&str> = r.error.as_slice().iter().map(ConfigError::reason).collect();
    assert_eq!(
        reasons,
        ["UnknownAnnotation", "InvalidNumber", "UnsupportedProtocol"],
        "the typo, the bad number and the UDP port together: {}",
        r.error
    );
    assert_eq!(
        metrics.rejected_total("UnknownAnnotation"),
        1,
        "one rejected config, counted under its first reason"
    );
    assert_eq!(metrics.rejected_total("InvalidNumber"), 0);

    // Fixing one problem changes the error: reported again, with what is left.
    svc.annotations.remove("skewless.io/hold_time");
    let r = index
        .apply_service(&svc)
        .expect("a different set of problems is reported");
    assert_eq!(r.error.len(), 2, "{}", r.error);
}

#[test]
fn scale_two_to_ten_to_three_tracks_endpoints() {
    let mut index = Index::new(Metrics::default());
    let rx = index.subscribe();
    index.apply_service(&mk_service("web", Some("request")));
    for n in [2, 10, 3] {
        let ips = mk_ips(n);
        let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
        index.apply_slice(&mk_slice("web-a", "web", 8080, &ips));
        assert_eq!(ready_addrs(&rx.borrow(), "web").len(), n, "scaled to {n}");
    }
}

#[test]
fn endpoints_merge_across_slices_and_deduplicate() {
    let mut index = Index::new(Metrics::default());
    let rx = index.subscribe();
    index.apply_service(&mk_service("web", Some("request")));
    index.apply_slice(&mk_slice("web-a", "web", 8080, &["10.0.0.1", "10.0.0.2"]));
    index.apply_slice(&mk_slice("web-b", "web", 8080, &["10.0.0.2", "10.0.0.3"]));
    assert_eq!(ready_addrs(&rx.borrow(), "web").len(), 3);
    index.delete_slice(&SliceKey {
        namespace: "ns".into(),
        name: "web-a".into(),
    });
    assert_eq!(
        ready_addrs(&rx.borrow(), "web"),
        vec![
            "10.0.0.2:8080".parse::<SocketAddr>().unwrap(),
            "10.0.0.3:8080".parse().unwrap()
        ]
    );
}

#[test]
fn named_target_port_resolves_per_slice() {
    let mut index = Index::new(Metrics::default());
    let rx = index.subscribe();
    index.apply_service(&mk_service("web", Some("request")));
    // Pods of two versions name the same container port differently: two slices.
    index.apply_slice(&mk_slice("web-v1", "web", 8080, &["10.0.0.1"]));
    index.apply_slice(&mk_slice("web-v2", "web", 9090, &["10.0.0.2"]));
    assert_eq!(
        ready_addrs(&rx.borrow(), "web"),
        vec![
            "10.0.0.1:8080".parse::<SocketAddr>().unwrap(),
            "10.0.0.2:9090".parse().unwrap()
        ]
    );
}

#[test]
fn terminating_and_unready_endpoints_are_kept_but_not_ready() {
    let mut index = Index::new(Metrics::default());
    let rx = index.subscribe();
    index.apply_service(&mk_service("web", Some("request")));
    let mut slice = mk_slice("web-a", "web", 8080, &[]);
    slice.endpoints = vec![
        mk_endpoint("10.0.0.1", None, None),
        mk_endpoint("10.0.0.2", Some(false), Some(true)),
        EndpointInput {
            serving: Some(true),
            ..mk_endpoint("10.0.0.3", Some(false), Some(true))
        },
    ];
    index.apply_slice(&slice);
    let snap = rx.borrow().clone();
    let port = snap.get(&mk_key("web")).unwrap().port(80).unwrap().clone();
    assert_eq!(
        port.endpoints.len(),
        3,
        "all endpoints are kept for draining"
    );
    assert_eq!(port.ready().count(), 1, "unknown ready counts as ready");
    let draining = &port.endpoints[2].conditions;
    assert!(draining.serving && draining.terminating && !draining.ready);
}

#[test]
fn dual_stack_service_has_v4_and_v6_vips_and_endpoints() {
    let mut index = Index::new(Metrics::default());
    let rx = index.subscribe();
    let mut svc = mk_service("web", Some("request"));
    svc.cluster_ips = vec!["10.96.0.10".into(), "fd00::10".into()];
    index.apply_service(&svc);
    index.apply_slice(&mk_slice("web-v4", "web", 8080, &["10.0.0.1"]));
    index.apply_slice(&mk_slice("web-v6", "web", 8080, &["fd00::1"]));
    let snap = rx.borrow().clone();
    let vips: Vec<SocketAddr> = snap.vips().into_iter().map(|v| v.addr).collect();
    assert_eq!(
        vips,
        vec![
            "10.96.0.10:80".parse::<SocketAddr>().unwrap(),
            "[fd00::10]:80".parse().unwrap()
        ]
    );
    assert_eq!(ready_addrs(&snap, "web").len(), 2);
}

#[test]
fn relist_forgets_what_disappeared() {
    let mut index = Index::new(Metrics::default());
    let rx = index.subscribe();
    index.apply_service(&mk_service("a", Some("request")));
    index.apply_service(&mk_service("b", Some("request")));
    index.apply_slice(&mk_slice("a-1", "a", 8080, &["10.0.0.1"]));
    index.reset_services(&[mk_service("a", Some("request"))]);
    assert_eq!(rx.borrow().len(), 1, "b vanished during the relist");
    index.reset_slices(&[]);
    assert_eq!(ready_addrs(&rx.borrow(), "a").len(), 0);
}

#[test]
fn slice_relabelled_to_another_service_moves() {
    let mut index = Index::new(Metrics::default());
    let rx = index.subscribe();
    index.apply_service(&mk_service("a", Some("request")));
    index.apply_service(&mk_service("b", Some("request")));
    index.apply_slice(&mk_slice("s", "a", 8080, &["10.0.0.1"]));
    index.apply_slice(&mk_slice("s", "b", 8080, &["10.0.0.1"]));
    assert_eq!(ready_addrs(&rx.borrow(), "a").len(), 0);
    assert_eq!(ready_addrs(&rx.borrow(), "b").len(), 1);
}

#[test]
fn unchanged_service_keeps_its_arc_across_snapshots() {
    let mut index = Index::new(Metrics::default());
    let rx = index.subscribe();
    index.apply_service(&mk_service("a", Some("request")));
    index.apply_service(&mk_service("b", Some("request")));
    let before = rx.borrow().clone();
    index.apply_slice(&mk_slice("b-1", "b", 8080, &["10.0.0.1"]));
    let after = rx.borrow().clone();
    assert!(
        std::sync::Arc::ptr_eq(
            before.get(&mk_key("a")).unwrap(),
            after.get(&mk_key("a")).unwrap()
        ),
        "a did not change, so consumers of a must see the same Arc"
    );
    assert!(!std::sync::Arc::ptr_eq(
        before.get(&mk_key("b")).unwrap(),
        after.get(&mk_key("b")).unwrap()
    ));
}
