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
    source_errors: Family<SourceLabels, Counter>,
}

/// Label set: `source` is `kubernetes` or `file`.
type SourceLabels = [(&'static str, &'static str); 1];

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
        registry.register(
            "source_errors",
            "Failures to read Services and endpoints from a source (a failed watch, an unreadable or invalid file); the last good state stays in effect.",
            m.source_errors.clone(),
        );
        m
    }

    pub(crate) fn rejected(&self, reason: &'static str) {
        self.rejected.get_or_create(&[("reason", reason)]).inc();
    }

    /// Counts a failure of a source (`kubernetes` or `file`).
    pub fn source_error(&self, source: &'static str) {
        self.source_errors
            .get_or_create(&[("source", source)])
            .inc();
    }

    /// Source failures counted so far (for tests and status).
    #[must_use]
    pub fn source_errors_total(&self, source: &'static str) -> u64 {
        self.source_errors
            .get_or_create(&[("source", source)])
            .get()
    }

    /// Rejections counted so far with this reason (for tests and status).
    #[must_use]
    pub fn rejected_total(&self, reason: &'static str) -> u64 {
        self.rejected.get_or_create(&[("reason", reason)]).get()
    }
}
