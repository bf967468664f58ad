//! Mass pod loss (issue 11 §2): six echo pods as real processes, three SIGKILLed at once (5 ms apart, no
//! preStop drain, so the kernel closes their connections mid-call), the endpoint list updated
//! 1 s later as Kubernetes would, 50 calls in flight through the balancer all along, each with
//! a 5 s deadline. Loopback only; every process is killed when the test ends, also on failure.
//! Every scenario runs on both data paths.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use skewless_balancer::{Config, Endpoint};
use skewless_echo::pb::EchoRequest;
use skewless_echo::pb::echo_client::EchoClient;
use support::{DataPath, on_both_paths};
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::Channel;

mod support;

on_both_paths!(
    three_of_six_pods_killed_lose_no_call_of_a_retryable_method,
    three_of_six_pods_killed_fail_only_the_calls_in_flight_on_them,
    retries_fit_inside_a_5s_deadline_when_connects_to_the_dead_pods_time_out,
);

/// The Echo method, as `skewless.io/retryable-methods` lists it.
const ECHO: &str = "/skewless.echo.v1.Echo/Echo";
/// The callers' deadline (the seed's: retries must fit inside it).
const DEADLINE: Duration = Duration::from_secs(5);
const CALLERS: usize = 50;
/// Server-side time of every call, so the calls in flight are really at the pods (also on a
/// busy machine, where the balancer and the client may take tens of ms per call themselves).
const CALL_DELAY_MS: u32 = 200;

/// Time between the SIGKILLs: pods that die "at once" (a node's eviction, an OOM kill of
/// several) are still a few milliseconds apart, and a retry sent at once can land on a pod
/// whose death is not seen yet.
const KILL_SPREAD: Duration = Duration::from_millis(5);

/// Echo pods as `skewless-echo` processes; all killed on drop.
struct Pods {
    children: Vec<Option<Child>>,
    addrs: Vec<SocketAddr>,
}

impl Pods {
    fn start(n: usize) -> Self {
        let bin = skewless_clients::bin_dir()
            .expect("skewless-echo builds")
            .join("skewless-echo");
        let mut pods = Self {
            children: Vec::new(),
            addrs: Vec::new(),
        };
        for i in 0..n {
            // A free port: bound here, released, then taken by the pod.
            let addr = StdListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free loopback port");
            let child = Command::new(&bin)
                .args(["--listen", &addr.to_string(), "--name", &format!("pod-{i}")])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("skewless-echo starts");
            pods.children.push(Some(child));
            pods.addrs.push(addr);
        }
        for addr in &pods.addrs {
            let up = std::time::Instant::now();
            while std::net::TcpStream::connect(addr).is_err() {
                assert!(
                    up.elapsed() < Duration::from_secs(10),
                    "the pod on {addr} listens within 10 s"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        pods
    }

    fn endpoints(&self, which: impl IntoIterator<Item = usize>) -> Vec<Endpoint> {
        which
            .into_iter()
            .map(|i| Endpoint::new(self.addrs[i], format!("pod-{i}")))
            .collect()
    }

    /// SIGKILLs the pods `KILL_SPREAD` apart, then reaps them: when this returns they are gone
    /// and the kernel has closed their sockets.
    fn kill(&mut self, which: &[usize]) {
        for (n, &i) in which.iter().enumerate() {
            if n > 0 {
                std::thread::sleep(KILL_SPREAD);
            }
            if let Some(child) = &mut self.children[i] {
                child.kill().expect("SIGKILL");
            }
        }
        for &i in which {
            if let Some(mut child) = self.children[i].take() {
                child.wait().expect("reaped");
            }
        }
    }
}

impl Drop for Pods {
    fn drop(&mut self) {
        for mut child in self.children.iter_mut().filter_map(Option::take) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A listener on `addr` that completes one handshake and never accepts, so every later connect
/// to it hangs until the connector's timeout (the kernel drops SYNs to a full accept queue):
/// a pod address that no longer answers. Held open while the returned value lives.
fn blackhole(addr: SocketAddr) -> (socket2::Socket, std::net::TcpStream) {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).expect("socket");
    s.set_reuse_address(true).expect("SO_REUSEADDR");
    s.bind(&addr.into()).expect("bind the dead pod's port");
    s.listen(0).expect("listen");
    let filler = std::net::TcpStream::connect(addr).expect("the one queued connection");
    (s, filler)
}

/// One call: when it was sent, when it ended, and which pod answered or how it failed.
type Call = (Instant, Instant, Result<String, tonic::Status>);

#[derive(Debug, Clone, Copy)]
struct Scenario {
    /// Echo is listed in the Service's retryable methods.
    retryable: bool,
    /// After the kill, connects to the dead pods' addresses hang (instead of being refused).
    blackhole: bool,
    /// The balancer's connect timeout.
    connect_timeout: Duration,
}

struct Outcome {
    /// The calls sent once the load was steady (the first ones pay for fresh connections in
    /// a debug build, which is not what this test is about: they are only reported).
    calls: Vec<Call>,
    /// Before the first SIGKILL, once all three were reaped, and when the endpoint list
    /// dropped them.
    killed_at: Instant,
    dead_at: Instant,
    updated_at: Instant,
    /// Failures the balancer recorded on the killed pods and on the others.
    failures_killed: u64,
    failures_others: u64,
    retries: u64,
}

/// One scenario at a time: each runs seven processes' worth of load, and a starved machine
/// would fail calls on their deadline whatever the balancer does. This serialises libtest's
/// threads; nextest runs each test in its own process, and its `pod-loss` test group
/// (.config/nextest.toml) does the same there.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn run<P: DataPath>(scenario: Scenario) -> Outcome {
    let _one = ONE_AT_A_TIME.lock().await;
    support::init_tracing();
    let mut pods = Pods::start(6);
    let config = Config {
        retryable_methods: if scenario.retryable {
            vec![ECHO.to_owned()]
        } else {
            Vec::new()
        },
        connect_timeout: scenario.connect_timeout,
        ..Config::default()
    };
    let mut serving = support::balancer_on::<P>(config, pods.endpoints(0..6)).await;
    let (addr, balancer) = (serving.addr, serving.balancer.clone());
    // One HTTP/2 connection, as a pinned client has, carrying all 50 callers.
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("the client connects to the balancer");
    let client = EchoClient::new(channel);
    let stop = Arc::new(AtomicBool::new(false));
    let completed = Arc::new(AtomicUsize::new(0));
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let (mut c, stop, completed) = (client.clone(), stop.clone(), completed.clone());
            tokio::spawn(async move {
                let mut calls = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let mut req = tonic::Request::new(EchoRequest {
                        payload: b"loss".to_vec(),
                        delay_ms: CALL_DELAY_MS,
                        ..EchoRequest::default()
                    });
                    req.set_timeout(DEADLINE);
                    let sent = Instant::now();
                    let r = c.echo(req).await.map(|r| r.into_inner().pod);
                    calls.push((sent, Instant::now(), r));
                    completed.fetch_add(1, Ordering::Relaxed);
                }
                calls
            })
        })
        .collect();

    // Steady load first (after a warm-up), and a burst worth the name: the pods about to die
    // hold at least 20 calls between them (more than a fixed budget of 10 could retry).
    // Waited for rather than timed, so a busy machine makes the test slower, not weaker.
    let killed = [0, 2, 4];
    let in_flight_on_killed = || -> u32 {
        balancer
            .stats()
            .iter()
            .filter(|e| killed.iter().any(|i| e.name == format!("pod-{i}")))
            .map(|e| e.in_flight)
            .sum()
    };
    wait_for("the first calls (warm-up)", || {
        completed.load(Ordering::Relaxed) >= 2 * CALLERS
    })
    .await;
    let steady_at = Instant::now();
    let warm = completed.load(Ordering::Relaxed);
    wait_for("steady load on the pods about to be killed", || {
        completed.load(Ordering::Relaxed) >= warm + 3 * CALLERS && in_flight_on_killed() >= 20
    })
    .await;
    let killed_at = Instant::now();
    pods.kill(&killed);
    let dead_at = Instant::now();
    // Held until the end: the dead pods' addresses stop answering connects.
    let _holes: Vec<_> = if scenario.blackhole {
        killed.iter().map(|&i| blackhole(pods.addrs[i])).collect()
    } else {
        Vec::new()
    };
    // Kubernetes notices a second later.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (mut failures_killed, mut failures_others) = (0, 0);
    for e in balancer.stats() {
        let i: usize = e.name["pod-".len()..].parse().expect("pod-N");
        if killed.contains(&i) {
            failures_killed += e.failures;
        } else {
            failures_others += e.failures;
        }
    }
    serving
        .endpoints
        .send(pods.endpoints([1, 3, 5]))
        .expect("the balancer follows the endpoints");
    let updated_at = Instant::now();
    let done = completed.load(Ordering::Relaxed);
    wait_for("calls after the endpoint update", || {
        completed.load(Ordering::Relaxed) >= done + 3 * CALLERS
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let mut calls = Vec::new();
    for caller in callers {
        calls.extend(caller.await.expect("caller"));
    }
    let retries = balancer.counters().retries;
    serving.stop_within(Duration::from_secs(15)).await;
    let warm_up = calls
        .iter()
        .filter(|(sent, _, _)| *sent < steady_at)
        .count();
    let warm_up_failed = calls
        .iter()
        .filter(|(sent, _, r)| *sent < steady_at && r.is_err())
        .count();
    calls.retain(|(sent, _, _)| *sent >= steady_at);
    let failed = calls.iter().filter(|(_, _, r)| r.is_err()).count();
    // `--nocapture` shows what each run measured.
    eprintln!(
        "{scenario:?}: {} calls, {failed} failed, {retries} retries; before that {warm_up} \
         warm-up calls, {warm_up_failed} failed",
        calls.len()
    );
    for (sent, ended, r) in &calls {
        if let Err(status) = r {
            eprintln!(
                "  failed: sent {:+.3} s, ended {:+.3} s from the kill: {:?} {}",
                since(killed_at, *sent),
                since(killed_at, *ended),
                status.code(),
                status.message()
            );
        }
    }
    Outcome {
        calls,
        killed_at,
        dead_at,
        updated_at,
        failures_killed,
        failures_others,
        retries,
    }
}

/// Seconds from `from` to `to`, negative when `to` came first.
fn since(from: Instant, to: Instant) -> f64 {
    to.saturating_duration_since(from).as_secs_f64()
        - from.saturating_duration_since(to).as_secs_f64()
}

/// Polls `cond` every 5 ms until it holds; fails the test after 60 s.
async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let give_up = Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(Instant::now() < give_up, "{what} within 60 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn failed(outcome: &Outcome) -> Vec<&Call> {
    outcome
        .calls
        .iter()
        .filter(|(_, _, r)| r.is_err())
        .collect()
}

/// The calls were really running through the kill: before it and after the endpoint update.
fn assert_load_ran_throughout(outcome: &Outcome) {
    let before = outcome
        .calls
        .iter()
        .filter(|(_, ended, _)| *ended < outcome.killed_at)
        .count();
    let late = outcome
        .calls
        .iter()
        .filter(|(sent, _, _)| *sent > outcome.updated_at)
        .count();
    assert!(
        before > CALLERS && late > CALLERS,
        "calls ran before the kill ({before}) and after the endpoint update ({late})"
    );
}

async fn three_of_six_pods_killed_lose_no_call_of_a_retryable_method<P: DataPath>() {
    let outcome = run::<P>(Scenario {
        retryable: true,
        blackhole: false,
        connect_timeout: Config::default().connect_timeout,
    })
    .await;
    assert_load_ran_throughout(&outcome);
    let failed = failed(&outcome);
    assert!(
        failed.is_empty(),
        "no call of a retryable method may fail: {} of {} failed, first {:?}",
        failed.len(),
        outcome.calls.len(),
        failed.first()
    );
    // More retries than a fixed budget of 10 tokens held: the burst was as large as the calls
    // in flight on the killed pods (else this test proves nothing about the budget).
    assert!(
        outcome.retries > 10,
        "the calls in flight on the killed pods were retried: {} retries",
        outcome.retries
    );
}

async fn three_of_six_pods_killed_fail_only_the_calls_in_flight_on_them<P: DataPath>() {
    let outcome = run::<P>(Scenario {
        retryable: false,
        blackhole: false,
        connect_timeout: Config::default().connect_timeout,
    })
    .await;
    assert_load_ran_throughout(&outcome);
    let failed = failed(&outcome);
    assert!(
        !failed.is_empty(),
        "calls in flight on SIGKILLed pods of a non-retryable method fail (else this test \
         proves nothing)"
    );
    assert!(
        failed.len() <= CALLERS,
        "at most the calls in flight can fail: {}",
        failed.len()
    );
    for (sent, ended, r) in &failed {
        let status = r.as_ref().expect_err("failed");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(
            *sent < outcome.dead_at && *ended >= outcome.killed_at,
            "only calls in flight at the kill fail; this one was sent {:?} after it and \
             ended {:?} after it: {status:?}",
            sent.saturating_duration_since(outcome.killed_at),
            ended.saturating_duration_since(outcome.killed_at)
        );
    }
    assert_eq!(
        outcome.failures_others, 0,
        "no call failed on a pod that stayed up"
    );
    assert_eq!(
        u64::try_from(failed.len()).expect("small"),
        outcome.failures_killed,
        "every failed call failed on a killed pod (the balancer's own count)"
    );
}

async fn retries_fit_inside_a_5s_deadline_when_connects_to_the_dead_pods_time_out<P: DataPath>() {
    // The seed's mistake, on purpose: a connect timeout as long as the callers' deadline,
    // and the dead pods' addresses swallow connects. A retry that waited on a connect could
    // not finish in time; the balancer's retries only go to endpoints with a live connection.
    let outcome = run::<P>(Scenario {
        retryable: true,
        blackhole: true,
        connect_timeout: DEADLINE,
    })
    .await;
    assert_load_ran_throughout(&outcome);
    let failed = failed(&outcome);
    assert!(
        failed.is_empty(),
        "every retry finishes inside the 5 s deadline: {} of {} failed, first {:?}",
        failed.len(),
        outcome.calls.len(),
        failed.first()
    );
    let slowest = outcome
        .calls
        .iter()
        .map(|(sent, ended, _)| ended.saturating_duration_since(*sent))
        .max()
        .expect("calls");
    assert!(
        slowest < DEADLINE,
        "no call waited out its deadline: the slowest took {slowest:?}"
    );
    assert!(outcome.retries > 10, "retried: {}", outcome.retries);
}
