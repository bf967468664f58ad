//! Why a data-plane worker stalled: the heartbeat samples each worker thread's scheduler
//! counters while every worker ticks, and when one stops ticking it compares (see
//! `skewless_balancer::workers::ThreadSample`): mostly on a CPU (`busy`: a task that does not
//! yield), mostly waiting for one (`starved`: the node or the agent's CPU share is short), or
//! neither (`blocked`: in a system call or on a lock; `wchan` and `syscall` say where).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use skewless_balancer::workers::{Liveness, ThreadSample, blocked_in};

/// Stalls so far, per worker (`skewless_worker_stalls_total`).
#[derive(Debug)]
pub(crate) struct StallCounts(Vec<AtomicU64>);

impl StallCounts {
    pub(crate) fn new(workers: usize) -> Self {
        Self((0..workers).map(|_| AtomicU64::new(0)).collect())
    }

    /// Worker `i`'s stalls so far (0 for a worker it does not know).
    pub(crate) fn get(&self, worker: usize) -> u64 {
        self.0.get(worker).map_or(0, |n| n.load(Ordering::Relaxed))
    }
}

/// The samples of the last heartbeat at which every worker ticked, and the workers found
/// stalled since.
#[derive(Debug)]
pub(crate) struct StallWatch {
    baseline: Vec<Option<(Instant, ThreadSample)>>,
    stalled: Vec<usize>,
    counts: Arc<StallCounts>,
}

impl StallWatch {
    /// Counts each stall in `counts`.
    pub(crate) fn new(counts: Arc<StallCounts>) -> Self {
        Self {
            baseline: Vec::new(),
            stalled: Vec::new(),
            counts,
        }
    }

    /// Every worker ticks: their samples become the baseline. Logs the end of a stall (with
    /// where the stalled workers' time went over it); returns whether one was over.
    pub(crate) fn running(&mut self, workers: &[Liveness]) -> bool {
        let now = Instant::now();
        let samples: Vec<_> = workers
            .iter()
            .map(|w| w.tid.and_then(ThreadSample::read).map(|s| (now, s)))
            .collect();
        let was_stalled = !self.stalled.is_empty();
        for worker in std::mem::take(&mut self.stalled) {
            let (Some(Some((then, before))), Some(Some((_, after)))) =
                (self.baseline.get(worker), samples.get(worker))
            else {
                tracing::info!(
                    worker,
                    "data-plane workers running again: heartbeat resumed"
                );
                continue;
            };
            let over = now - *then;
            let times = after.since(before, over);
            tracing::info!(
                worker,
                over_ms = over.as_millis(),
                cause = %times.cause(),
                on_cpu_ms = times.on_cpu.as_millis(),
                waiting_ms = times.waiting.as_millis(),
                off_cpu_ms = times.off_cpu.as_millis(),
                "data-plane workers running again: heartbeat resumed"
            );
        }
        self.baseline = samples;
        was_stalled
    }

    /// Some worker has not ticked for longer than `max`: counts and logs each such worker once
    /// per stall, with where its time went since the baseline and where its thread is now.
    pub(crate) fn stalled(&mut self, workers: &[Liveness], max: Duration) {
        let now = Instant::now();
        for (worker, live) in workers.iter().enumerate() {
            if !live.stalled(max) || self.stalled.contains(&worker) {
                continue;
            }
            self.stalled.push(worker);
            if let Some(n) = self.counts.0.get(worker) {
                n.fetch_add(1, Ordering::Relaxed);
            }
            let Some(tid) = live.tid else {
                tracing::error!(
                    worker,
                    since_tick_ms = live.since_tick.as_millis(),
                    "a data-plane worker is stalled: heartbeat paused, redirects fail open"
                );
                continue;
            };
            let (wchan, syscall) = blocked_in(tid);
            let sample = ThreadSample::read(tid);
            let base = self.baseline.get(worker).copied().flatten();
            let (Some(after), Some((then, before))) = (sample, base) else {
                tracing::error!(
                    worker,
                    since_tick_ms = live.since_tick.as_millis(),
                    wchan,
                    syscall,
                    "a data-plane worker is stalled: heartbeat paused, redirects fail open"
                );
                continue;
            };
            let over = now - then;
            let times = after.since(&before, over);
            tracing::error!(
                worker,
                since_tick_ms = live.since_tick.as_millis(),
                cause = %times.cause(),
                state = %after.state,
                wchan,
                syscall,
                over_ms = over.as_millis(),
                on_cpu_ms = times.on_cpu.as_millis(),
                waiting_ms = times.waiting.as_millis(),
                off_cpu_ms = times.off_cpu.as_millis(),
                "a data-plane worker is stalled: heartbeat paused, redirects fail open"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(since_tick_ms: u64) -> Liveness {
        Liveness {
            since_tick: Duration::from_millis(since_tick_ms),
            tid: None,
        }
    }

    #[test]
    fn each_stall_is_counted_once_for_the_worker_that_stalled() {
        let counts = Arc::new(StallCounts::new(2));
        let mut watch = StallWatch::new(Arc::clone(&counts));
        let max = Duration::from_millis(400);
        watch.running(&[live(50), live(50)]);
        watch.stalled(&[live(50), live(500)], max);
        watch.stalled(&[live(50), live(900)], max);
        assert_eq!((counts.get(0), counts.get(1)), (0, 1), "one stall, once");
        assert!(watch.running(&[live(50), live(50)]), "a stall was over");
        watch.stalled(&[live(450), live(450)], max);
        assert_eq!((counts.get(0), counts.get(1)), (1, 2), "a new stall each");
        assert_eq!(counts.get(7), 0, "an unknown worker has none");
    }
}
