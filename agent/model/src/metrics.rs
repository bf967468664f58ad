//! Counters the model updates; the admin crate registers them with its registry.

use prometheus_client::{
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};

/// Label set: one `reason` label with a bounded set of values ([`crate::ConfigError::reason`]).
type ReasonLabels = [(&'static str, &'static str); 1];

/// Metrics of the model. Clones share the same counters.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    rejected: Family<ReasonLabels, Counter>,
}

impl Metrics {
    /// Creates the metrics and registers them under `registry` (prefix it with `skewless`).
    #[must_use]
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "service_config_rejected",
            "Service configs rejected (bad skewless.io annotation or unsupported Service), each distinct error counted once; the Service keeps its last good config.",
            m.rejected.clone(),
        );
        m
    }

    pub(crate) fn rejected(&self, reason: &'static str) {
        self.rejected.get_or_create(&[("reason", reason)]).inc();
    }

    /// Rejections counted so far with this reason (for tests and status).
    #[must_use]
    pub fn rejected_total(&self, reason: &'static str) -> u64 {
        self.rejected.get_or_create(&[("reason", reason)]).get()
    }
}
