//! The retry budget: how many retries the balancer may send, sized from the traffic it sees.
//!
//! Finagle's `RetryBudget` and Linkerd's (tower's `TpsBudget`) work the same way, and this is
//! their design: every original request deposits `ratio` of a retry, every retry withdraws
//! one, deposits and withdrawals both expire after `window`, and `min_per_second x window`
//! retries are allowed on top whatever the traffic. So at any moment
//!
//! ```text
//! retries in the last window <= ratio x requests in the last window + min_per_second x window
//! ```
//!
//! Two properties follow, and are what the budget is for (tests below):
//! - A burst of failures as large as the calls in flight is covered: with calls of latency L at
//!   rate r there are r x L in flight, and the budget holds ratio x r x window of them, all of
//!   them as long as L <= ratio x window (2 s with the defaults), plus the fixed allowance.
//! - A sustained failure cannot multiply the load by `max_attempts`: over a long failure the
//!   attempts are at most (1 + ratio) x the requests, plus `min_per_second`.
//!
//! The window is kept as `SLOTS` slots of `window / SLOTS` each with running sums, so a
//! deposit or withdrawal costs a few additions (expired slots are dropped when time moves on).

use std::time::Duration;

use tokio::time::Instant;

/// Tuning of the retry budget (Finagle's and Linkerd's defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct RetryBudgetConfig {
    /// Retries allowed per original request within `window` (Finagle's `percentCanRetry`,
    /// Linkerd's `retryRatio`).
    pub ratio: f64,
    /// Retries allowed per second whatever the traffic (`minRetriesPerSec`), so a quiet
    /// Service can still retry.
    pub min_per_second: u32,
    /// How long a request's deposit and a retry's withdrawal count (`ttl`).
    pub window: Duration,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        Self {
            ratio: 0.2,
            min_per_second: 10,
            window: Duration::from_secs(10),
        }
    }
}

/// Slots per window: deposits expire in steps of a tenth of the window.
const SLOTS: usize = 10;

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    requests: u64,
    retries: u64,
}

/// One balancer's retry budget (owned by the pool, behind its lock).
#[derive(Debug)]
pub(crate) struct RetryBudget {
    config: RetryBudgetConfig,
    slot_len: Duration,
    slots: [Slot; SLOTS],
    /// Index of the slot that starts at `current_start`.
    current: usize,
    current_start: Instant,
    /// Sums over the slots.
    requests: u64,
    retries: u64,
}

impl RetryBudget {
    pub(crate) fn new(config: RetryBudgetConfig, now: Instant) -> Self {
        let slot_len = slot_len(&config);
        Self {
            config,
            slot_len,
            slots: [Slot::default(); SLOTS],
            current: 0,
            current_start: now,
            requests: 0,
            retries: 0,
        }
    }

    /// Applies new tuning. The history is kept when the window stays the same; a new window
    /// starts empty (the fixed allowance still applies).
    pub(crate) fn set_config(&mut self, config: RetryBudgetConfig, now: Instant) {
        if config.window == self.config.window {
            self.config = config;
        } else {
            *self = Self::new(config, now);
        }
    }

    /// Moves the window to `now`, dropping the slots that have expired.
    fn advance(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.current_start);
        if elapsed < self.slot_len {
            return;
        }
        let steps = elapsed.as_nanos() / self.slot_len.as_nanos().max(1);
        if steps >= SLOTS as u128 {
            self.slots = [Slot::default(); SLOTS];
            self.requests = 0;
            self.retries = 0;
            self.current_start = now;
            return;
        }
        // steps < SLOTS: fits.
        let steps = steps as u32;
        for _ in 0..steps {
            self.current = (self.current + 1) % SLOTS;
            let old = std::mem::take(&mut self.slots[self.current]);
            self.requests -= old.requests;
            self.retries -= old.retries;
        }
        self.current_start += self.slot_len * steps;
    }

    /// Retries the window allows in all: the traffic's share plus the fixed allowance.
    fn allowed(&self) -> f64 {
        #[expect(
            clippy::cast_precision_loss,
            reason = "request counts far below 2^52 within one window"
        )]
        let share = self.config.ratio * self.requests as f64;
        share + f64::from(self.config.min_per_second) * self.config.window.as_secs_f64()
    }

    /// One original request.
    pub(crate) fn deposit(&mut self, now: Instant) {
        self.advance(now);
        self.slots[self.current].requests += 1;
        self.requests += 1;
    }

    /// Takes one retry, if the budget has one.
    pub(crate) fn withdraw(&mut self, now: Instant) -> bool {
        self.advance(now);
        #[expect(
            clippy::cast_precision_loss,
            reason = "retry counts far below 2^52 within one window"
        )]
        let spent = self.retries as f64;
        if spent + 1.0 > self.allowed() {
            return false;
        }
        self.slots[self.current].retries += 1;
        self.retries += 1;
        true
    }
}

fn slot_len(config: &RetryBudgetConfig) -> Duration {
    // A zero window would divide by zero: one millisecond at least.
    (config.window / SLOTS as u32).max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steady traffic at `rate` calls per second for `secs` seconds (paused time), then
    /// `in_flight` calls fail at once: how many of their retries the budget allows.
    async fn burst_covered(budget: &mut RetryBudget, rate: u32, secs: u32, in_flight: u32) -> u32 {
        let step = Duration::from_secs(1) / rate;
        for _ in 0..rate * secs {
            budget.deposit(Instant::now());
            tokio::time::advance(step).await;
        }
        let granted = (0..in_flight).filter(|_| budget.withdraw(Instant::now()));
        u32::try_from(granted.count()).expect("small")
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_burst_as_large_as_the_calls_in_flight_is_retried() {
        // 50 calls in flight (the mass-pod-loss scenario), at several rates: 2,000 calls/s of
        // 25 ms each, 100 calls/s of 500 ms each, 25 calls/s of 2 s each. Every one of them
        // fails at once after a few seconds of steady traffic, and every one may be retried.
        for (rate, in_flight) in [(2_000, 50), (100, 50), (25, 50), (2_000, 400)] {
            let mut budget = RetryBudget::new(RetryBudgetConfig::default(), Instant::now());
            let allowed = burst_covered(&mut budget, rate, 3, in_flight).await;
            assert_eq!(
                allowed, in_flight,
                "{rate} calls/s: all {in_flight} failed calls in flight may be retried"
            );
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_sustained_failure_adds_at_most_the_ratio_plus_the_minimum() {
        // Every attempt fails for 60 s at 1,000 calls/s, and each call would try up to 3
        // times: without a budget that is 3x the load.
        let config = RetryBudgetConfig::default();
        let mut budget = RetryBudget::new(config.clone(), Instant::now());
        let (rate, secs, max_attempts) = (1_000u32, 60u32, 3u32);
        let step = Duration::from_secs(1) / rate;
        let mut attempts = 0u64;
        for _ in 0..rate * secs {
            budget.deposit(Instant::now());
            attempts += 1;
            for _ in 1..max_attempts {
                if !budget.withdraw(Instant::now()) {
                    break;
                }
                attempts += 1;
            }
            tokio::time::advance(step).await;
        }
        let requests = u64::from(rate * secs);
        // ratio x requests, min_per_second for every second, and one window's allowance
        // spent up front.
        let bound = requests
            + (config.ratio * requests as f64) as u64
            + u64::from(config.min_per_second) * u64::from(secs)
            + u64::from(config.min_per_second) * config.window.as_secs();
        assert!(
            attempts <= bound,
            "attempts {attempts} stay within {bound} for {requests} requests"
        );
        let load = attempts as f64 / requests as f64;
        assert!(
            load < 1.25,
            "a sustained failure raises the load by the ratio, not by max_attempts: {load:.3}x"
        );
        // And the budget is used: the retries are not just refused.
        assert!(load > 1.15, "the ratio's retries are granted: {load:.3}x");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn deposits_and_withdrawals_expire_after_the_window() {
        let config = RetryBudgetConfig {
            ratio: 0.5,
            min_per_second: 0,
            window: Duration::from_secs(10),
        };
        let mut budget = RetryBudget::new(config, Instant::now());
        for _ in 0..10 {
            budget.deposit(Instant::now());
        }
        let granted = (0..10).filter(|_| budget.withdraw(Instant::now())).count();
        assert_eq!(granted, 5, "half a retry per request");
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(
            !budget.withdraw(Instant::now()),
            "within the window the spent retries still count"
        );
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(
            !budget.withdraw(Instant::now()),
            "after the window the deposits are gone too"
        );
        for _ in 0..2 {
            budget.deposit(Instant::now());
        }
        assert!(
            budget.withdraw(Instant::now()),
            "new traffic, new retries: the old withdrawals expired with the old deposits"
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_quiet_service_still_gets_the_minimum() {
        let mut budget = RetryBudget::new(RetryBudgetConfig::default(), Instant::now());
        let granted = (0..200).filter(|_| budget.withdraw(Instant::now())).count();
        assert_eq!(
            granted, 100,
            "10 per second over the 10 s window, no traffic needed"
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        let granted = (0..200).filter(|_| budget.withdraw(Instant::now())).count();
        assert_eq!(granted, 0, "spent retries count for the whole window");
        tokio::time::advance(Duration::from_secs(10)).await;
        let granted = (0..200).filter(|_| budget.withdraw(Instant::now())).count();
        assert_eq!(granted, 100, "and come back after it");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_new_window_starts_over_and_other_tuning_keeps_the_history() {
        let mut budget = RetryBudget::new(RetryBudgetConfig::default(), Instant::now());
        for _ in 0..1000 {
            budget.deposit(Instant::now());
        }
        let lower_minimum = RetryBudgetConfig {
            min_per_second: 0,
            ..RetryBudgetConfig::default()
        };
        budget.set_config(lower_minimum.clone(), Instant::now());
        let granted = (0..1000)
            .filter(|_| budget.withdraw(Instant::now()))
            .count();
        assert_eq!(granted, 200, "the deposits stay: 0.2 x 1000");
        budget.set_config(
            RetryBudgetConfig {
                window: Duration::from_secs(5),
                ..lower_minimum
            },
            Instant::now(),
        );
        assert!(
            !budget.withdraw(Instant::now()),
            "a new window starts empty"
        );
    }

    /// One step of a traffic trace: time moves on, requests arrive, retries are asked for.
    #[derive(Debug, Clone)]
    struct Step {
        advance_ms: u64,
        deposits: u32,
        withdrawals: u32,
    }

    fn arb_trace() -> impl Strategy<Value = Vec<Step>> {
        prop::collection::vec(
            (0u64..1_500, 0u32..40, 0u32..40).prop_map(|(advance_ms, deposits, withdrawals)| {
                Step {
                    advance_ms,
                    deposits,
                    withdrawals,
                }
            }),
            1..200,
        )
    }

    use proptest::prelude::*;

    proptest! {
        /// Whatever the traffic, whenever a retry is granted, the retries granted within the
        /// window before it (less one slot, the granularity of expiry) stay within `ratio` of
        /// the requests of that window plus the fixed allowance.
        #[test]
        fn retries_never_exceed_the_ratio_of_the_window_plus_the_minimum(
            trace in arb_trace(),
            ratio in 0.0f64..1.0,
            min_per_second in 0u32..5,
            window_s in 1u64..20,
        ) {
            let config = RetryBudgetConfig {
                ratio,
                min_per_second,
                window: Duration::from_secs(window_s),
            };
            let window = config.window;
            let kept = window - slot_len(&config);
            let start = Instant::now();
            let mut budget = RetryBudget::new(config.clone(), start);
            let (mut now, mut deposits, mut grants) = (start, Vec::new(), Vec::new());
            for step in &trace {
                now += Duration::from_millis(step.advance_ms);
                for _ in 0..step.deposits {
                    budget.deposit(now);
                    deposits.push(now);
                }
                let before = grants.len();
                for _ in 0..step.withdrawals {
                    if budget.withdraw(now) {
                        grants.push(now);
                    }
                }
                if grants.len() == before {
                    continue;
                }
                let granted = grants.iter().filter(|t| now - **t < kept).count();
                let requests = deposits.iter().filter(|t| now - **t < window).count();
                #[expect(clippy::cast_precision_loss, reason = "small counts")]
                let bound = ratio * requests as f64
                    + f64::from(min_per_second) * window.as_secs_f64();
                #[expect(clippy::cast_precision_loss, reason = "small counts")]
                let granted_f = granted as f64;
                prop_assert!(
                    granted_f <= bound + 1e-9,
                    "{granted} retries granted within {kept:?}, bound {bound} ({requests} requests)"
                );
            }
        }
    }
}
