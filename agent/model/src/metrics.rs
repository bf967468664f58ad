//! Counters the model updates; `skewless-admin` registers them under their names.

use prometheus_client::metrics::{counter::Counter, family::Family};

/// Label set: one `reason` label with a bounded set of values ([`crate::ConfigError::reason`]).
pub type ReasonLabels = [(&'static str, &'static str); 1];

/// Metrics of the model. Clones share the same counters.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    rejected: Family<ReasonLabels, Counter>,
    source_errors: Family<SourceLabels, Counter>,
    warning_events_dropped: Counter,
}

/// Label set: `source` is `kubernetes` or `file`.
pub type SourceLabels = [(&'static str, &'static str); 1];

impl Metrics {
    /// The rejection counters, to register (`skewless-admin` names the family).
    #[must_use]
    pub fn rejected_family(&self) -> Family<ReasonLabels, Counter> {
        self.rejected.clone()
    }

    /// The source failure counters, to register (`skewless-admin` names the family).
    #[must_use]
    pub fn source_errors_family(&self) -> Family<SourceLabels, Counter> {
        self.source_errors.clone()
    }

    /// The counter of Warning Events dropped on a full queue, to register (`skewless-admin`
    /// names it).
    #[must_use]
    pub fn warning_events_dropped_counter(&self) -> Counter {
        self.warning_events_dropped.clone()
    }

    /// Counts a Warning Event that was not posted because the queue to the poster was full.
    pub fn warning_event_dropped(&self) {
        self.warning_events_dropped.inc();
    }

    /// Warning Events dropped so far (for tests and status).
    #[must_use]
    pub fn warning_events_dropped_total(&self) -> u64 {
        self.warning_events_dropped.get()
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
