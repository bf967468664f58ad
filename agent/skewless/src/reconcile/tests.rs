//! The reconciler against a recording fake of the datapath and real balancers on loopback.
//! The fake checks the orderings at the moment the datapath is touched: a redirect is
//! written only to a listener that answers HTTP/2, and removed while its balancer has not
//! been told to drain yet.

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{Ipv6Addr, TcpStream},
    time::Duration,
};

use skewless_model::{
    EndpointInput, Index, Metrics, PortInput, ServiceInput, SliceInput, SliceKey, SlicePortInput,
    annotations,
};

use super::*;

const VIP: &str = "198.19.0.10:8080";

/// What the reconciler did to the datapath, with what held at that moment.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    Set {
        vip: SocketAddr,
        listener: SocketAddr,
        /// The listener answered an HTTP/2 connection preface with SETTINGS.
        served: bool,
    },
    Remove {
        vip: SocketAddr,
        /// Whether the balancer behind the redirect had been told to drain; `None` when
        /// the test did not watch it.
        draining: Option<bool>,
    },
}

#[derive(Default)]
struct Fake {
    redirects: BTreeMap<SocketAddr, SocketAddr>,
    log: Vec<Op>,
    /// How many of the next `set_redirect` calls fail as if the map were full.
    fail_sets: usize,
    /// How many of the next `remove_redirect` calls fail.
    fail_removes: usize,
    /// Per VIP, the stop signal of the balancer serving it.
    drains: BTreeMap<SocketAddr, watch::Receiver<bool>>,
}

impl Redirector for Fake {
    fn set_redirect(&mut self, vip: SocketAddr, listener: SocketAddr) -> Result<(), Error> {
        self.log.push(Op::Set {
            vip,
            listener,
            served: answers_http2(listener),
        });
        if self.fail_sets > 0 {
            self.fail_sets -= 1;
            return Err(map_full(vip));
        }
        self.redirects.insert(vip, listener);
        Ok(())
    }

    fn remove_redirect(&mut self, vip: SocketAddr) -> Result<(), Error> {
        self.log.push(Op::Remove {
            vip,
            draining: self.drains.get(&vip).map(|rx| *rx.borrow()),
        });
        if self.fail_removes > 0 {
            self.fail_removes -= 1;
            return Err(map_full(vip));
        }
        self.redirects.remove(&vip);
        Ok(())
    }
}

/// An error the kernel datapath returns; which one does not matter to the reconciler.
fn map_full(vip: SocketAddr) -> Error {
    Error::RedirectMapFull {
        addr: vip,
        capacity: 1,
    }
}

/// Whether a balancer serves `addr`: it answers the client preface with its SETTINGS.
fn answers_http2(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else {
        return false;
    };
    // The client preface and an empty SETTINGS frame.
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    let mut head = [0u8; 9];
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .is_ok()
        && stream.write_all(&hello).is_ok()
        && stream.read_exact(&mut head).is_ok()
        && head[3] == 4
}

struct Bed {
    fake: Arc<Mutex<Fake>>,
    reconciler: Reconciler,
    index: Index,
    snapshots: watch::Receiver<Snapshot>,
    /// Dropped last: the balancers' threads.
    _workers: Arc<Workers>,
}

impl Bed {
    fn new() -> Self {
        Self::with(None, DataPath::H2)
    }

    fn with_ip6(balancer_ip6: Option<Ipv6Addr>) -> Self {
        Self::with(balancer_ip6, DataPath::H2)
    }

    fn with(balancer_ip6: Option<Ipv6Addr>, data_path: DataPath) -> Self {
        let fake = Arc::new(Mutex::new(Fake::default()));
        let workers = Arc::new(Workers::start(1, "test-dp").expect("worker threads start"));
        let redirector: Arc<Mutex<dyn Redirector>> = fake.clone();
        let reconciler = Reconciler::new(
            redirector,
            Arc::clone(&workers),
            Ipv4Addr::LOCALHOST,
            balancer_ip6,
            Arc::new(PeerFilter::new(Vec::new())),
            data_path,
        );
        let index = Index::new(Metrics::default());
        let snapshots = index.subscribe();
        Self {
            fake,
            reconciler,
            index,
            snapshots,
            _workers: workers,
        }
    }

    fn fake(&self) -> std::sync::MutexGuard<'_, Fake> {
        self.fake.lock().expect("fake lock")
    }

    /// Publishes `svc` (and one ready endpoint for it) and applies the snapshot.
    async fn apply(&mut self, svc: &ServiceInput) {
        assert_eq!(self.index.apply_service(svc), None, "test Service is valid");
        self.index.apply_slice(&mk_slice(&svc.key.name));
        self.reconcile().await;
    }

    async fn delete(&mut self, name: &str) {
        self.index.delete_service(&ServiceKey::new("ns", name));
        self.reconcile().await;
    }

    async fn reconcile(&mut self) {
        let snapshot = self.snapshots.borrow_and_update().clone();
        self.reconciler.apply(&snapshot).await;
    }

    /// Lets the fake see, at removal time, whether each running balancer was told to
    /// drain.
    fn watch_drains(&self) {
        let mut fake = self.fake();
        for (vip, r) in &self.reconciler.running {
            fake.drains.insert(*vip, r.stop.subscribe());
        }
    }

    fn take_log(&self) -> Vec<Op> {
        std::mem::take(&mut self.fake().log)
    }

    fn listener(&self, vip: SocketAddr) -> SocketAddr {
        self.reconciler
            .running
            .get(&vip)
            .expect("the VIP has a balancer")
            .listener
    }
}

fn vip() -> SocketAddr {
    VIP.parse().expect("test VIP")
}

fn mk_service(name: &str, cluster_ip: &str, mode: &str) -> ServiceInput {
    ServiceInput {
        key: ServiceKey::new("ns", name),
        annotations: BTreeMap::from([(annotations::MODE.to_owned(), mode.to_owned())]),
        cluster_ips: vec![cluster_ip.to_owned()],
        ports: vec![PortInput {
            name: "grpc".into(),
            port: 8080,
            protocol: "TCP".into(),
            target_port: None,
        }],
    }
}

fn with_annotation(mut svc: ServiceInput, key: &str, value: &str) -> ServiceInput {
    svc.annotations.insert(key.to_owned(), value.to_owned());
    svc
}

/// One ready endpoint that nothing listens on: the balancer never needs to reach it here.
fn mk_slice(service: &str) -> SliceInput {
    SliceInput {
        key: SliceKey {
            namespace: "ns".into(),
            name: format!("{service}-1"),
        },
        service_name: Some(service.into()),
        ports: vec![SlicePortInput {
            name: "grpc".into(),
            port: Some(8080),
            protocol: "TCP".into(),
        }],
        endpoints: vec![EndpointInput {
            addresses: vec!["127.0.0.1".into()],
            target_name: Some("pod-1".into()),
            ready: Some(true),
            serving: None,
            terminating: None,
        }],
    }
}

#[tokio::test]
async fn opting_in_redirects_only_to_a_listener_that_already_serves() {
    let mut bed = Bed::new();
    bed.apply(&mk_service("echo", "198.19.0.10", "request"))
        .await;

    let listener = bed.listener(vip());
    assert_eq!(
        bed.take_log(),
        vec![Op::Set {
            vip: vip(),
            listener,
            served: true
        }],
        "one redirect, written when the balancer already answered HTTP/2"
    );
    assert_eq!(bed.fake().redirects, BTreeMap::from([(vip(), listener)]));
    assert_eq!(listener.ip(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    let status = bed.reconciler.status();
    assert_eq!(status.len(), 1, "one redirected Service port in the status");
    assert_eq!(status[0].listener, listener.to_string());
}

#[tokio::test]
async fn opting_out_removes_the_redirect_before_the_balancer_drains() {
    let mut bed = Bed::new();
    bed.apply(&mk_service("echo", "198.19.0.10", "request"))
        .await;
    let listener = bed.listener(vip());
    bed.watch_drains();
    let mut drained = bed.reconciler.running[&vip()].stop.subscribe();
    bed.take_log();

    bed.delete("echo").await;

    assert_eq!(
        bed.take_log(),
        vec![Op::Remove {
            vip: vip(),
            draining: Some(false)
        }],
        "the redirect goes while its balancer still serves"
    );
    assert!(*drained.borrow_and_update(), "then the balancer drains");
    assert!(bed.fake().redirects.is_empty());
    assert!(bed.reconciler.status().is_empty());
    wait_until_closed(listener).await;
}

#[tokio::test]
async fn mode_changes_away_from_request_remove_the_redirect_and_back_restore_it() {
    for other in ["observe"] {
        let mut bed = Bed::new();
        bed.apply(&mk_service("echo", "198.19.0.10", "request"))
            .await;
        let first = bed.listener(vip());
        bed.watch_drains();
        bed.take_log();

        bed.apply(&mk_service("echo", "198.19.0.10", other)).await;
        assert_eq!(
            bed.take_log(),
            vec![Op::Remove {
                vip: vip(),
                draining: Some(false)
            }],
            "request -> {other}: the redirect is removed before the drain"
        );
        assert!(bed.fake().redirects.is_empty(), "{other} is not redirected");

        bed.apply(&mk_service("echo", "198.19.0.10", "request"))
            .await;
        let log = bed.take_log();
        let Some(Op::Set {
            vip,
            listener,
            served,
        }) = log.first().cloned()
        else {
            panic!("{other} -> request must write the redirect again, got {log:?}");
        };
        assert_eq!((log.len(), vip, served), (1, self::vip(), true), "{log:?}");
        assert_ne!(listener, first, "a fresh balancer, not the drained one");
        assert_eq!(bed.fake().redirects, BTreeMap::from([(vip, listener)]));
    }
}

#[tokio::test]
async fn tuning_and_endpoint_changes_apply_live_without_touching_the_redirect() {
    let mut bed = Bed::new();
    bed.apply(&mk_service("echo", "198.19.0.10", "request"))
        .await;
    let listener = bed.listener(vip());
    bed.take_log();

    let tuned = with_annotation(
        mk_service("echo", "198.19.0.10", "request"),
        annotations::MAX_CONNECTION_AGE,
        "90s",
    );
    bed.apply(&tuned).await;
    let mut second = mk_slice("echo");
    second.key.name = "echo-2".into();
    second.endpoints[0].addresses = vec!["127.0.0.2".into()];
    bed.index.apply_slice(&second);
    bed.reconcile().await;

    assert_eq!(
        bed.take_log(),
        vec![],
        "no redirect change for a tuning or endpoint change"
    );
    assert_eq!(bed.listener(vip()), listener, "same balancer");
    let running = &bed.reconciler.running[&vip()];
    let Balancers::Request(balancers) = &running.balancers else {
        panic!("a request-mode Service runs request-mode balancers");
    };
    assert_eq!(
        balancers[0].config().max_connection_age,
        Some(Duration::from_secs(90)),
        "the running balancer was reconfigured"
    );
    assert_eq!(
        running.endpoints.borrow().len(),
        2,
        "the running balancer follows the new endpoint"
    );
    assert!(!*running.stop.borrow(), "and keeps serving");
}

#[tokio::test]
async fn a_redirect_the_datapath_refuses_leaves_the_service_plain_l4_and_is_retried() {
    let mut bed = Bed::new();
    bed.fake().fail_sets = 1;
    bed.apply(&mk_service("echo", "198.19.0.10", "request"))
        .await;

    let log = bed.take_log();
    let [Op::Set { listener, .. }] = log[..] else {
        panic!("one refused redirect, got {log:?}");
    };
    assert!(bed.fake().redirects.is_empty());
    assert!(
        bed.reconciler.status().is_empty(),
        "not shown as redirected"
    );
    let unserved = bed.reconciler.unserved();
    assert_eq!(
        unserved
            .iter()
            .map(|u| (u.service.as_str(), u.vip.as_str(), u.mode.as_str()))
            .collect::<Vec<_>>(),
        [("ns/echo", VIP, "request")],
        "shown as not served"
    );
    assert!(
        unserved[0].error.contains("redirect map is full"),
        "with the datapath's error: {unserved:?}"
    );
    wait_until_closed(listener).await;

    // The agent re-applies every few seconds; the next try succeeds.
    bed.reconcile().await;
    assert!(
        bed.reconciler.unserved().is_empty(),
        "served once the retry succeeds"
    );
    let listener = bed.listener(vip());
    assert_eq!(
        bed.take_log(),
        vec![Op::Set {
            vip: vip(),
            listener,
            served: true
        }]
    );
}

#[tokio::test]
async fn a_redirect_that_cannot_be_removed_keeps_its_balancer_serving_until_it_is() {
    let mut bed = Bed::new();
    bed.apply(&mk_service("echo", "198.19.0.10", "request"))
        .await;
    let listener = bed.listener(vip());
    bed.watch_drains();
    bed.take_log();
    bed.fake().fail_removes = 1;

    bed.delete("echo").await;

    assert_eq!(
        bed.fake().redirects,
        BTreeMap::from([(vip(), listener)]),
        "the removal failed: the redirect is still in effect"
    );
    assert!(
        bed.reconciler
            .running
            .get(&vip())
            .is_some_and(|r| !*r.stop.borrow()),
        "so its balancer must stay and not drain"
    );
    assert!(answers_http2(listener), "and keeps serving");

    // The next apply tries again.
    bed.reconcile().await;
    assert_eq!(
        bed.take_log(),
        vec![
            Op::Remove {
                vip: vip(),
                draining: Some(false)
            };
            2
        ]
    );
    assert!(bed.fake().redirects.is_empty());
    assert!(bed.reconciler.status().is_empty());
    wait_until_closed(listener).await;
}

#[tokio::test]
async fn a_balancer_that_stopped_is_restarted_behind_a_fresh_redirect() {
    let mut bed = Bed::new();
    bed.apply(&mk_service("echo", "198.19.0.10", "request"))
        .await;
    let first = bed.listener(vip());
    for task in &bed.reconciler.running[&vip()].tasks {
        task.abort();
    }
    while !bed.reconciler.running[&vip()]
        .tasks
        .iter()
        .all(JoinHandle::is_finished)
    {
        tokio::task::yield_now().await;
    }
    bed.take_log();

    bed.reconcile().await;

    let log = bed.take_log();
    let second = bed.listener(vip());
    assert_ne!(second, first);
    assert_eq!(
        log,
        vec![
            Op::Remove {
                vip: vip(),
                draining: None
            },
            Op::Set {
                vip: vip(),
                listener: second,
                served: true
            }
        ],
        "the dead balancer's redirect goes, then the new one's is written"
    );
}

#[tokio::test]
async fn ipv6_cluster_ips_are_redirected_only_with_an_ipv6_balancer_address() {
    let v6: SocketAddr = "[fd00:198:19::a]:8080".parse().unwrap();
    let mut bed = Bed::new();
    bed.apply(&mk_service("echo", "fd00:198:19::a", "request"))
        .await;
    assert_eq!(
        bed.take_log(),
        vec![],
        "no --balancer-ip6: IPv6 stays plain L4"
    );

    let mut bed = Bed::with_ip6(Some(Ipv6Addr::LOCALHOST));
    bed.apply(&mk_service("echo", "fd00:198:19::a", "request"))
        .await;
    let listener = bed.listener(v6);
    assert_eq!(listener.ip(), IpAddr::V6(Ipv6Addr::LOCALHOST));
    assert_eq!(
        bed.take_log(),
        vec![Op::Set {
            vip: v6,
            listener,
            served: true
        }]
    );
}

#[tokio::test]
async fn shutdown_removes_each_redirect_before_its_balancer_drains() {
    let mut bed = Bed::new();
    bed.apply(&mk_service("a", "198.19.0.10", "request")).await;
    bed.apply(&mk_service("b", "198.19.0.11", "request")).await;
    bed.watch_drains();
    bed.take_log();

    bed.reconciler.shutdown().await;

    let log = bed.take_log();
    assert_eq!(log.len(), 2, "{log:?}");
    assert!(
        log.iter().all(|op| matches!(
            op,
            Op::Remove {
                draining: Some(false),
                ..
            }
        )),
        "each redirect removed before its balancer drains: {log:?}"
    );
    assert!(bed.fake().redirects.is_empty());
}

/// Waits (bounded) until nothing accepts on `addr` any more.
async fn wait_until_closed(addr: SocketAddr) {
    for _ in 0..500 {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{addr} still accepts connections 5 s after its balancer was stopped");
}

/// A live backend for connection mode (the relay needs one to answer HTTP/2): a gRPC server
/// with only `grpc.health.v1` (SERVING, for the server and the Echo service name), on its own runtime so the fake's blocking check can
/// reach it; the slice lists it.
struct Backend {
    port: u16,
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Backend {
    fn start() -> Self {
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("backend runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("backend binds");
                port_tx
                    .send(listener.local_addr().expect("backend addr").port())
                    .expect("port");
                // "" is SERVING from the start; the service the tuning test names too.
                let (reporter, health) = tonic_health::server::health_reporter();
                reporter
                    .set_service_status(
                        "skewless.echo.v1.Echo",
                        tonic_health::ServingStatus::Serving,
                    )
                    .await;
                let stop = async move {
                    let _ = tokio::task::spawn_blocking(move || stopped.recv()).await;
                };
                tonic::transport::Server::builder()
                    .add_service(health)
                    .serve_with_incoming_shutdown(
                        tokio_stream::wrappers::TcpListenerStream::new(listener),
                        stop,
                    )
                    .await
                    .expect("backend serves");
            });
        });
        Self {
            port: port_rx.recv().expect("backend port"),
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Bed {
    /// Publishes `svc` with `backend` as its one ready endpoint and applies the snapshot.
    async fn apply_with(&mut self, svc: &ServiceInput, backend: &Backend) {
        assert_eq!(self.index.apply_service(svc), None, "test Service is valid");
        let mut slice = mk_slice(&svc.key.name);
        slice.ports[0].port = Some(i32::from(backend.port));
        self.index.apply_slice(&slice);
        self.reconcile().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_mode_redirects_only_to_a_listener_that_relays_and_reports_it() {
    let backend = Backend::start();
    let mut bed = Bed::new();
    bed.apply_with(&mk_service("echo", "198.19.0.10", "connection"), &backend)
        .await;
    let listener = bed.listener(vip());
    assert_eq!(
        bed.take_log(),
        vec![Op::Set {
            vip: vip(),
            listener,
            served: true
        }],
        "one redirect, written when the relay already answered HTTP/2 (the backend's SETTINGS)"
    );
    assert!(matches!(
        bed.reconciler.running[&vip()].balancers,
        Balancers::Connection(_)
    ));
    let status = bed.reconciler.status();
    assert_eq!(status.len(), 1);
    assert_eq!(status[0].mode, "connection");
    let connection = status[0].connection.as_ref().expect("connection figures");
    assert!(!connection.as_even_as_possible);
    assert_eq!(connection.ready_backends, 1, "{connection:?}");
    assert_eq!(connection.skew_threshold, 1.5, "the annotation's default");
    assert_eq!(connection.state, "idle", "no traffic yet: {connection:?}");
    assert_eq!(status[0].endpoints.len(), 1, "{status:?}");
    assert_eq!(status[0].endpoints[0].state, "Active", "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_between_request_and_connection_mode_swaps_the_balancer_behind_a_fresh_redirect()
{
    let backend = Backend::start();
    let mut bed = Bed::new();
    bed.apply_with(&mk_service("echo", "198.19.0.10", "request"), &backend)
        .await;
    let mut previous = bed.listener(vip());
    for mode in ["connection", "request", "connection"] {
        bed.watch_drains();
        bed.take_log();
        bed.apply_with(&mk_service("echo", "198.19.0.10", mode), &backend)
            .await;
        let listener = bed.listener(vip());
        assert_ne!(listener, previous, "{mode}: a fresh balancer");
        assert_eq!(
            bed.take_log(),
            vec![
                Op::Remove {
                    vip: vip(),
                    draining: Some(false)
                },
                Op::Set {
                    vip: vip(),
                    listener,
                    served: true
                }
            ],
            "-> {mode}: the old redirect goes before its balancer drains, the new one is \
             written once the new balancer serves"
        );
        assert_eq!(
            bed.reconciler.running[&vip()].balancers.mode().as_str(),
            mode
        );
        wait_until_closed(previous).await;
        previous = listener;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_tuning_reconfigures_the_running_balancer_live() {
    let backend = Backend::start();
    let mut bed = Bed::new();
    bed.apply_with(&mk_service("echo", "198.19.0.10", "connection"), &backend)
        .await;
    let listener = bed.listener(vip());
    bed.take_log();
    let mut tuned = mk_service("echo", "198.19.0.10", "connection");
    for (key, value) in [
        (annotations::SKEW_THRESHOLD, "2.5"),
        (annotations::HOLD_TIME, "5s"),
        (annotations::MAX_ROTATIONS_PER_MINUTE, "30"),
        (annotations::MAX_CONNECTION_AGE, "10m"),
        (annotations::GRPC_HEALTH_SERVICE, "skewless.echo.v1.Echo"),
    ] {
        tuned = with_annotation(tuned, key, value);
    }
    bed.apply_with(&tuned, &backend).await;
    assert_eq!(
        bed.take_log(),
        vec![],
        "no redirect change for a tuning change"
    );
    assert_eq!(bed.listener(vip()), listener, "same balancer");
    let Balancers::Connection(balancer) = &bed.reconciler.running[&vip()].balancers else {
        panic!("connection mode");
    };
    let config = balancer.config();
    assert_eq!(config.rotation.skew_threshold, 2.5);
    assert_eq!(config.rotation.hold_time, Duration::from_secs(5));
    assert_eq!(config.rotation.max_rotations_per_minute, 30);
    assert_eq!(config.max_connection_age, Some(Duration::from_secs(600)));
    assert_eq!(
        config.health_service.as_deref(),
        Some("skewless.echo.v1.Echo")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_removes_a_connection_mode_redirect_before_its_balancer_drains() {
    let backend = Backend::start();
    let mut bed = Bed::new();
    bed.apply_with(&mk_service("echo", "198.19.0.10", "connection"), &backend)
        .await;
    let listener = bed.listener(vip());
    bed.watch_drains();
    bed.take_log();
    bed.reconciler.shutdown().await;
    assert_eq!(
        bed.take_log(),
        vec![Op::Remove {
            vip: vip(),
            draining: Some(false)
        }]
    );
    wait_until_closed(listener).await;
}

/// `--data-path codec`: a request-mode Service is served by the frame codec's balancers,
/// behind a redirect written once they serve, and reported like the h2 path's (endpoints,
/// call latency) from the same status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_codec_data_path_serves_request_mode_and_reports_it() {
    let backend = Backend::start();
    let mut bed = Bed::with(None, DataPath::Codec);
    bed.apply_with(&mk_service("echo", "198.19.0.10", "request"), &backend)
        .await;
    let listener = bed.listener(vip());
    assert_eq!(
        bed.take_log(),
        vec![Op::Set {
            vip: vip(),
            listener,
            served: true
        }],
        "one redirect, written when the balancer already answered HTTP/2"
    );
    let Balancers::Request(balancers) = &bed.reconciler.running[&vip()].balancers else {
        panic!("request mode");
    };
    assert!(
        balancers.iter().all(|b| b.data_path() == DataPath::Codec),
        "every worker's balancer is on the codec path"
    );
    let channel = tonic::transport::Channel::from_shared(format!("http://{listener}"))
        .expect("uri")
        .connect()
        .await
        .expect("a client connects to the balancer");
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    // The balancer connects to the backend in the background: the first call may wait for it.
    let reply = health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("a call through the codec path")
        .into_inner();
    assert_eq!(
        reply.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let status = bed.reconciler.status();
    assert_eq!(status[0].mode, "request");
    assert_eq!(status[0].endpoints[0].state, "Active", "{status:?}");
    assert_eq!(
        status[0].latency.counts.iter().sum::<u64>(),
        1,
        "the call is in the Service's latency: {status:?}"
    );
}
