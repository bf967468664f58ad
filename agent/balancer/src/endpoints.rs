//! A Service's endpoints as the balancer sees them ([`Endpoint`]: plain data the agent
//! publishes on a `watch` channel), and the endpoint set of one Service's balancer, whichever
//! the mode: which endpoints exist (each with an id for the balancer's lifetime, following the
//! endpoint watch), whether each may take traffic (connected, active health, passive
//! ejection), and a value `T` per endpoint that the owner creates when the endpoint is added.
//!
//! Request mode keeps its upstream connections and the picker's latency estimate in `T`;
//! connection mode keeps its backend's load there. Anything that needs a per-endpoint handle
//! (metrics, for instance) creates it in the same place, once per endpoint, so nothing is
//! looked up by label per call.
//!
//! The set is plain synchronous state: the owner holds it under its own lock and passes time
//! in. `follow` is the one task that feeds an owner the watch's updates.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tracing::Instrument as _;

/// One ready endpoint (pod address) of a Service. Plain data: the Kubernetes model or the local
/// file feeds a `Vec<Endpoint>` through a `tokio::sync::watch` channel.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// Where the pod listens.
    pub addr: SocketAddr,
    /// The pod's name, for logs and stats.
    pub name: String,
}

impl Endpoint {
    /// An endpoint named `name` at `addr`.
    #[must_use]
    pub fn new(addr: SocketAddr, name: impl Into<String>) -> Self {
        Self {
            addr,
            name: name.into(),
        }
    }
}

/// Follows the endpoint watch for `owner`: applies the set current now (so a call or a
/// connection arriving right after construction finds its endpoints), then spawns the task
/// that applies every later set, until the publisher goes away (the last set stays) or `owner`
/// is dropped. Must be called inside a Tokio runtime; abort the task with the handle returned.
pub(crate) fn follow<T: Send + Sync + 'static>(
    owner: &Arc<T>,
    mut endpoints: watch::Receiver<Vec<Endpoint>>,
    update: fn(&Arc<T>, &[Endpoint]),
) -> AbortHandle {
    update(owner, &endpoints.borrow_and_update());
    let owner = Arc::downgrade(owner);
    let follow = async move {
        while endpoints.changed().await.is_ok() {
            // Not borrowed across the update: the publisher is never held up by it.
            let current = endpoints.borrow_and_update().clone();
            let Some(owner) = owner.upgrade() else { return };
            update(&owner, &current);
        }
    };
    tokio::spawn(follow.instrument(tracing::debug_span!("discovery"))).abort_handle()
}

/// Identifies one endpoint for the lifetime of its balancer: an endpoint that is removed and
/// added again gets a new id, so late reports about the old one are ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub u64);

/// One endpoint of the set.
#[derive(Debug)]
pub struct Entry<T> {
    id: EndpointId,
    endpoint: Endpoint,
    /// Has a usable connection (request mode: an HTTP/2 connection that has spoken).
    ready: bool,
    /// What active health checking says (true when it is off).
    serving: bool,
    /// Passive health: failures in a row and ejections.
    pub ejection: Ejection,
    /// The owner's per-endpoint state, created when the endpoint was added.
    pub value: T,
}

impl<T> Entry<T> {
    /// The endpoint's id.
    #[must_use]
    pub fn id(&self) -> EndpointId {
        self.id
    }

    /// The endpoint (address and name) as the watch published it.
    #[must_use]
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Whether the endpoint has a usable connection.
    #[must_use]
    pub fn ready(&self) -> bool {
        self.ready
    }

    /// Whether active health checking reports it serving (always, when checking is off).
    #[must_use]
    pub fn serving(&self) -> bool {
        self.serving
    }

    /// The endpoint, its passive health and the owner's value at once, for an owner that
    /// updates its value and its ejection state while it logs the endpoint.
    pub fn split_mut(&mut self) -> (&Endpoint, &mut Ejection, &mut T) {
        (&self.endpoint, &mut self.ejection, &mut self.value)
    }

    /// Connected and not reported unhealthy: may carry traffic (passive ejection aside, which
    /// each mode weighs itself).
    #[must_use]
    pub fn usable(&self) -> bool {
        self.ready && self.serving
    }
}

/// The endpoints of one balancer, in the order they were added.
#[derive(Debug)]
pub struct EndpointSet<T> {
    entries: Vec<Entry<T>>,
    next_id: u64,
}

impl<T> Default for EndpointSet<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> EndpointSet<T> {
    /// An empty set.
    #[must_use]
    pub fn new() -> Self {
        Self {
            entries: Vec::new(),
            next_id: 0,
        }
    }

    /// Brings the set in line with `endpoints` (the watch's current list): entries whose
    /// address is no longer listed are removed and returned, so the owner can tear down what
    /// their value holds; listed addresses without an entry get one, not ready and serving,
    /// with the value `add` makes for it. Entries that stay keep their id and state.
    pub fn update(
        &mut self,
        endpoints: &[Endpoint],
        mut add: impl FnMut(EndpointId, &Endpoint) -> T,
    ) -> Vec<Entry<T>> {
        let mut removed = Vec::new();
        let mut i = 0;
        while i < self.entries.len() {
            if endpoints
                .iter()
                .any(|e| e.addr == self.entries[i].endpoint.addr)
            {
                i += 1;
            } else {
                let entry = self.entries.remove(i);
                tracing::debug!(addr = %entry.endpoint.addr, name = %entry.endpoint.name, "endpoint removed");
                removed.push(entry);
            }
        }
        for ep in endpoints {
            if self.entries.iter().any(|e| e.endpoint.addr == ep.addr) {
                continue;
            }
            let id = EndpointId(self.next_id);
            self.next_id += 1;
            tracing::debug!(addr = %ep.addr, name = %ep.name, "endpoint added");
            let value = add(id, ep);
            self.entries.push(Entry {
                id,
                endpoint: ep.clone(),
                ready: false,
                serving: true,
                ejection: Ejection::default(),
                value,
            });
        }
        removed
    }

    /// Number of endpoints, ready or not.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there is no endpoint at all.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry of `id`, if it is still in the set.
    #[must_use]
    pub fn get(&self, id: EndpointId) -> Option<&Entry<T>> {
        self.entries.iter().find(|e| e.id == id)
    }

    /// The entry of `id`, if it is still in the set.
    pub fn get_mut(&mut self, id: EndpointId) -> Option<&mut Entry<T>> {
        self.entries.iter_mut().find(|e| e.id == id)
    }

    /// The entries, in the order they were added.
    pub fn iter(&self) -> std::slice::Iter<'_, Entry<T>> {
        self.entries.iter()
    }

    /// The entries, in the order they were added.
    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, Entry<T>> {
        self.entries.iter_mut()
    }

    /// Marks whether the endpoint has a usable connection.
    pub fn set_ready(&mut self, id: EndpointId, ready: bool) {
        if let Some(e) = self.get_mut(id) {
            e.ready = ready;
        }
    }

    /// Marks whether the endpoint's active health check says it is serving.
    pub fn set_serving(&mut self, id: EndpointId, serving: bool) {
        if let Some(e) = self.get_mut(id) {
            e.serving = serving;
        }
    }

    /// Whether every endpoint is in `exclude`.
    #[must_use]
    pub fn all_excluded(&self, exclude: &[EndpointId]) -> bool {
        self.entries.iter().all(|e| exclude.contains(&e.id))
    }

    /// Whether any endpoint is usable.
    #[must_use]
    pub fn any_usable(&self) -> bool {
        self.entries.iter().any(Entry::usable)
    }
}

impl<'a, T> IntoIterator for &'a EndpointSet<T> {
    type Item = &'a Entry<T>;
    type IntoIter = std::slice::Iter<'a, Entry<T>>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter()
    }
}

impl<'a, T> IntoIterator for &'a mut EndpointSet<T> {
    type Item = &'a mut Entry<T>;
    type IntoIter = std::slice::IterMut<'a, Entry<T>>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter_mut()
    }
}

/// Passive health of one endpoint (Envoy's outlier detection, Finagle's failure accrual):
/// `threshold` failures in a row eject it for a time that doubles with every ejection in a
/// row, from `backoff.0` up to `backoff.1`. What counts as a failure, and what happens after an
/// ejection ends, is the mode's call (request mode probes; connection mode tries a connect).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ejection {
    consecutive_failures: u32,
    /// Ejections in a row, for the backoff.
    ejections: u32,
    /// Set while ejected, until [`Ejection::expire`] sees the time pass.
    until: Option<Instant>,
}

impl Ejection {
    /// Whether the endpoint is ejected (its time may be over; [`Ejection::expire`] ends it).
    #[must_use]
    pub fn is_ejected(&self) -> bool {
        self.until.is_some()
    }

    /// Whether the last ejection has not been followed by a success in rotation yet.
    #[must_use]
    pub fn was_ejected(&self) -> bool {
        self.ejections > 0
    }

    /// Failures in a row so far.
    #[must_use]
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }

    /// A success: the run of failures is over; `in_rotation` (the endpoint takes its normal
    /// share again) also forgets past ejections, so the next one starts at the first backoff.
    pub fn record_success(&mut self, in_rotation: bool) {
        self.consecutive_failures = 0;
        if in_rotation {
            self.ejections = 0;
        }
    }

    /// A failure. Ejects when it makes `threshold` in a row, or at once when `at_once`, unless
    /// already ejected or `allowed` is false (the mode keeps enough endpoints in rotation).
    /// Returns the ejection time when it ejected.
    pub fn record_failure(
        &mut self,
        now: Instant,
        threshold: u32,
        backoff: (Duration, Duration),
        at_once: bool,
        allowed: bool,
    ) -> Option<Duration> {
        self.consecutive_failures += 1;
        let due = self.consecutive_failures >= threshold || at_once;
        if !due || self.is_ejected() || !allowed {
            return None;
        }
        let exp = self.ejections.min(16);
        let time = backoff.0.saturating_mul(1 << exp).min(backoff.1);
        self.until = Some(now + time);
        self.ejections += 1;
        self.consecutive_failures = 0;
        Some(time)
    }

    /// Ends an ejection whose time is over; true when it did.
    pub fn expire(&mut self, now: Instant) -> bool {
        match self.until {
            Some(until) if until <= now => {
                self.until = None;
                true
            }
            _ => false,
        }
    }
}

/// Where an endpoint stands in the rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointState {
    /// No usable connection yet (connecting or reconnecting).
    Connecting,
    /// Its grpc.health.v1 Watch says NOT_SERVING (or the watch failed): no requests.
    NotServing,
    /// In rotation.
    Active,
    /// Too slow compared to its peers: only probe requests.
    Degraded,
    /// Failed repeatedly, or its connection died (an unanswered PING): no requests until its
    /// ejection time is over and it has answered a PING or a new connection.
    Ejected,
}

impl EndpointState {
    /// The state's name as `/status` and `skewless status` show it.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            EndpointState::Connecting => "Connecting",
            EndpointState::NotServing => "NotServing",
            EndpointState::Active => "Active",
            EndpointState::Degraded => "Degraded",
            EndpointState::Ejected => "Ejected",
        }
    }
}

impl std::fmt::Display for EndpointState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(port: u16) -> Endpoint {
        Endpoint::new(([10, 0, 0, 1], port).into(), format!("pod-{port}"))
    }

    #[test]
    fn update_keeps_ids_of_listed_endpoints_and_returns_removed_ones() {
        let mut set = EndpointSet::new();
        let mut made = Vec::new();
        let removed = set.update(&[ep(1), ep(2)], |id, e| {
            made.push(id);
            e.addr.port()
        });
        assert!(removed.is_empty());
        assert_eq!(made.len(), 2, "a value is made per added endpoint");
        let (a, b) = (made[0], made[1]);
        set.set_ready(a, true);
        let removed = set.update(&[ep(2), ep(3)], |_, e| e.addr.port());
        assert_eq!(removed.len(), 1, "the unlisted endpoint is handed back");
        assert_eq!(removed[0].id(), a);
        assert_eq!(removed[0].value, 1);
        let ids: Vec<EndpointId> = set.iter().map(Entry::id).collect();
        assert_eq!(ids[0], b, "a listed endpoint keeps its id");
        assert_ne!(ids[1], a, "a new endpoint never reuses an id");
        let removed = set.update(&[ep(1), ep(2), ep(3)], |_, e| e.addr.port());
        assert!(removed.is_empty());
        let again = set.iter().last().expect("re-added").id();
        assert!(again != a && !set.get(again).expect("present").ready());
        assert!(
            set.get(a).is_none(),
            "late reports about the old id find nothing"
        );
    }

    #[test]
    fn ejection_backoff_doubles_and_a_success_in_rotation_resets_it() {
        let t0 = Instant::now();
        let backoff = (Duration::from_secs(1), Duration::from_secs(3));
        let mut e = Ejection::default();
        for _ in 0..4 {
            assert_eq!(e.record_failure(t0, 5, backoff, false, true), None);
        }
        assert_eq!(
            e.record_failure(t0, 5, backoff, false, true),
            Some(Duration::from_secs(1)),
            "the fifth failure in a row ejects"
        );
        assert!(e.is_ejected());
        assert_eq!(
            e.record_failure(t0, 5, backoff, true, true),
            None,
            "an ejected endpoint is not ejected again"
        );
        assert!(!e.expire(t0 + Duration::from_millis(999)));
        assert!(e.expire(t0 + Duration::from_secs(1)));
        assert_eq!(
            e.record_failure(t0, 5, backoff, true, true),
            Some(Duration::from_secs(2)),
            "the next ejection in a row lasts twice as long"
        );
        assert!(e.expire(t0 + Duration::from_secs(2)));
        assert_eq!(
            e.record_failure(t0, 5, backoff, true, true),
            Some(Duration::from_secs(3)),
            "capped at the largest backoff"
        );
        assert!(e.expire(t0 + Duration::from_secs(3)));
        e.record_success(false);
        assert!(
            e.was_ejected(),
            "a success out of rotation keeps the backoff"
        );
        e.record_success(true);
        assert!(!e.was_ejected());
        assert_eq!(
            e.record_failure(t0, 1, backoff, false, false),
            None,
            "not ejected when the mode does not allow it"
        );
    }

    #[test]
    fn endpoint_states_keep_the_names_status_readers_know() {
        let states = [
            EndpointState::Connecting,
            EndpointState::NotServing,
            EndpointState::Active,
            EndpointState::Degraded,
            EndpointState::Ejected,
        ];
        let names: Vec<String> = states.iter().map(ToString::to_string).collect();
        assert_eq!(
            names,
            ["Connecting", "NotServing", "Active", "Degraded", "Ejected"],
            "/status values are a contract with `skewless status`, tests and dashboards"
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn follow_applies_the_current_set_at_once_then_every_change_until_the_owner_goes() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::<Vec<u16>>::new()));
        let record = |seen: &Arc<std::sync::Mutex<Vec<Vec<u16>>>>, eps: &[Endpoint]| {
            seen.lock()
                .unwrap()
                .push(eps.iter().map(|e| e.addr.port()).collect());
        };
        let (tx, rx) = watch::channel(vec![ep(1)]);
        let task = follow(&seen, rx, record);
        assert_eq!(
            *seen.lock().unwrap(),
            [vec![1]],
            "the current set is applied before follow returns"
        );
        tx.send(vec![ep(1), ep(2)]).unwrap();
        tokio::task::yield_now().await;
        tx.send(vec![ep(3)]).unwrap();
        tokio::task::yield_now().await;
        assert_eq!(*seen.lock().unwrap(), [vec![1], vec![1, 2], vec![3]]);
        // The owner gone, the next change ends the task.
        let weak = Arc::downgrade(&seen);
        drop(seen);
        assert!(
            weak.upgrade().is_none(),
            "the task holds no strong reference"
        );
        tx.send(vec![ep(4)]).unwrap();
        tokio::task::yield_now().await;
        assert!(task.is_finished(), "the task ends once its owner is gone");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn follow_keeps_the_last_set_when_the_publisher_goes() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::<usize>::new()));
        let (tx, rx) = watch::channel(vec![ep(1), ep(2)]);
        let task = follow(&seen, rx, |s, eps| s.lock().unwrap().push(eps.len()));
        drop(tx);
        tokio::task::yield_now().await;
        assert!(task.is_finished(), "nothing left to follow");
        assert_eq!(
            *seen.lock().unwrap(),
            [2],
            "no empty set applied on the way out"
        );
    }
}
