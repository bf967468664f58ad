//! The data plane's threads: one single-threaded Tokio runtime per worker thread, the
//! thread-per-core layout of HAProxy, nginx and Envoy workers (and of linkerd2-proxy with one
//! core).
//!
//! Why not one multi-threaded runtime: with work stealing, the task that forwards a request
//! wakes the upstream connection's task, the runtime runs that task right away (its LIFO slot),
//! and the connection writes that one request in its own `writev`. On a single-threaded
//! runtime a woken task waits its turn behind the other ready streams, so one upstream write
//! carries every request that arrived in the same read of the client's connection (measured:
//! docs/balancer.md, "Shape of the crate").
//!
//! A Service gets one balancer per worker, each on its own `SO_REUSEPORT` listener of the same
//! address ([`reuseport_listeners`]): the kernel spreads client connections over the workers,
//! and each worker serves its connections with its own balancer (in request mode its own
//! picker and upstream connections, as Envoy's workers do). [`Workers::serve`] runs any mode:
//! it takes the constructor of the mode's per-worker balancer, a [`NewConnection`].

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle as TaskHandle;
use tracing::Instrument as _;

use crate::server::{self, NewConnection};

mod threads;
use crate::BalancerError;
pub use threads::{StallCause, StallTimes, ThreadSample, blocked_in};

/// How often every worker proves it still runs its tasks (see [`Workers::stalled`]).
const TICK: Duration = Duration::from_millis(100);

/// Worker threads, each driving a single-threaded Tokio runtime until dropped.
pub struct Workers {
    workers: Vec<Worker>,
    /// Reference point of the workers' liveness ticks.
    epoch: Instant,
}

struct Worker {
    handle: Handle,
    /// Milliseconds since `epoch` when the worker last ran its tick task.
    last_tick: Arc<AtomicU64>,
    /// The worker thread's id (0 until it is known), for [`Workers::liveness`].
    tid: Arc<AtomicU32>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("workers", &self.workers.len())
            .finish_non_exhaustive()
    }
}

impl Workers {
    /// Starts `n` worker threads (at least one), named `{name}-{i}`.
    ///
    /// # Errors
    /// When a runtime or a thread cannot be created.
    pub fn start(n: usize, name: &str) -> io::Result<Self> {
        let epoch = Instant::now();
        let mut workers = Vec::with_capacity(n.max(1));
        for i in 0..n.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let handle = runtime.handle().clone();
            let last_tick = Arc::new(AtomicU64::new(0));
            let ticks = Arc::clone(&last_tick);
            let tid = Arc::new(AtomicU32::new(0));
            let tid_of_thread = Arc::clone(&tid);
            let (stop, stopped) = oneshot::channel::<()>();
            let thread = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    tid_of_thread.store(threads::current_tid().unwrap_or(0), Ordering::Relaxed);
                    runtime.spawn(async move {
                        let mut tick = tokio::time::interval(TICK);
                        loop {
                            tick.tick().await;
                            ticks.store(millis_since(epoch), Ordering::Relaxed);
                        }
                    });
                    // Runs every task spawned on `handle` until the stop signal (or until
                    // `Workers` is dropped, which drops the sender); then the runtime is
                    // dropped with this thread, cancelling what is left.
                    let _ = runtime.block_on(stopped);
                })?;
            workers.push(Worker {
                handle,
                last_tick,
                tid,
                stop: Some(stop),
                thread: Some(thread),
            });
        }
        Ok(Self { workers, epoch })
    }

    /// The runtimes' handles, one per worker: spawn a worker's tasks with
    /// [`Handle::spawn`], and construct a balancer (e.g. a [`crate::Balancer`]) inside
    /// [`Handle::enter`] so its own tasks land on that worker too.
    pub fn handles(&self) -> impl ExactSizeIterator<Item = &Handle> {
        self.workers.iter().map(|w| &w.handle)
    }

    /// Number of workers.
    #[must_use]
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Always false: there is at least one worker.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Whether some worker is stalled ([`Liveness::stalled`]): its thread is blocked or its
    /// runtime hung, so connections sent to it would not be served. The agent's heartbeat
    /// stops while this holds, and the hooks fail open.
    #[must_use]
    pub fn stalled(&self, max: Duration) -> bool {
        self.liveness().iter().any(|w| w.stalled(max))
    }
}

/// One worker's liveness (see [`Workers::liveness`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    /// How long since the worker last ran its tick task.
    pub since_tick: Duration,
    /// The worker thread's id, for reading its scheduler counters ([`ThreadSample::read`]);
    /// `None` when it is not known (not Linux, or the thread has not started).
    pub tid: Option<u32>,
}

impl Liveness {
    /// Whether the worker has not run its tick task for longer than `max`. A worker that has
    /// not ticked yet counts from the workers' start, so a thread that never got going is
    /// stalled too.
    #[must_use]
    pub fn stalled(&self, max: Duration) -> bool {
        self.since_tick > max
    }
}

impl Workers {
    /// Each worker's liveness, in worker order: what tells a stall's cause (the agent samples
    /// the threads while they tick, and again when one stops).
    #[must_use]
    pub fn liveness(&self) -> Vec<Liveness> {
        let now = millis_since(self.epoch);
        self.workers
            .iter()
            .map(|w| Liveness {
                since_tick: Duration::from_millis(
                    now.saturating_sub(w.last_tick.load(Ordering::Relaxed)),
                ),
                tid: Some(w.tid.load(Ordering::Relaxed)).filter(|&t| t != 0),
            })
            .collect()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for w in &mut self.workers {
            if let Some(stop) = w.stop.take() {
                let _ = stop.send(());
            }
        }
        for w in &mut self.workers {
            if let Some(thread) = w.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

/// One Service port served by every worker: see [`Workers::serve`].
#[derive(Debug)]
pub struct Served<B> {
    /// The address all the workers' listeners share.
    pub addr: SocketAddr,
    /// One balancer per worker (for stats and reconfiguration).
    pub balancers: Vec<Arc<B>>,
    /// The workers' serve tasks; each ends when `stop` turns true and its drain is over, or
    /// when its accept loop fails (after `on_error` ran).
    pub tasks: Vec<TaskHandle<()>>,
}

impl Workers {
    /// Serves one Service port on every worker: binds [`reuseport_listeners`] on `addr`, and
    /// on each worker the balancer `new_balancer` makes (called inside that worker's runtime,
    /// e.g. `|| Balancer::new(config.clone(), endpoints.clone())`) accepts the connections
    /// whose peer `admit` allows, until `stop` turns true (then drains). The listeners are
    /// listening when this returns. A balancer whose accept loop fails calls `on_error` on
    /// its worker. Each worker's task runs in a `worker` span under the caller's current span.
    ///
    /// # Errors
    /// When the listeners cannot be bound.
    pub fn serve<B: NewConnection + Send + Sync + 'static>(
        &self,
        addr: SocketAddr,
        new_balancer: impl Fn() -> B,
        stop: &watch::Receiver<bool>,
        admit: impl Fn(SocketAddr) -> bool + Clone + Send + 'static,
        on_error: impl Fn(BalancerError) + Clone + Send + 'static,
    ) -> io::Result<Served<B>> {
        let (addr, listeners) = reuseport_listeners(addr, self.len())?;
        let mut balancers = Vec::with_capacity(listeners.len());
        let mut tasks = Vec::with_capacity(listeners.len());
        for (worker, (handle, listener)) in self.handles().zip(listeners).enumerate() {
            // Constructed inside the worker's runtime so its connection tasks run there too.
            let balancer = {
                let _worker = handle.enter();
                Arc::new(new_balancer())
            };
            let serving = Arc::clone(&balancer);
            let mut stop = stop.clone();
            let (admit, on_error) = (admit.clone(), on_error.clone());
            tasks.push(
                handle.spawn(
                    async move {
                        let shutdown = async move {
                            let _ = stop.wait_for(|stop| *stop).await;
                        };
                        let served = match tokio::net::TcpListener::from_std(listener) {
                            Ok(listener) => {
                                server::serve(&*serving, listener, shutdown, admit).await
                            }
                            Err(error) => Err(BalancerError::Accept(error)),
                        };
                        if let Err(error) = served {
                            on_error(error);
                        }
                    }
                    .instrument(tracing::info_span!("worker", worker)),
                ),
            );
            balancers.push(balancer);
        }
        Ok(Served {
            addr,
            balancers,
            tasks,
        })
    }
}

fn millis_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Binds `n` listeners (at least one) on `addr` with `SO_REUSEPORT`, so the kernel spreads
/// incoming connections over them; port 0 picks one free port for all of them. Returns the
/// address they share and the listeners, non-blocking, ready for
/// `tokio::net::TcpListener::from_std` inside the runtime that will accept on each.
///
/// # Errors
/// When a socket cannot be created, configured, bound or put in the listening state.
pub fn reuseport_listeners(
    addr: SocketAddr,
    n: usize,
) -> io::Result<(SocketAddr, Vec<std::net::TcpListener>)> {
    use socket2::{Domain, Socket, Type};
    let mut bound = addr;
    let mut listeners = Vec::with_capacity(n.max(1));
    for _ in 0..n.max(1) {
        let socket = Socket::new(Domain::for_address(bound), Type::STREAM, None)?;
        socket.set_reuse_port(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&bound.into())?;
        socket.listen(1024)?;
        let listener: std::net::TcpListener = socket.into();
        // The first bind of port 0 chose the port; the others join it.
        bound = listener.local_addr()?;
        listeners.push(listener);
    }
    Ok((bound, listeners))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuseport_listeners_share_one_port() {
        let (addr, listeners) = reuseport_listeners("127.0.0.1:0".parse().unwrap(), 3).unwrap();
        assert_ne!(addr.port(), 0);
        assert_eq!(listeners.len(), 3);
        for l in &listeners {
            assert_eq!(l.local_addr().unwrap(), addr);
        }
    }

    #[test]
    fn a_worker_is_stalled_only_past_the_limit() {
        let live = |ms| Liveness {
            since_tick: Duration::from_millis(ms),
            tid: None,
        };
        let max = Duration::from_millis(400);
        assert!(!live(0).stalled(max));
        assert!(!live(400).stalled(max), "at the limit it still runs");
        assert!(live(401).stalled(max));
    }

    #[test]
    fn a_blocked_worker_is_reported_stalled() {
        let workers = Workers::start(2, "test-worker").unwrap();
        assert_eq!(workers.len(), 2);
        // Wait (generously) until both have ticked.
        let deadline = Instant::now() + Duration::from_secs(10);
        while workers.stalled(Duration::from_millis(500)) {
            assert!(Instant::now() < deadline, "workers never ticked");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Block one worker's thread: its tick stops.
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let handle = workers.handles().nth(1).unwrap().clone();
        handle.spawn(async move {
            let _ = blocked.recv();
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while !workers.stalled(Duration::from_millis(300)) {
            assert!(
                Instant::now() < deadline,
                "a blocked worker was never reported"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Blocked in a system call (a channel's futex), off the CPU: told as blocked.
        let live = workers.liveness();
        assert!(live[1].since_tick > Duration::from_millis(300), "{live:?}");
        assert!(live[0].since_tick < live[1].since_tick, "{live:?}");
        let tid = live[1].tid.expect("the worker's thread id");
        let before = ThreadSample::read(tid).expect("a sample");
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_millis(200));
        let now = ThreadSample::read(tid).expect("a sample");
        assert_eq!(now.state, 'S', "asleep in the kernel");
        let times = now.since(&before, t0.elapsed());
        assert_eq!(times.cause(), StallCause::Blocked, "{times:?}");
        release.send(()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while workers.stalled(Duration::from_millis(500)) {
            assert!(
                Instant::now() < deadline,
                "the released worker did not recover"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
