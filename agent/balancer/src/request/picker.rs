//! Picks the endpoint for each request: power of two choices over a peak-EWMA latency estimate
//! times the in-flight count (Linkerd's and Finagle's balancer), with one candidate drawn round
//! robin, latencies under `latency_floor` counted equal, and slow endpoints degraded to probes.
//!
//! Guarantees: an endpoint is degraded only against the median of its peers (everyone equally
//! slow degrades nobody), and at most half of the ready endpoints are out of use (degraded or
//! ejected) at once; a degraded endpoint keeps a probe trickle (one in flight at most); an
//! ejected one gets no user call until it has answered a PING or a new connection
//! ([`Picker::take_unproven`], [`Picker::proven`]), then probes. Load completes at the
//! response headers (the latency sample) and at the end of the response stream (the
//! in-flight count). Plain synchronous state: time and randomness are passed in. The
//! reasoning and the figures: docs/balancer.md, "Picking".

use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;

use crate::endpoints::{EndpointId, EndpointSet, Entry};
use crate::metrics::HistogramSnapshot;
use crate::request::config::PickerConfig;
use crate::request::status::{EndpointState, EndpointStats};

/// The result of a pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    /// The chosen endpoint.
    pub id: EndpointId,
    /// Whether this request is a probe of a degraded or ejected endpoint.
    pub probe: bool,
}

/// How a request ended, for passive health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The endpoint answered (any gRPC status but UNAVAILABLE).
    Success,
    /// The endpoint failed: transport error, reset, HTTP error, or gRPC UNAVAILABLE.
    Failure,
    /// The caller went away or the deadline passed; says nothing about the endpoint.
    Cancelled,
}

/// Whether an endpoint that is not ejected takes its share or only probes (not to be confused
/// with connection mode's rotations, which move client connections).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Standing {
    Active,
    Degraded {
        good_probes: u32,
    },
    /// Its ejection is over, but it has not answered anything since.
    Unproven,
}

/// Where an endpoint stands for the picker: its standing, unless passive health ejected it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Health {
    Active,
    Degraded { good_probes: u32 },
    Unproven,
    Ejected,
}

/// The picker's state of one endpoint: load, latency estimates and standing. It lives in the
/// endpoint set's per-endpoint value (see [`EndpointSet`]), which gives the picker the
/// endpoint's readiness, active health and passive ejection.
#[derive(Debug)]
pub struct Slot {
    /// Peak-EWMA latency in nanoseconds and when it was last updated.
    ewma: Option<(f64, Instant)>,
    /// Plain (not peak) EWMA of the latency, for the degraded reference.
    mean: Option<(f64, Instant)>,
    in_flight: u32,
    standing: Standing,
    /// Latency samples in a row above the degraded threshold.
    slow_samples: u32,
    /// When the current run of slow samples started.
    slow_since: Option<Instant>,
    probe_in_flight: bool,
    next_probe_at: Instant,
    requests: u64,
    failures: u64,
    probes: u64,
}

impl Slot {
    /// A new endpoint's state: active, with no latency known yet.
    #[must_use]
    pub fn new(now: Instant) -> Self {
        Self {
            ewma: None,
            mean: None,
            in_flight: 0,
            standing: Standing::Active,
            slow_samples: 0,
            slow_since: None,
            probe_in_flight: false,
            next_probe_at: now,
            requests: 0,
            failures: 0,
            probes: 0,
        }
    }
}

impl AsRef<Slot> for Slot {
    fn as_ref(&self) -> &Slot {
        self
    }
}

impl AsMut<Slot> for Slot {
    fn as_mut(&mut self) -> &mut Slot {
        self
    }
}

/// `d` in nanoseconds as `f64`, exactly `d.as_nanos() as f64`: the estimates are kept in
/// nanoseconds, and converting the `u128` of `as_nanos` is a software routine (`__floattidf`,
/// ~45 instructions, about 13 times per request), while every duration here fits a `u64` of
/// nanoseconds (584 years), whose conversion is a few instructions and rounds the same integer
/// the same way.
fn nanos(d: Duration) -> f64 {
    d.as_secs()
        .checked_mul(1_000_000_000)
        .and_then(|n| n.checked_add(u64::from(d.subsec_nanos())))
        .map_or_else(|| d.as_nanos() as f64, |n| n as f64)
}

/// Endpoints whose latencies [`lower_median`] sorts on the stack; a larger set spills into a
/// `Vec`. Most Services have a handful of endpoints behind each node.
const MEDIAN_ON_STACK: usize = 16;

/// The lower median of `values` (the element at `(n - 1) / 2` in `f64::total_cmp` order), or
/// `None` when there is none. The reference latency is taken on every latency sample, i.e.
/// about once per request: up to [`MEDIAN_ON_STACK`] values it allocates nothing.
fn lower_median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut stack = [0.0; MEDIAN_ON_STACK];
    let mut spilled: Vec<f64> = Vec::new();
    let mut n = 0;
    for v in values {
        if n < MEDIAN_ON_STACK {
            stack[n] = v;
        } else {
            if spilled.is_empty() {
                spilled.extend_from_slice(&stack);
            }
            spilled.push(v);
        }
        n += 1;
    }
    let v = if n <= MEDIAN_ON_STACK {
        &mut stack[..n]
    } else {
        &mut spilled[..]
    };
    if v.is_empty() {
        return None;
    }
    // Values equal under `total_cmp` have the same bits: an unstable sort gives the same order.
    v.sort_unstable_by(f64::total_cmp);
    Some(v[(n - 1) / 2])
}

fn slot<S: AsRef<Slot>>(e: &Entry<S>) -> &Slot {
    e.value.as_ref()
}

fn health<S: AsRef<Slot>>(e: &Entry<S>) -> Health {
    if e.ejection.is_ejected() {
        return Health::Ejected;
    }
    match slot(e).standing {
        Standing::Active => Health::Active,
        Standing::Degraded { good_probes } => Health::Degraded { good_probes },
        Standing::Unproven => Health::Unproven,
    }
}

/// Per-request endpoint choice over an endpoint set. See the module docs.
#[derive(Debug)]
pub struct Picker<R> {
    config: PickerConfig,
    cursor: usize,
    rng: R,
    total_requests: u64,
    /// Endpoints ejected since the picker started (for metrics).
    ejections: u64,
    /// Endpoints whose ejection ended since the owner last looked: each needs a probe that is
    /// not a user's call.
    unproven: Vec<EndpointId>,
}

impl<R: Rng> Picker<R> {
    /// A picker; the endpoints are the set each call is given.
    pub fn new(config: PickerConfig, rng: R) -> Self {
        Self {
            config,
            cursor: 0,
            rng,
            total_requests: 0,
            ejections: 0,
            unproven: Vec::new(),
        }
    }

    /// Endpoints ejected for failing since the picker started.
    #[must_use]
    pub fn ejections(&self) -> u64 {
        self.ejections
    }

    /// Replaces the tuning. Every decision from now on uses it; what was learned (latency
    /// estimates, degraded and ejected endpoints) is kept.
    pub fn set_config(&mut self, config: PickerConfig) {
        self.config = config;
    }

    /// A uniform number in [0, 1) from the picker's RNG (shared so one seed makes a whole
    /// balancer deterministic).
    pub fn random_unit(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    fn floor_ns(&self) -> f64 {
        nanos(self.config.latency_floor)
    }

    /// The latency estimate used for comparisons: unknown and sub-floor latencies are the floor,
    /// and the estimate decays toward the floor while no sample arrives (as tower's `PeakEwma`
    /// decays toward zero), so an endpoint with a stale high estimate is sampled again instead
    /// of being starved.
    fn latency_ns(&self, s: &Slot, now: Instant) -> f64 {
        let floor = self.floor_ns();
        match s.ewma {
            Some((v, at)) if v > floor => {
                let idle = nanos(now.saturating_duration_since(at));
                floor + (v - floor) * (-idle / nanos(self.config.decay)).exp()
            }
            _ => floor,
        }
    }

    fn cost(&self, s: &Slot, now: Instant) -> f64 {
        self.latency_ns(s, now) * f64::from(s.in_flight + 1)
    }

    /// Chooses the endpoint of `set` for one request, skipping `exclude` (endpoints a retry
    /// already tried), and counts it in flight. `None` when no endpoint is ready.
    pub fn pick<S: AsRef<Slot> + AsMut<Slot>>(
        &mut self,
        set: &mut EndpointSet<S>,
        now: Instant,
        exclude: &[EndpointId],
    ) -> Option<Pick> {
        self.expire_ejections(set, now);
        let pick = match self.due_probe(set, now, exclude) {
            Some(id) => Pick { id, probe: true },
            None => match self.p2c(set, exclude, now) {
                Some(id) => Pick { id, probe: false },
                None => Pick {
                    id: self.fallback(set, exclude, now)?,
                    probe: false,
                },
            },
        };
        self.total_requests += 1;
        let interval = self.config.probe_interval;
        let s = set.get_mut(pick.id)?.value.as_mut();
        s.in_flight += 1;
        s.requests += 1;
        if pick.probe {
            s.probe_in_flight = true;
            s.probes += 1;
            // Also spaces probes when the probe never completes normally.
            s.next_probe_at = now + interval;
        }
        Some(pick)
    }

    fn expire_ejections<S: AsMut<Slot>>(&mut self, set: &mut EndpointSet<S>, now: Instant) {
        for e in set {
            let id = e.id();
            let (endpoint, ejection, value) = e.split_mut();
            if ejection.expire(now) {
                tracing::debug!(addr = %endpoint.addr, name = %endpoint.name, "ejection over, asking for proof of life");
                value.as_mut().standing = Standing::Unproven;
                self.unproven.push(id);
            }
        }
    }

    /// The endpoints whose ejection has ended since the last call: each should be probed with
    /// something that is not a user's call, and [`Picker::proven`] called when it answers.
    pub fn take_unproven(&mut self) -> Vec<EndpointId> {
        std::mem::take(&mut self.unproven)
    }

    /// Whether [`Picker::take_unproven`] has anything.
    #[must_use]
    pub fn has_unproven(&self) -> bool {
        !self.unproven.is_empty()
    }

    /// Endpoint `id` answered something that is not a user's call (a PING, a new connection).
    /// If its ejection is over, it leaves the ejected state and is probed with calls like a
    /// degraded endpoint (one at a time; two good ones bring it back): traffic returns
    /// gradually. Does nothing to an endpoint that is still ejected or was never out.
    pub fn proven<S: AsMut<Slot>>(
        &mut self,
        set: &mut EndpointSet<S>,
        id: EndpointId,
        now: Instant,
    ) {
        let Some(e) = set.get_mut(id) else { return };
        let (endpoint, ejection, value) = e.split_mut();
        let s = value.as_mut();
        if ejection.expire(now) {
            s.standing = Standing::Unproven;
        }
        if ejection.is_ejected() || s.standing != Standing::Unproven {
            return;
        }
        tracing::debug!(addr = %endpoint.addr, name = %endpoint.name, "ejected endpoint answered, probing it with calls");
        s.standing = Standing::Degraded { good_probes: 0 };
        s.next_probe_at = now;
    }

    /// A connection to endpoint `id` is dead (a PING went unanswered): the endpoint is ejected
    /// at once, whatever the share of endpoints out of rotation (a dead connection takes no
    /// calls anyway), for the next ejection time of its backoff.
    pub fn connection_dead<S: AsMut<Slot>>(
        &mut self,
        set: &mut EndpointSet<S>,
        id: EndpointId,
        now: Instant,
    ) {
        let (threshold, backoff) = (self.config.failure_threshold, self.config.ejection_backoff);
        let Some(e) = set.get_mut(id) else { return };
        let (endpoint, ejection, _) = e.split_mut();
        if let Some(time) = ejection.record_failure(now, threshold, backoff, true, true) {
            self.ejections += 1;
            tracing::info!(
                addr = %endpoint.addr, name = %endpoint.name,
                ejection_ms = time.as_millis(),
                "endpoint ejected: connection dead"
            );
        }
    }

    fn due_probe<S: AsRef<Slot>>(
        &self,
        set: &EndpointSet<S>,
        now: Instant,
        exclude: &[EndpointId],
    ) -> Option<EndpointId> {
        set.iter()
            .find(|e| {
                let s = slot(e);
                e.usable()
                    && matches!(health(e), Health::Degraded { .. })
                    && !s.probe_in_flight
                    && s.next_probe_at <= now
                    && !exclude.contains(&e.id())
            })
            .map(Entry::id)
    }

    fn p2c<S: AsRef<Slot>>(
        &mut self,
        set: &EndpointSet<S>,
        exclude: &[EndpointId],
        now: Instant,
    ) -> Option<EndpointId> {
        // Counted, then walked again to the two chosen: no list of the active endpoints is
        // allocated per request (a few comparisons per endpoint against a malloc, a grow and
        // a free).
        let active = || {
            set.iter()
                .filter(|e| e.usable() && health(e) == Health::Active && !exclude.contains(&e.id()))
        };
        match active().count() {
            0 => None,
            1 => active().next().map(Entry::id),
            n => {
                let rr = self.cursor % n;
                self.cursor = self.cursor.wrapping_add(1);
                let mut other = self.rng.random_range(0..n - 1);
                if other >= rr {
                    other += 1;
                }
                let (a, b) = (active().nth(rr)?, active().nth(other)?);
                if self.cost(slot(b), now) * self.config.tie_ratio < self.cost(slot(a), now) {
                    Some(b.id())
                } else {
                    Some(a.id())
                }
            }
        }
    }

    /// Nothing active is ready: rather than fail, use the cheapest ready endpoint, degraded or
    /// even ejected (fail open; a retry elsewhere is not possible anyway).
    fn fallback<S: AsRef<Slot>>(
        &self,
        set: &EndpointSet<S>,
        exclude: &[EndpointId],
        now: Instant,
    ) -> Option<EndpointId> {
        set.iter()
            .filter(|e| e.usable() && !exclude.contains(&e.id()))
            .min_by(|a, b| {
                let rank = |e: &Entry<S>| {
                    u8::from(matches!(health(e), Health::Ejected | Health::Unproven))
                };
                rank(a)
                    .cmp(&rank(b))
                    .then(self.cost(slot(a), now).total_cmp(&self.cost(slot(b), now)))
            })
            .map(Entry::id)
    }

    /// Median of the mean latencies of the ready, non-ejected endpoints (the lower median, so
    /// with two endpoints the faster one is the reference). Means, not the peak estimates: under
    /// load every endpoint's peaks are inflated by queueing, and a reference made of peaks lets
    /// a slow endpoint pass as normal.
    fn reference_ns<S: AsRef<Slot>>(&self, set: &EndpointSet<S>) -> Option<f64> {
        let floor = self.floor_ns();
        lower_median(
            set.iter()
                .filter(|e| e.usable() && !matches!(health(e), Health::Ejected | Health::Unproven))
                .map(|e| slot(e).mean.map_or(floor, |(m, _)| m.max(floor))),
        )
    }

    fn threshold_ns<S: AsRef<Slot>>(&self, set: &EndpointSet<S>) -> Option<f64> {
        let r = self.reference_ns(set)?;
        Some((r * self.config.degraded_ratio).max(r + nanos(self.config.degraded_min_gap)))
    }

    /// Median latency estimate of the usable, active endpoints other than `id`.
    fn median_active_latency_ns<S: AsRef<Slot>>(
        &self,
        set: &EndpointSet<S>,
        id: EndpointId,
        now: Instant,
    ) -> Option<f64> {
        lower_median(
            set.iter()
                .filter(|e| e.id() != id && e.usable() && health(e) == Health::Active)
                .map(|e| self.latency_ns(slot(e), now)),
        )
    }

    /// Whether one more endpoint may leave the rotation: at least half of the ready endpoints
    /// must stay in it.
    fn may_take_out<S: AsRef<Slot>>(set: &EndpointSet<S>) -> bool {
        let ready = set.iter().filter(|e| e.usable()).count();
        let out = set
            .iter()
            .filter(|e| e.usable() && health(e) != Health::Active)
            .count();
        out < ready / 2
    }

    /// Records a latency sample (response headers arrived `rtt` after the request was sent).
    pub fn observe_latency<S: AsRef<Slot> + AsMut<Slot>>(
        &mut self,
        set: &mut EndpointSet<S>,
        id: EndpointId,
        probe: bool,
        rtt: Duration,
        now: Instant,
    ) {
        let decay = nanos(self.config.decay);
        let Some(e) = set.get_mut(id) else { return };
        let health = health(e);
        let s = e.value.as_mut();
        let rtt_ns = nanos(rtt);
        s.ewma = Some(match s.ewma {
            // Peak: a sample above the estimate replaces it at once, so a pod that slows down
            // is seen after one slow reply.
            Some((v, _)) if rtt_ns >= v => (rtt_ns, now),
            Some((v, at)) => {
                let elapsed = nanos(now.saturating_duration_since(at));
                let w = (-elapsed / decay).exp();
                (v * w + rtt_ns * (1.0 - w), now)
            }
            None => (rtt_ns, now),
        });
        s.mean = Some(match s.mean {
            Some((m, at)) => {
                let elapsed = nanos(now.saturating_duration_since(at));
                let w = (-elapsed / decay).exp();
                (m * w + rtt_ns * (1.0 - w), now)
            }
            None => (rtt_ns, now),
        });
        let Some(threshold) = self.threshold_ns(set) else {
            return;
        };
        // Only for a probe, which may bring the endpoint back: what a typical peer costs now.
        let peers_ns = (probe && matches!(health, Health::Degraded { .. }))
            .then(|| self.median_active_latency_ns(set, id, now))
            .flatten();
        let may_take_out = Self::may_take_out(set);
        let (recovery_probes, degraded_samples, degraded_after, interval, floor) = (
            self.config.recovery_probes,
            self.config.degraded_samples,
            self.config.degraded_after,
            self.config.probe_interval,
            self.floor_ns(),
        );
        let Some(e) = set.get_mut(id) else { return };
        let (endpoint, _, value) = e.split_mut();
        let s = value.as_mut();
        let slow = rtt_ns.max(floor) > threshold;
        if slow {
            s.slow_samples += 1;
            s.slow_since.get_or_insert(now);
        } else {
            s.slow_samples = 0;
            s.slow_since = None;
        }
        let slow_for = s
            .slow_since
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        match health {
            Health::Active => {
                // Several slow samples in a row, not one: a single hiccup (a fresh connection,
                // a descheduled thread) must not take a healthy pod out of rotation.
                // ... and for a while: when the whole node stalls (CPU contention, a pause),
                // every endpoint's samples jump above the slowly moving reference at once;
                // such a stall is short, a slow pod is slow for good.
                if s.slow_samples >= degraded_samples && slow_for >= degraded_after && may_take_out
                {
                    tracing::info!(
                        addr = %endpoint.addr, name = %endpoint.name,
                        latency_ms = rtt_ns / 1e6, threshold_ms = threshold / 1e6,
                        "endpoint degraded"
                    );
                    s.standing = Standing::Degraded { good_probes: 0 };
                    s.next_probe_at = now + interval;
                }
            }
            Health::Degraded { good_probes } if probe => {
                if !slow {
                    let good_probes = good_probes + 1;
                    if good_probes >= recovery_probes {
                        tracing::info!(addr = %endpoint.addr, name = %endpoint.name, "endpoint recovered");
                        s.standing = Standing::Active;
                        // Start over from what the probes saw, not the stale peak; but no
                        // cheaper than the median active peer: a probe is one request on an
                        // idle endpoint, its peers' estimates carry the load's peaks, and a
                        // returning endpoint that looks cheaper than everyone draws a herd.
                        s.ewma = Some((peers_ns.map_or(rtt_ns, |p| p.max(rtt_ns)), now));
                        s.mean = Some((rtt_ns, now));
                    } else {
                        s.standing = Standing::Degraded { good_probes };
                    }
                } else {
                    s.standing = Standing::Degraded { good_probes: 0 };
                }
            }
            Health::Degraded { .. } | Health::Unproven | Health::Ejected => {}
        }
    }

    /// Ends a request picked by [`Picker::pick`]: releases its in-flight count and records its
    /// outcome for passive health.
    pub fn complete<S: AsRef<Slot> + AsMut<Slot>>(
        &mut self,
        set: &mut EndpointSet<S>,
        id: EndpointId,
        probe: bool,
        outcome: Outcome,
        now: Instant,
    ) {
        let may_take_out = Self::may_take_out(set);
        let (threshold, interval, backoff) = (
            self.config.failure_threshold,
            self.config.probe_interval,
            self.config.ejection_backoff,
        );
        let Some(e) = set.get_mut(id) else { return };
        let health = health(e);
        let (endpoint, ejection, value) = e.split_mut();
        let s = value.as_mut();
        s.in_flight = s.in_flight.saturating_sub(1);
        if probe {
            s.probe_in_flight = false;
            s.next_probe_at = now + interval;
        }
        match outcome {
            Outcome::Cancelled => {}
            Outcome::Success => ejection.record_success(health == Health::Active),
            Outcome::Failure => {
                s.failures += 1;
                if let Health::Degraded { .. } = health {
                    s.standing = Standing::Degraded { good_probes: 0 };
                }
                // A failed probe after an ejection ejects again at once; otherwise it takes
                // `failure_threshold` failures in a row.
                let probing_after_ejection =
                    probe && ejection.was_ejected() && matches!(health, Health::Degraded { .. });
                let failures = ejection.consecutive_failures() + 1;
                if let Some(time) = ejection.record_failure(
                    now,
                    threshold,
                    backoff,
                    probing_after_ejection,
                    may_take_out || health != Health::Active,
                ) {
                    self.ejections += 1;
                    tracing::info!(
                        addr = %endpoint.addr, name = %endpoint.name,
                        failures, ejection_ms = time.as_millis(),
                        "endpoint ejected"
                    );
                }
            }
        }
    }

    /// Per-endpoint statistics of `set`.
    #[must_use]
    pub fn stats<S: AsRef<Slot>>(&self, set: &EndpointSet<S>) -> Vec<EndpointStats> {
        let total = self.total_requests.max(1) as f64;
        set.iter()
            .map(|e| {
                let s = slot(e);
                EndpointStats {
                    addr: e.endpoint().addr,
                    name: e.endpoint().name.clone(),
                    state: match (e.ready(), health(e)) {
                        (false, _) => EndpointState::Connecting,
                        (true, _) if !e.serving() => EndpointState::NotServing,
                        (true, Health::Active) => EndpointState::Active,
                        (true, Health::Degraded { .. }) => EndpointState::Degraded,
                        // Out until it answers a probe that is not a user's call.
                        (true, Health::Ejected | Health::Unproven) => EndpointState::Ejected,
                    },
                    requests: s.requests,
                    failures: s.failures,
                    probes: s.probes,
                    in_flight: s.in_flight,
                    share: s.requests as f64 / total,
                    latency: s.ewma.map(|(v, _)| Duration::from_nanos(v as u64)),
                    // The pool fills these in: they are its, not the picker's.
                    upstream_connections: 0,
                    latency_histogram: HistogramSnapshot::default(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    //! Deterministic tests: a discrete-event simulation drives the picker with a virtual clock
    //! and a seeded RNG, so shares and timings are exact and repeatable (no wall time).

    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    use rand::SeedableRng as _;
    use rand::rngs::SmallRng;

    use std::net::SocketAddr;

    use super::*;

    proptest::proptest! {
        /// The allocation-free median is the sorted list's lower middle, bit for bit, on both
        /// sides of the stack buffer's size (NaNs and signed zeros included).
        #[test]
        fn lower_median_is_the_sorted_lists_lower_middle(values in proptest::collection::vec(proptest::prelude::any::<f64>(), 0..40)) {
            let mut sorted = values.clone();
            sorted.sort_by(f64::total_cmp);
            let want = (!sorted.is_empty()).then(|| sorted[(sorted.len() - 1) / 2].to_bits());
            proptest::prop_assert_eq!(lower_median(values.into_iter()).map(f64::to_bits), want);
        }

        /// The fast conversion is the `u128` one, bit for bit, over the whole `Duration` range.
        #[test]
        fn nanos_converts_exactly_as_the_u128_cast(secs in proptest::prelude::any::<u64>(), sub in 0u32..1_000_000_000, small in 0u64..1 << 40) {
            for d in [Duration::new(secs, sub), Duration::from_nanos(small), Duration::new(secs >> 20, sub)] {
                proptest::prop_assert_eq!(nanos(d).to_bits(), (d.as_nanos() as f64).to_bits(), "{:?}", d);
            }
        }
    }
    use crate::endpoints::Endpoint;
    use crate::endpoints::EndpointId as SlotId;

    /// The picker with the endpoint set it picks from, as the pool holds them, under the
    /// picker's former interface (the tests predate the endpoint set).
    struct Picker<R> {
        picker: super::Picker<R>,
        set: EndpointSet<Slot>,
    }

    impl<R: Rng> Picker<R> {
        fn new(config: PickerConfig, rng: R) -> Self {
            Self {
                picker: super::Picker::new(config, rng),
                set: EndpointSet::new(),
            }
        }

        fn insert(&mut self, id: SlotId, addr: SocketAddr, name: String, now: Instant) {
            let mut listed: Vec<Endpoint> = self.set.iter().map(|e| e.endpoint().clone()).collect();
            listed.push(Endpoint::new(addr, name));
            let mut added = None;
            self.set.update(&listed, |id, _| {
                added = Some(id);
                Slot::new(now)
            });
            assert_eq!(added, Some(id), "ids are handed out in order");
        }

        fn set_ready(&mut self, id: SlotId, ready: bool) {
            self.set.set_ready(id, ready);
        }

        fn pick(&mut self, now: Instant, exclude: &[SlotId]) -> Option<Pick> {
            self.picker.pick(&mut self.set, now, exclude)
        }

        fn observe_latency(&mut self, id: SlotId, probe: bool, rtt: Duration, now: Instant) {
            self.picker
                .observe_latency(&mut self.set, id, probe, rtt, now);
        }

        fn complete(&mut self, id: SlotId, probe: bool, outcome: Outcome, now: Instant) {
            self.picker.complete(&mut self.set, id, probe, outcome, now);
        }

        fn stats(&self) -> Vec<EndpointStats> {
            self.picker.stats(&self.set)
        }

        fn take_unproven(&mut self) -> Vec<SlotId> {
            self.picker.take_unproven()
        }

        fn proven(&mut self, id: SlotId, now: Instant) {
            self.picker.proven(&mut self.set, id, now);
        }

        fn connection_dead(&mut self, id: SlotId, now: Instant) {
            self.picker.connection_dead(&mut self.set, id, now);
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn picker(n: usize, now: Instant) -> (Picker<SmallRng>, Vec<SlotId>) {
        let mut p = Picker::new(PickerConfig::default(), SmallRng::seed_from_u64(7));
        let ids: Vec<SlotId> = (0..n as u64).map(SlotId).collect();
        for (i, id) in ids.iter().enumerate() {
            let addr = SocketAddr::from(([127, 0, 0, 1], 9000 + i as u16));
            p.insert(*id, addr, format!("pod-{i}"), now);
            p.set_ready(*id, true);
        }
        (p, ids)
    }

    /// One completed request in the simulation.
    struct Done {
        endpoint: usize,
        at: Instant,
    }

    /// Closed loop: `concurrency` requests in flight at all times (like ghz -C 1 -c N), each
    /// taking `latency(endpoint, now, in_flight_at_endpoint)`. Returns every completion.
    fn closed_loop(
        n: usize,
        concurrency: usize,
        requests: usize,
        mut latency: impl FnMut(usize, Duration, u32) -> Duration,
    ) -> (Picker<SmallRng>, Vec<Done>, Vec<u32>) {
        let t0 = Instant::now();
        let (mut p, ids) = picker(n, t0);
        let mut in_flight = vec![0u32; n];
        let mut peak_in_flight = vec![0u32; n];
        let mut heap = BinaryHeap::new();
        let mut seq = 0u64;
        let mut issue = |p: &mut Picker<SmallRng>,
                         heap: &mut BinaryHeap<_>,
                         in_flight: &mut Vec<u32>,
                         now: Instant| {
            let pick = p.pick(now, &[]).expect("endpoints are ready");
            let i = ids.iter().position(|id| *id == pick.id).expect("known id");
            in_flight[i] += 1;
            peak_in_flight[i] = peak_in_flight[i].max(in_flight[i]);
            let rtt = latency(i, now - t0, in_flight[i]);
            seq += 1;
            heap.push(Reverse((now + rtt, seq, i, pick.probe, now)));
        };
        for _ in 0..concurrency {
            issue(&mut p, &mut heap, &mut in_flight, t0);
        }
        let mut done = Vec::with_capacity(requests);
        while done.len() < requests {
            let Reverse((at, _, i, probe, sent)) = heap.pop().expect("closed loop never empties");
            in_flight[i] -= 1;
            p.observe_latency(SlotId(i as u64), probe, at - sent, at);
            p.complete(SlotId(i as u64), probe, Outcome::Success, at);
            done.push(Done { endpoint: i, at });
            issue(&mut p, &mut heap, &mut in_flight, at);
        }
        (p, done, peak_in_flight)
    }

    /// A healthy pod: 1 ms plus a little queueing per request it already serves.
    fn healthy(in_flight: u32) -> Duration {
        Duration::from_micros(1000 + 20 * u64::from(in_flight))
    }

    fn share(done: &[Done], endpoint: usize) -> f64 {
        done.iter().filter(|d| d.endpoint == endpoint).count() as f64 / done.len() as f64
    }

    #[test]
    fn slow_pod_50ms_gets_under_one_percent() {
        let (_, done, _) = closed_loop(5, 200, 200_000, |i, _, f| {
            healthy(f) + if i == 4 { ms(50) } else { Duration::ZERO }
        });
        let s = share(&done, 4);
        assert!(
            s < 0.01,
            "a pod 50 ms slower must get < 1% of requests, got {:.3}%",
            s * 100.0
        );
        assert!(s > 0.0, "the slow pod must still get probes");
    }

    #[test]
    fn slow_pod_200ms_gets_under_a_tenth_of_a_percent() {
        let (_, done, _) = closed_loop(5, 200, 200_000, |i, _, f| {
            healthy(f) + if i == 2 { ms(200) } else { Duration::ZERO }
        });
        let s = share(&done, 2);
        assert!(
            s < 0.001,
            "a pod 200 ms slower must get < 0.1% of requests, got {:.4}%",
            s * 100.0
        );
        assert!(s > 0.0, "the slow pod must still get probes");
    }

    #[test]
    fn slow_pod_keeps_a_trickle_and_regains_fair_share_within_5s_without_herd() {
        let heal = ms(4_000);
        let (p, done, _) = closed_loop(5, 50, 500_000, |i, t, f| {
            healthy(f)
                + if i == 0 && t < heal {
                    ms(50)
                } else {
                    Duration::ZERO
                }
        });
        let t0 = done[0].at - ms(1);
        let end = done.last().expect("completions").at - t0;
        assert!(
            end > heal + ms(6_000),
            "simulation must run 6 s past the heal, ran {end:?}"
        );
        // Per-second windows.
        let window = |from: Duration| {
            let w: Vec<&Done> = done
                .iter()
                .filter(|d| d.at - t0 >= from && d.at - t0 < from + ms(1000))
                .collect();
            let slow = w.iter().filter(|d| d.endpoint == 0).count();
            (slow, w.len())
        };
        for s in 1..4 {
            let (slow, _) = window(ms(s * 1000));
            assert!(
                slow > 0,
                "second {s}: a slow pod must never be fully evicted"
            );
        }
        let (slow, all) = window(heal + ms(5_000));
        let s = slow as f64 / all as f64;
        assert!(
            (0.15..0.25).contains(&s),
            "5 s after healing the pod must be back to its fair 20% (no herd), got {:.1}%",
            s * 100.0
        );
        assert!(
            p.stats()[0].state == EndpointState::Active,
            "the healed pod is active"
        );
    }

    #[test]
    fn recovered_pod_is_not_herded() {
        // After the heal, the pod's in-flight count must stay near its fair share of 200/5.
        let heal = ms(3_000);
        let mut peak_after_heal = 0u32;
        let (_, _, _) = closed_loop(5, 200, 150_000, |i, t, f| {
            if i == 0 && t >= heal {
                peak_after_heal = peak_after_heal.max(f);
            }
            healthy(f)
                + if i == 0 && t < heal {
                    ms(200)
                } else {
                    Duration::ZERO
                }
        });
        assert!(
            peak_after_heal <= 60,
            "a recovered pod must not get a herd: in flight peaked at {peak_after_heal} (fair 40)"
        );
    }

    #[test]
    fn equally_slow_pods_are_not_degraded() {
        let (p, done, _) = closed_loop(5, 200, 50_000, |_, _, f| healthy(f) + ms(50));
        for st in p.stats() {
            assert_eq!(
                st.state,
                EndpointState::Active,
                "{} must stay in rotation",
                st.name
            );
        }
        for i in 0..5 {
            let s = share(&done, i);
            assert!(
                (0.17..0.23).contains(&s),
                "pod {i} must get ~20%, got {:.1}%",
                s * 100.0
            );
        }
    }

    #[test]
    fn sequential_calls_over_equal_pods_are_round_robin_even() {
        let t0 = Instant::now();
        let (mut p, ids) = picker(4, t0);
        let mut jitter = SmallRng::seed_from_u64(99);
        let mut now = t0;
        let mut counts = [0u32; 4];
        for _ in 0..200 {
            let pick = p.pick(now, &[]).expect("ready");
            let rtt = Duration::from_micros(jitter.random_range(150..900));
            now += rtt;
            p.observe_latency(pick.id, pick.probe, rtt, now);
            p.complete(pick.id, pick.probe, Outcome::Success, now);
            counts[ids.iter().position(|id| *id == pick.id).expect("known")] += 1;
        }
        for c in counts {
            assert!(
                (49..=51).contains(&c),
                "200 calls over 4 equal pods must be 50 +-1 each: {counts:?}"
            );
        }
    }

    #[test]
    fn failing_endpoint_is_ejected_then_probed_back() {
        let t0 = Instant::now();
        let (mut p, ids) = picker(4, t0);
        let bad = ids[1];
        let mut now = t0;
        // Only the bad endpoint fails; the others succeed.
        for _ in 0..40 {
            let pick = p.pick(now, &[]).expect("ready");
            now += ms(1);
            let outcome = if pick.id == bad {
                Outcome::Failure
            } else {
                Outcome::Success
            };
            p.observe_latency(pick.id, pick.probe, ms(1), now);
            p.complete(pick.id, pick.probe, outcome, now);
        }
        assert_eq!(
            p.stats()[1].state,
            EndpointState::Ejected,
            "5 failures in a row eject"
        );
        let before = p.stats()[1].requests;
        for _ in 0..100 {
            let pick = p.pick(now, &[]).expect("ready");
            assert_ne!(
                pick.id, bad,
                "an ejected endpoint gets no request during its ejection"
            );
            p.complete(pick.id, pick.probe, Outcome::Success, now);
        }
        assert_eq!(p.stats()[1].requests, before);
        now += ms(1001);
        let pick = p.pick(now, &[]).expect("ready");
        assert_ne!(
            pick.id, bad,
            "over its ejection time it is unproven: no user call yet"
        );
        p.complete(pick.id, pick.probe, Outcome::Success, now);
        assert_eq!(p.take_unproven(), [bad], "the owner is asked for a probe");
        p.proven(bad, now);
        let probe = p.pick(now, &[]).expect("ready");
        assert_eq!(
            probe,
            Pick {
                id: bad,
                probe: true
            },
            "once it answered the probe, it gets probe calls first"
        );
        now += ms(1);
        p.observe_latency(bad, true, ms(1), now);
        p.complete(bad, true, Outcome::Success, now);
        now += ms(201);
        let probe = p.pick(now, &[]).expect("ready");
        assert_eq!(
            probe,
            Pick {
                id: bad,
                probe: true
            },
            "a second probe after the interval"
        );
        p.observe_latency(bad, true, ms(1), now);
        p.complete(bad, true, Outcome::Success, now);
        assert_eq!(
            p.stats()[1].state,
            EndpointState::Active,
            "two good probes bring it back"
        );
    }

    #[test]
    fn an_ejected_endpoint_gets_no_user_call_until_it_answers_a_probe() {
        let t0 = Instant::now();
        let (mut p, ids) = picker(3, t0);
        let dead = ids[2];
        let mut now = t0;
        p.connection_dead(dead, now);
        assert_eq!(
            p.stats()[2].state,
            EndpointState::Ejected,
            "a dead connection ejects at once"
        );
        assert_eq!(p.picker.ejections(), 1);
        let step = |p: &mut Picker<SmallRng>, now: Instant| {
            let pick = p.pick(now, &[]).expect("ready");
            p.complete(pick.id, pick.probe, Outcome::Success, now);
            pick.id
        };
        // Its connection stays up (it looks ready), and its ejection ends after 1 s; for 10 s
        // it answers nothing.
        for _ in 0..1000 {
            now += ms(10);
            assert_ne!(
                step(&mut p, now),
                dead,
                "no user call before it answers a probe"
            );
        }
        assert_eq!(
            p.take_unproven(),
            [dead],
            "asked for a probe once, when the ejection ended"
        );
        assert!(p.take_unproven().is_empty());
        assert_eq!(p.stats()[2].state, EndpointState::Ejected, "still out");
        // Proof before the ejection is over counts for nothing: a second death ejects for 2 s.
        p.connection_dead(dead, now);
        p.proven(dead, now + ms(1999));
        assert_ne!(step(&mut p, now + ms(1999)), dead);
        // It answers once the ejection is over: probe calls, then back in rotation.
        now += ms(2000);
        p.proven(dead, now);
        for i in 0..2 {
            let probe = p.pick(now, &[]).expect("ready");
            assert_eq!(
                probe,
                Pick {
                    id: dead,
                    probe: true
                },
                "probe call {i} after the proof"
            );
            p.observe_latency(dead, true, ms(1), now);
            p.complete(dead, true, Outcome::Success, now);
            now += ms(201);
        }
        assert_eq!(
            p.stats()[2].state,
            EndpointState::Active,
            "two good probes bring it back"
        );
        assert_eq!(p.picker.ejections(), 2);
    }

    #[test]
    fn never_more_than_half_are_taken_out() {
        let t0 = Instant::now();
        let (mut p, _) = picker(4, t0);
        let mut now = t0;
        // Every endpoint fails every request.
        for _ in 0..400 {
            let pick = p.pick(now, &[]).expect("a ready endpoint is always picked");
            now += ms(1);
            p.complete(pick.id, pick.probe, Outcome::Failure, now);
        }
        let out = p
            .stats()
            .iter()
            .filter(|s| s.state != EndpointState::Active)
            .count();
        assert!(
            out <= 2,
            "at most half of 4 endpoints may be out of rotation, {out} were"
        );
    }

    #[test]
    fn retry_excludes_the_tried_endpoint() {
        let t0 = Instant::now();
        let (mut p, ids) = picker(2, t0);
        for _ in 0..10 {
            let pick = p.pick(t0, &[ids[0]]).expect("the other one");
            assert_eq!(pick.id, ids[1]);
            p.complete(pick.id, false, Outcome::Cancelled, t0);
        }
        assert_eq!(p.pick(t0, &ids), None, "nothing left to try");
    }

    #[test]
    fn not_ready_endpoints_are_not_picked() {
        let t0 = Instant::now();
        let (mut p, ids) = picker(3, t0);
        p.set_ready(ids[0], false);
        p.set_ready(ids[2], false);
        for _ in 0..10 {
            assert_eq!(p.pick(t0, &[]).map(|k| k.id), Some(ids[1]));
        }
        p.set_ready(ids[1], false);
        assert_eq!(p.pick(t0, &[]), None);
    }
}
