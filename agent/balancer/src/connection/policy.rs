//! Connection mode's rotation policy: given each backend's recent requests and each open
//! connection's request rate, decide whether one connection should be rotated (the graceful
//! two-phase GOAWAY, so its client reconnects and is placed again), and which.
//!
//! Guarantees: a rotation happens only while both the window skew (over [`WINDOW`]) and the
//! live skew (the current placement) exceed the threshold and have for the hold time; every
//! planned move leaves its target below where its source was (the sum of squared loads
//! strictly drops: no ping-pong), and a plan is acted on only if it gains [`MIN_GAIN`], down
//! to [`PLAN_BAND`] under the threshold; connections younger than `min_connection_age` or
//! whose client cannot survive a GOAWAY are never rotated; at most `max_rotations_per_minute`
//! in any 60 s. [`Evaluation::wake`] says when the outcome can change without new traffic.
//! Rotations for other reasons (backend leaving or NOT_SERVING, max age, drain, idle) are not
//! the policy's. Pure logic: time and randomness are passed in. The design:
//! docs/connection-mode.md, "When and which connections rotate".

use std::collections::VecDeque;
use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;

use crate::endpoints::EndpointId;

/// How far back the window skew looks.
pub const WINDOW: Duration = Duration::from_secs(30);
/// How far under the threshold a plan goes, as a share of the threshold's excess over even
/// (1.0): a threshold of 1.5 plans to 1.45. A band, so that request rates drifting a little
/// after the moves (clients slow down and speed up, more so on a loaded machine) do not put
/// the skew straight back at the threshold; rotation still starts only above the threshold.
pub const PLAN_BAND: f64 = 0.9;
/// Smallest relative drop of the live skew a rotation must bring.
pub const MIN_GAIN: f64 = 0.01;
/// The period the rotation budget counts over.
const MINUTE: Duration = Duration::from_secs(60);

/// Tuning of the rotation policy (the Service's annotations, and one internal guard).
#[derive(Debug, Clone, PartialEq)]
pub struct RotationConfig {
    /// Rotate when the skew (largest share / fair share) is above this...
    pub skew_threshold: f64,
    /// ... for this long.
    pub hold_time: Duration,
    /// Most skew rotations in any minute; 0 turns skew rotation off.
    pub max_rotations_per_minute: u32,
    /// Connections younger than this are never rotated for skew.
    pub min_connection_age: Duration,
}

impl Default for RotationConfig {
    fn default() -> Self {
        Self {
            skew_threshold: 1.5,
            hold_time: Duration::from_secs(30),
            max_rotations_per_minute: 6,
            min_connection_age: Duration::from_secs(10),
        }
    }
}

/// Identifies one relayed connection for the lifetime of its balancer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// A backend as the policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendLoad {
    pub id: EndpointId,
    /// May take new connections (listed, serving, not ejected).
    pub usable: bool,
    /// Requests its connections carried in the last [`WINDOW`].
    pub window_requests: u64,
}

/// An open connection as the policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnLoad {
    pub id: ConnId,
    pub backend: EndpointId,
    /// Recent requests per second.
    pub rate: f64,
    /// Time since it was placed.
    pub age: Duration,
    /// Its client fails calls on a GOAWAY: never rotated for skew.
    pub unrotatable: bool,
    /// Already told to rotate (for any reason).
    pub rotating: bool,
}

/// Where a Service stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyState {
    /// No traffic in the window, or no ready backend.
    Idle,
    /// Skew under the threshold.
    Balanced,
    /// Skew above the threshold, not for `hold_time` yet.
    Holding,
    /// A connection is rotated now.
    Rotating,
    /// Skew above the threshold, but the budget makes the next rotation wait, or every move
    /// that lowers it needs a connection younger than `min_connection_age`.
    Waiting,
    /// Skew above the threshold and no move of a rotatable connection lowers it: as even as
    /// connection mode can be.
    AsEvenAsPossible,
    /// Skew rotation is off (`max_rotations_per_minute: 0`).
    Disabled,
}

/// One evaluation's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    pub state: PolicyState,
    /// Window skew (0 without traffic).
    pub skew: f64,
    /// Live skew of the current placement (0 without traffic).
    pub live_skew: f64,
    /// The connection to rotate now, and the live skew expected once it and the rotations
    /// planned after it have moved.
    pub rotate: Option<(ConnId, f64)>,
    /// When to evaluate again even without new traffic: the hold ends (`Holding`), a budget
    /// slot frees or a young connection a move needs reaches the minimum age (`Waiting`).
    pub wake: Option<Instant>,
}

/// The rotation policy of one Service (see the module docs).
#[derive(Debug)]
pub struct RotationPolicy {
    config: RotationConfig,
    /// When both skews went above the threshold, and the hold drawn then.
    above: Option<(Instant, Duration)>,
    /// Skew rotations whose budget slot is still taken: (when it started, when its slot
    /// frees: 60 s to 66 s later).
    recent: VecDeque<(Instant, Instant)>,
}

impl RotationPolicy {
    #[must_use]
    pub fn new(config: RotationConfig) -> Self {
        Self {
            config,
            above: None,
            recent: VecDeque::new(),
        }
    }

    /// Applies new tuning; a hold under way and the rotations of the last minute count on.
    pub fn set_config(&mut self, config: RotationConfig) {
        if config.hold_time != self.config.hold_time {
            self.above = None;
        }
        self.config = config;
    }

    #[must_use]
    pub fn config(&self) -> &RotationConfig {
        &self.config
    }

    /// Skew rotations in the 60 s up to `now`.
    #[must_use]
    pub fn rotations_last_minute(&self, now: Instant) -> usize {
        self.recent
            .iter()
            .filter(|(at, _)| now.saturating_duration_since(*at) < MINUTE)
            .count()
    }

    /// Decides what to do at `now`. A returned rotation counts against the budget: the caller
    /// must start it, and evaluates again at the same `now` with that connection `rotating`
    /// until no rotation is returned: that is how the plan's rotations start together.
    pub fn evaluate(
        &mut self,
        now: Instant,
        backends: &[BackendLoad],
        conns: &[ConnLoad],
        rng: &mut impl Rng,
    ) -> Evaluation {
        self.recent.retain(|(_, frees)| *frees > now);
        let skew = window_skew(backends);
        let live = Live::new(backends, conns);
        let live_skew = live.skew();
        let mut eval = Evaluation {
            state: PolicyState::Balanced,
            skew,
            live_skew,
            rotate: None,
            wake: None,
        };
        if skew == 0.0 || live_skew == 0.0 {
            self.above = None;
            eval.state = PolicyState::Idle;
            return eval;
        }
        let threshold = self.config.skew_threshold;
        // A burst started at this instant goes on to the plan's target, under the threshold.
        let bursting = self.recent.back().is_some_and(|(at, _)| *at == now);
        let enough = if bursting {
            plan_target(threshold)
        } else {
            threshold
        };
        if skew <= threshold || live_skew <= enough {
            self.above = None;
            return eval;
        }
        if self.config.max_rotations_per_minute == 0 {
            eval.state = PolicyState::Disabled;
            return eval;
        }
        let hold_time = self.config.hold_time;
        let (since, hold) = *self
            .above
            .get_or_insert_with(|| (now, hold_time.mul_f64(rng.random_range(0.9..=1.1))));
        if now.saturating_duration_since(since) < hold {
            eval.state = PolicyState::Holding;
            eval.wake = Some(since + hold);
            return eval;
        }
        let min_age = self.config.min_connection_age;
        let Some((conn, after)) = live.next_move(conns, min_age, plan_target(threshold)) else {
            // A move that only waits for connections to reach the minimum age (the clients of
            // a scale-up or a rotation wave just connected) is not "as even as possible": say
            // Waiting, and evaluate again when the first of them is old enough.
            if live
                .next_move(conns, Duration::ZERO, plan_target(threshold))
                .is_some()
            {
                eval.state = PolicyState::Waiting;
                eval.wake = conns
                    .iter()
                    .filter(|c| !c.unrotatable && !c.rotating && c.rate > 0.0 && c.age < min_age)
                    .map(|c| now + (min_age - c.age))
                    .min();
                return eval;
            }
            eval.state = PolicyState::AsEvenAsPossible;
            return eval;
        };
        let budget = self.config.max_rotations_per_minute as usize;
        if self.recent.len() >= budget {
            eval.state = PolicyState::Waiting;
            eval.wake = self.recent.iter().map(|(_, frees)| *frees).min();
            return eval;
        }
        let frees = now + MINUTE.mul_f64(rng.random_range(1.0..=1.1));
        self.recent.push_back((now, frees));
        eval.state = PolicyState::Rotating;
        eval.rotate = Some((conn, after));
        eval
    }
}

/// The live skew a plan brings the placement under (see [`PLAN_BAND`]).
fn plan_target(threshold: f64) -> f64 {
    if threshold > 1.0 {
        1.0 + (threshold - 1.0) * PLAN_BAND
    } else {
        threshold
    }
}

/// Largest share of the window's requests / fair share over the usable backends; 0 without
/// requests or usable backends.
#[must_use]
pub fn window_skew(backends: &[BackendLoad]) -> f64 {
    let ready = backends.iter().filter(|b| b.usable).count();
    let total: u64 = backends.iter().map(|b| b.window_requests).sum();
    if ready == 0 || total == 0 {
        return 0.0;
    }
    let largest = backends
        .iter()
        .map(|b| b.window_requests)
        .max()
        .unwrap_or(0);
    largest as f64 / total as f64 * ready as f64
}

/// The live placement: each usable backend's load (requests per second of the connections
/// that stay on it, plus those in transit assigned where they will land).
struct Live {
    /// (backend, load), usable backends only, in the order given.
    loads: Vec<(EndpointId, f64)>,
}

impl Live {
    fn new(backends: &[BackendLoad], conns: &[ConnLoad]) -> Self {
        let mut loads: Vec<(EndpointId, f64)> = backends
            .iter()
            .filter(|b| b.usable)
            .map(|b| (b.id, 0.0))
            .collect();
        let mut transit: Vec<f64> = Vec::new();
        for c in conns {
            match loads.iter_mut().find(|(id, _)| *id == c.backend) {
                Some((_, load)) if !c.rotating => *load += c.rate,
                _ => transit.push(c.rate),
            }
        }
        // Largest first onto the least loaded: where placement by load puts reconnecting
        // clients.
        transit.sort_by(|a, b| b.total_cmp(a));
        for rate in transit {
            if let Some((_, load)) = loads.iter_mut().min_by(|a, b| a.1.total_cmp(&b.1)) {
                *load += rate;
            }
        }
        Self { loads }
    }

    fn skew(&self) -> f64 {
        skew_of(self.loads.iter().map(|(_, l)| *l))
    }

    /// The next rotation: the first move of the shortest greedy plan that brings the live
    /// skew to `target` (at most), with the skew at the plan's end. Each move takes a rotatable
    /// connection to the least-loaded other backend and must leave that backend below where
    /// the connection's backend was (so the sum of squared loads strictly drops: no sequence of
    /// moves can come back to where it started, whatever the clients do). The best move lowers
    /// the largest load most, then the sum of squares, then is the busiest connection. `None`
    /// when the plan's end is not [`MIN_GAIN`] below the current skew.
    fn next_move(
        &self,
        conns: &[ConnLoad],
        min_age: Duration,
        target: f64,
    ) -> Option<(ConnId, f64)> {
        let now = self.skew();
        let mut loads: Vec<f64> = self.loads.iter().map(|(_, l)| *l).collect();
        // (connection, index of its backend in `loads`, rate)
        let mut movable: Vec<(ConnId, usize, f64)> = conns
            .iter()
            .filter(|c| !c.unrotatable && !c.rotating && c.age >= min_age && c.rate > 0.0)
            .filter_map(|c| {
                let at = self.loads.iter().position(|(id, _)| *id == c.backend)?;
                Some((c.id, at, c.rate))
            })
            .collect();
        let mut first = None;
        let mut skew = now;
        while skew > target {
            let Some((k, to)) = best_step(&loads, &movable) else {
                break;
            };
            let (id, from, rate) = movable.swap_remove(k);
            loads[from] -= rate;
            loads[to] += rate;
            skew = skew_of(loads.iter().copied());
            first.get_or_insert(id);
        }
        let first = first?;
        (skew <= now * (1.0 - MIN_GAIN)).then_some((first, skew))
    }
}

/// The best single move over `loads` (see [`Live::next_move`]): (index in `movable`, index of
/// the target backend).
fn best_step(loads: &[f64], movable: &[(ConnId, usize, f64)]) -> Option<(usize, usize)> {
    let to = |from: usize| {
        (0..loads.len())
            .filter(|i| *i != from)
            .min_by(|a, b| loads[*a].total_cmp(&loads[*b]))
    };
    let max_of = |from: usize, to: usize, rate: f64| {
        loads
            .iter()
            .enumerate()
            .map(|(i, l)| {
                if i == from {
                    l - rate
                } else if i == to {
                    l + rate
                } else {
                    *l
                }
            })
            .fold(0.0, f64::max)
    };
    // (movable index, target, max after, sum of squares change, rate, id)
    let mut best: Option<(usize, usize, f64, f64, f64, ConnId)> = None;
    for (k, &(id, from, rate)) in movable.iter().enumerate() {
        let Some(t) = to(from) else { continue };
        // Strictly below where it came from: the sum of squares drops by 2 r (l_from - l_to - r).
        if loads[t] + rate >= loads[from] {
            continue;
        }
        let max = max_of(from, t, rate);
        let squares = 2.0 * rate * (loads[t] + rate - loads[from]);
        let better = best.is_none_or(|(_, _, bmax, bsq, brate, bid)| {
            (max, squares, -rate, id) < (bmax, bsq, -brate, bid)
        });
        if better {
            best = Some((k, t, max, squares, rate, id));
        }
    }
    best.map(|(k, t, ..)| (k, t))
}

/// Largest load / mean load; 0 when there is no load.
fn skew_of(loads: impl Iterator<Item = f64> + Clone) -> f64 {
    let n = loads.clone().count();
    let total: f64 = loads.clone().sum();
    if n == 0 || total <= 0.0 {
        return 0.0;
    }
    let largest = loads.fold(0.0, f64::max);
    largest * n as f64 / total
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::SeedableRng as _;
    use rand::rngs::SmallRng;

    use super::*;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn backend(id: u64, window_requests: u64) -> BackendLoad {
        BackendLoad {
            id: EndpointId(id),
            usable: true,
            window_requests,
        }
    }

    fn conn(id: u64, backend: u64, rate: f64) -> ConnLoad {
        ConnLoad {
            id: ConnId(id),
            backend: EndpointId(backend),
            rate,
            age: secs(600),
            unrotatable: false,
            rotating: false,
        }
    }

    /// Backends whose window holds what `conns` carried over the window at their rates.
    fn backends_for(n: u64, conns: &[ConnLoad]) -> Vec<BackendLoad> {
        (0..n)
            .map(|b| {
                let rate: f64 = conns
                    .iter()
                    .filter(|c| c.backend == EndpointId(b))
                    .map(|c| c.rate)
                    .sum();
                backend(b, (rate * WINDOW.as_secs_f64()) as u64)
            })
            .collect()
    }

    /// Evaluates every second until `limit` passes, at each second again after every rotation
    /// (as the controller does); moves each rotated connection to the least-loaded backend at
    /// once (as placement would) and returns when each rotated.
    fn run(
        policy: &mut RotationPolicy,
        t0: Instant,
        limit: Duration,
        n: u64,
        conns: &mut [ConnLoad],
        rng: &mut SmallRng,
    ) -> Vec<(Duration, ConnId)> {
        let mut rotations = Vec::new();
        let mut t = Duration::ZERO;
        while t <= limit {
            for _ in 0..=conns.len() {
                let backends = backends_for(n, conns);
                let eval = policy.evaluate(t0 + t, &backends, conns, rng);
                let Some((id, _)) = eval.rotate else { break };
                rotations.push((t, id));
                let loads: Vec<f64> = (0..n)
                    .map(|b| {
                        conns
                            .iter()
                            .filter(|c| c.backend == EndpointId(b) && c.id != id)
                            .map(|c| c.rate)
                            .sum()
                    })
                    .collect();
                let to = (0..n as usize)
                    .min_by(|a, b| loads[*a].total_cmp(&loads[*b]))
                    .expect("backends");
                let c = conns.iter_mut().find(|c| c.id == id).expect("rotated conn");
                c.backend = EndpointId(to as u64);
                c.age = Duration::ZERO;
            }
            for c in conns.iter_mut() {
                c.age += secs(1);
            }
            t += secs(1);
        }
        rotations
    }

    #[test]
    fn balanced_service_is_never_rotated() {
        let mut policy = RotationPolicy::new(RotationConfig::default());
        let mut rng = SmallRng::seed_from_u64(1);
        let mut conns: Vec<ConnLoad> = (0..6).map(|i| conn(i, i % 3, 100.0)).collect();
        let r = run(
            &mut policy,
            Instant::now(),
            secs(600),
            3,
            &mut conns,
            &mut rng,
        );
        assert!(r.is_empty(), "an even spread must never rotate: {r:?}");
    }

    #[test]
    fn skew_rotates_after_hold_time_and_stops_when_under_the_threshold() {
        let mut policy = RotationPolicy::new(RotationConfig::default());
        let mut rng = SmallRng::seed_from_u64(2);
        // Six equal clients, all pinned to backend 0 of 3.
        let mut conns: Vec<ConnLoad> = (0..6).map(|i| conn(i, 0, 100.0)).collect();
        let r = run(
            &mut policy,
            Instant::now(),
            secs(300),
            3,
            &mut conns,
            &mut rng,
        );
        // 6-0-0 is skew 3; 3-2-1 is 1.5, no longer above the threshold: three moves are
        // all it takes.
        assert_eq!(r.len(), 3, "only as many rotations as needed: {r:?}");
        assert!(
            r[0].0 >= secs(27) && r[0].0 <= secs(34),
            "first rotation after the 30 s hold (+-10%): {r:?}"
        );
        assert!(
            r.iter().all(|(t, _)| *t == r[0].0),
            "the three fit the budget of 6 a minute: they start together when the hold ends: \
             {r:?}"
        );
        let mut per_backend: Vec<usize> = (0..3)
            .map(|b| conns.iter().filter(|c| c.backend == EndpointId(b)).count())
            .collect();
        per_backend.sort_unstable();
        assert_eq!(
            per_backend,
            vec![1, 2, 3],
            "within the threshold in the end"
        );
    }

    #[test]
    fn two_equal_heavy_clients_on_three_backends_do_not_ping_pong() {
        let config = RotationConfig {
            skew_threshold: 1.2,
            ..RotationConfig::default()
        };
        let mut policy = RotationPolicy::new(config);
        let mut rng = SmallRng::seed_from_u64(3);
        // Both on backend 0: one move helps (3.0 -> 1.5), the next would not.
        let mut conns = vec![conn(1, 0, 500.0), conn(2, 0, 500.0)];
        let r = run(
            &mut policy,
            Instant::now(),
            secs(900),
            3,
            &mut conns,
            &mut rng,
        );
        assert_eq!(r.len(), 1, "one rotation, then no ping-pong: {r:?}");
        let last = policy.evaluate(
            Instant::now() + secs(901),
            &backends_for(3, &conns),
            &conns,
            &mut rng,
        );
        assert_eq!(last.state, PolicyState::AsEvenAsPossible, "{last:?}");
    }

    #[test]
    fn one_heavy_connection_over_five_backends_is_as_even_as_it_can_be() {
        let mut policy = RotationPolicy::new(RotationConfig::default());
        let mut rng = SmallRng::seed_from_u64(4);
        let mut conns = vec![conn(1, 2, 1000.0)];
        let t0 = Instant::now();
        let r = run(&mut policy, t0, secs(600), 5, &mut conns, &mut rng);
        assert!(
            r.is_empty(),
            "moving the only connection changes nothing: {r:?}"
        );
        let eval = policy.evaluate(t0 + secs(601), &backends_for(5, &conns), &conns, &mut rng);
        assert_eq!(eval.state, PolicyState::AsEvenAsPossible);
        assert!((eval.skew - 5.0).abs() < 1e-9, "{eval:?}");
    }

    #[test]
    fn scale_up_moves_connections_onto_the_new_backends() {
        let config = RotationConfig {
            max_rotations_per_minute: 60,
            hold_time: secs(5),
            ..RotationConfig::default()
        };
        let mut policy = RotationPolicy::new(config);
        let mut rng = SmallRng::seed_from_u64(5);
        // Seed 001: 10 pick_first clients spread over 2 pods, then the Deployment has 10.
        let mut conns: Vec<ConnLoad> = (0..10).map(|i| conn(i, i % 2, 100.0)).collect();
        let r = run(
            &mut policy,
            Instant::now(),
            secs(120),
            10,
            &mut conns,
            &mut rng,
        );
        assert_eq!(r.len(), 8, "eight clients move, one per new pod: {r:?}");
        for b in 0..10 {
            assert_eq!(
                conns.iter().filter(|c| c.backend == EndpointId(b)).count(),
                1,
                "every pod ends with one client"
            );
        }
    }

    /// Seed 001 with 20 pick_first connections: 10 on each of 2 pods, then 10 pods.
    fn seed_001(budget: u32) -> (RotationPolicy, Vec<ConnLoad>) {
        let policy = RotationPolicy::new(RotationConfig {
            max_rotations_per_minute: budget,
            hold_time: secs(5),
            ..RotationConfig::default()
        });
        (policy, (0..20).map(|i| conn(i, i % 2, 100.0)).collect())
    }

    #[test]
    fn at_the_hold_end_the_whole_plan_rotates_at_once() {
        let (mut policy, mut conns) = seed_001(120);
        let mut rng = SmallRng::seed_from_u64(9);
        let r = run(
            &mut policy,
            Instant::now(),
            secs(60),
            10,
            &mut conns,
            &mut rng,
        );
        // 10-10 over 10 pods is skew 5; the plan ends at 3-3-2-2-2-2-2-2-1-1 (1.5).
        assert_eq!(r.len(), 14, "only as many rotations as needed: {r:?}");
        assert!(
            r[0].0 >= secs(5) && r[0].0 <= secs(6),
            "the first when the 5 s hold (+-10%) ends: {r:?}"
        );
        assert!(
            r.iter().all(|(t, _)| *t == r[0].0),
            "the budget (120 a minute) covers the plan: every rotation starts together, none \
             waits for a slot of its own: {r:?}"
        );
        for b in 0..10 {
            assert!(
                conns.iter().any(|c| c.backend == EndpointId(b)),
                "one wave reaches every pod: {conns:?}"
            );
        }
    }

    #[test]
    fn a_burst_goes_on_to_the_band_under_the_threshold_and_no_further() {
        let (mut policy, mut conns) = seed_001(120);
        let mut rng = SmallRng::seed_from_u64(13);
        // The window still shows the old placement while the burst runs (as in the
        // controller); rotated connections are in transit.
        let backends = backends_for(10, &conns);
        let t0 = Instant::now();
        let hold_end = policy
            .evaluate(t0, &backends, &conns, &mut rng)
            .wake
            .expect("holding");
        let mut last = None;
        for _ in 0..=conns.len() {
            let eval = policy.evaluate(hold_end, &backends, &conns, &mut rng);
            last = Some(eval.clone());
            let Some((id, _)) = eval.rotate else { break };
            conns
                .iter_mut()
                .find(|c| c.id == id)
                .expect("rotated conn")
                .rotating = true;
        }
        let rotated = conns.iter().filter(|c| c.rotating).count();
        // 3-3-2-2-2-2-2-2-1-1 is 1.5: at the threshold, not under the band (1.45), so the
        // burst goes on to 2 per pod (16 moves) instead of stopping where the next drift of
        // the clients' rates puts the skew back above it.
        assert_eq!(rotated, 16, "{last:?}");
        let last = last.expect("evaluated");
        assert!(last.live_skew <= 1.0 + 1e-9, "{last:?}");
        // At the next instant nothing more happens: the Service is balanced.
        let later = policy.evaluate(hold_end + secs(1), &backends, &conns, &mut rng);
        assert_eq!(later.rotate, None, "{later:?}");
    }

    #[test]
    fn a_burst_spends_the_budget_and_the_rest_waits_for_its_slots_to_free() {
        let (mut policy, mut conns) = seed_001(6);
        let mut rng = SmallRng::seed_from_u64(10);
        let r = run(
            &mut policy,
            Instant::now(),
            secs(200),
            10,
            &mut conns,
            &mut rng,
        );
        assert_eq!(r.len(), 14, "{r:?}");
        let first = r[0].0;
        assert!(
            r[..6].iter().all(|(t, _)| *t == first),
            "6 at once when the hold ends: {r:?}"
        );
        for (i, (t, _)) in r.iter().enumerate().skip(6) {
            // Rotation i takes the slot rotation i - 6 freed: 60 s to 66 s after it, seen at
            // the next whole second.
            let freed = r[i - 6].0;
            assert!(
                *t >= freed + secs(60) && *t <= freed + secs(67),
                "rotation {i} waits for a budget slot to free (60-66 s): {r:?}"
            );
        }
        for (i, (t, _)) in r.iter().enumerate() {
            let in_minute = r[i..].iter().take_while(|(u, _)| *u - *t < MINUTE).count();
            assert!(in_minute <= 6, "at most 6 in any 60 s: {r:?}");
        }
    }

    #[test]
    fn the_evaluation_says_when_the_hold_ends_and_when_a_slot_frees() {
        let (mut policy, conns) = seed_001(1);
        let mut rng = SmallRng::seed_from_u64(12);
        let backends = backends_for(10, &conns);
        let t0 = Instant::now();
        let eval = policy.evaluate(t0, &backends, &conns, &mut rng);
        assert_eq!(eval.state, PolicyState::Holding);
        let hold_end = eval.wake.expect("a holding policy says when its hold ends");
        let hold = hold_end - t0;
        assert!(
            hold >= Duration::from_millis(4500) && hold <= Duration::from_millis(5500),
            "5 s +-10%: {hold:?}"
        );
        let just_before = hold_end - Duration::from_millis(1);
        let eval = policy.evaluate(just_before, &backends, &conns, &mut rng);
        assert_eq!(eval.state, PolicyState::Holding, "{eval:?}");
        let eval = policy.evaluate(hold_end, &backends, &conns, &mut rng);
        assert_eq!(
            eval.state,
            PolicyState::Rotating,
            "at the hold's end: {eval:?}"
        );
        assert_eq!(eval.wake, None);
        // The budget (1) is spent: the placement is unchanged, so the policy waits.
        let eval = policy.evaluate(hold_end, &backends, &conns, &mut rng);
        assert_eq!(eval.state, PolicyState::Waiting);
        let frees = eval
            .wake
            .expect("a waiting policy says when its slot frees");
        assert!(
            frees >= hold_end + MINUTE && frees <= hold_end + MINUTE.mul_f64(1.1),
            "a slot frees 60 s to 66 s after its rotation: {:?}",
            frees - hold_end
        );
        let before = frees - Duration::from_millis(1);
        assert_eq!(
            policy.evaluate(before, &backends, &conns, &mut rng).state,
            PolicyState::Waiting
        );
        assert_eq!(
            policy.evaluate(frees, &backends, &conns, &mut rng).state,
            PolicyState::Rotating,
            "the slot is free again at the instant the evaluation named"
        );
    }

    #[test]
    fn unrotatable_and_young_connections_are_not_rotated_but_count_as_load() {
        let mut policy = RotationPolicy::new(RotationConfig {
            hold_time: Duration::ZERO,
            ..RotationConfig::default()
        });
        let mut rng = SmallRng::seed_from_u64(6);
        let mut tonic = conn(1, 0, 300.0);
        tonic.unrotatable = true;
        let mut young = conn(2, 0, 300.0);
        young.age = secs(3);
        let conns = vec![tonic, young, conn(3, 1, 10.0)];
        let now = Instant::now();
        let eval = policy.evaluate(now, &backends_for(3, &conns), &conns, &mut rng);
        assert!(eval.live_skew > 2.0, "both count on backend 0: {eval:?}");
        assert_eq!(eval.rotate, None);
        // Moving the young one would help: not as even as possible, only waiting for it.
        assert_eq!(eval.state, PolicyState::Waiting);
        assert_eq!(eval.wake, Some(now + secs(7)), "when it is 10 s old");
        let mut tonic2 = conns[1].clone();
        tonic2.unrotatable = true;
        let conns = vec![conns[0].clone(), tonic2, conns[2].clone()];
        let eval = policy.evaluate(now, &backends_for(3, &conns), &conns, &mut rng);
        assert_eq!(eval.rotate, None);
        assert_eq!(
            eval.state,
            PolicyState::AsEvenAsPossible,
            "no rotatable connection can move"
        );
    }

    #[test]
    fn a_move_that_waits_only_for_young_connections_is_waiting_then_rotates_when_they_age() {
        // The demo's act 3: the connections just placed 8/4 on 2 of 4 pods, younger than the
        // minimum age: status must not say as_even_as_possible while 2 pods wait for one.
        let mut policy = RotationPolicy::new(RotationConfig {
            hold_time: Duration::ZERO,
            ..RotationConfig::default()
        });
        let mut rng = SmallRng::seed_from_u64(8);
        let conns: Vec<ConnLoad> = (0..12)
            .map(|i| {
                let mut c = conn(i, u64::from(i >= 8), 50.0);
                c.age = secs(2) + Duration::from_millis(100 * (11 - i));
                c
            })
            .collect();
        let backends = backends_for(4, &conns);
        let t0 = Instant::now();
        let eval = policy.evaluate(t0, &backends, &conns, &mut rng);
        assert_eq!(eval.state, PolicyState::Waiting, "{eval:?}");
        assert_eq!(eval.rotate, None);
        let wake = eval.wake.expect("woken when the oldest is 10 s old");
        assert_eq!(wake, t0 + secs(10) - conns[0].age);
        let aged: Vec<ConnLoad> = conns
            .iter()
            .map(|c| ConnLoad {
                age: c.age + (wake - t0),
                ..c.clone()
            })
            .collect();
        let eval = policy.evaluate(wake, &backends, &aged, &mut rng);
        assert_eq!(eval.state, PolicyState::Rotating, "{eval:?}");
        assert_eq!(
            eval.rotate.map(|(id, _)| id),
            Some(ConnId(0)),
            "the one old enough"
        );
    }

    #[test]
    fn rotating_connections_count_where_they_will_land() {
        let mut policy = RotationPolicy::new(RotationConfig {
            hold_time: Duration::ZERO,
            ..RotationConfig::default()
        });
        let mut rng = SmallRng::seed_from_u64(7);
        let mut moving = conn(1, 0, 100.0);
        moving.rotating = true;
        let conns = vec![moving, conn(2, 0, 100.0)];
        // The window still shows everything on backend 0.
        let backends = vec![backend(0, 6000), backend(1, 0)];
        let eval = policy.evaluate(Instant::now(), &backends, &conns, &mut rng);
        assert!((eval.skew - 2.0).abs() < 1e-9);
        assert!((eval.live_skew - 1.0).abs() < 1e-9, "{eval:?}");
        assert_eq!(eval.state, PolicyState::Balanced, "no second rotation");
    }

    #[test]
    fn zero_budget_turns_rotation_off() {
        let mut policy = RotationPolicy::new(RotationConfig {
            max_rotations_per_minute: 0,
            hold_time: Duration::ZERO,
            ..RotationConfig::default()
        });
        let mut rng = SmallRng::seed_from_u64(8);
        let mut conns: Vec<ConnLoad> = (0..4).map(|i| conn(i, 0, 10.0)).collect();
        let r = run(
            &mut policy,
            Instant::now(),
            secs(300),
            2,
            &mut conns,
            &mut rng,
        );
        assert!(r.is_empty());
    }

    fn arb_conns() -> impl Strategy<Value = (u64, Vec<ConnLoad>)> {
        (2u64..7).prop_flat_map(|n| {
            let conn = (
                0..n,
                0.0f64..1000.0,
                0u64..120,
                any::<bool>(),
                any::<bool>(),
            )
                .prop_map(|(b, rate, age, unrotatable, rotating)| ConnLoad {
                    id: ConnId(0),
                    backend: EndpointId(b),
                    rate,
                    age: secs(age),
                    unrotatable,
                    rotating,
                });
            (
                Just(n),
                prop::collection::vec(conn, 0..20).prop_map(|mut v| {
                    for (i, c) in v.iter_mut().enumerate() {
                        c.id = ConnId(i as u64);
                    }
                    v
                }),
            )
        })
    }

    proptest! {
        #[test]
        fn a_rotation_strictly_lowers_the_live_skew((n, conns) in arb_conns(), seed: u64) {
            let mut policy = RotationPolicy::new(RotationConfig {
                hold_time: Duration::ZERO,
                skew_threshold: 1.1,
                ..RotationConfig::default()
            });
            let mut rng = SmallRng::seed_from_u64(seed);
            let eval = policy.evaluate(Instant::now(), &backends_for(n, &conns), &conns, &mut rng);
            if let Some((id, after)) = eval.rotate {
                prop_assert!(after <= eval.live_skew * (1.0 - MIN_GAIN), "{eval:?}");
                let c = conns.iter().find(|c| c.id == id).expect("a known connection");
                prop_assert!(!c.unrotatable && !c.rotating && c.age >= secs(10), "{c:?}");
            }
        }

        #[test]
        fn nothing_rotates_while_either_skew_is_under_the_threshold(
            (n, conns) in arb_conns(),
            window in prop::collection::vec(0u64..10_000, 8),
            margin in 0.0f64..1.0,
            live_side: bool,
            seed: u64,
        ) {
            // The window's requests are drawn apart from the connections: a placement can be
            // uneven while the window is even (a hot client just moved), and the reverse.
            let backends: Vec<BackendLoad> =
                (0..n).map(|b| backend(b, window[b as usize])).collect();
            let live = Live::new(&backends, &conns).skew();
            let skew = window_skew(&backends);
            let mut policy = RotationPolicy::new(RotationConfig {
                hold_time: Duration::ZERO,
                skew_threshold: if live_side { live } else { skew } + margin,
                max_rotations_per_minute: 600,
                min_connection_age: Duration::ZERO,
            });
            let mut rng = SmallRng::seed_from_u64(seed);
            let t0 = Instant::now();
            for step in 0..100u32 {
                let eval = policy.evaluate(t0 + secs(u64::from(step)), &backends, &conns, &mut rng);
                prop_assert_eq!(eval.rotate, None, "{:?}", eval);
            }
        }

        #[test]
        fn every_move_lowers_the_sum_of_squared_loads(
            loads in prop::collection::vec(0.0f64..1000.0, 2..8),
            movable in prop::collection::vec((0usize..8, 0.1f64..500.0), 1..12),
        ) {
            let movable: Vec<(ConnId, usize, f64)> = movable
                .into_iter()
                .enumerate()
                .map(|(i, (b, r))| (ConnId(i as u64), b % loads.len(), r))
                .collect();
            if let Some((k, to)) = best_step(&loads, &movable) {
                let (_, from, rate) = movable[k];
                let squares = |l: &[f64]| l.iter().map(|x| x * x).sum::<f64>();
                let mut after = loads.clone();
                after[from] -= rate;
                after[to] += rate;
                prop_assert!(squares(&after) < squares(&loads), "{:?} -> {:?}", loads, after);
            }
        }

        #[test]
        fn a_balanced_set_never_rotates(n in 2u64..8, per in 1u64..5, rate in 1.0f64..1000.0, seed: u64) {
            let mut policy = RotationPolicy::new(RotationConfig {
                hold_time: Duration::ZERO,
                ..RotationConfig::default()
            });
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut conns: Vec<ConnLoad> = (0..n * per).map(|i| conn(i, i % n, rate)).collect();
            let r = run(&mut policy, Instant::now(), secs(120), n, &mut conns, &mut rng);
            prop_assert!(r.is_empty(), "{r:?}");
        }

        #[test]
        fn rotations_never_exceed_the_budget(
            (n, conns) in arb_conns(),
            budget in 1u32..20,
            seed: u64,
        ) {
            let mut policy = RotationPolicy::new(RotationConfig {
                hold_time: Duration::ZERO,
                skew_threshold: 1.05,
                max_rotations_per_minute: budget,
                min_connection_age: Duration::ZERO,
            });
            let mut rng = SmallRng::seed_from_u64(seed);
            let t0 = Instant::now();
            let mut times = Vec::new();
            // Evaluate every 100 ms for 3 minutes on a placement that never improves (the
            // rotated connection is not moved): the policy keeps wanting to rotate.
            let backends = backends_for(n, &conns);
            for step in 0..1800u32 {
                let now = t0 + Duration::from_millis(100) * step;
                // Asked again at once after each rotation, as the controller does (a burst).
                for _ in 0..=conns.len() {
                    if policy.evaluate(now, &backends, &conns, &mut rng).rotate.is_none() {
                        break;
                    }
                    times.push(now);
                }
            }
            for (i, t) in times.iter().enumerate() {
                let in_minute = times[i..].iter().take_while(|u| **u - *t < MINUTE).count();
                prop_assert!(in_minute <= budget as usize, "{in_minute} > {budget} in a minute");
            }
        }
    }
}
