//! What the agent's admin API says, apart from how it is served.
//!
//! - [`names`]: every metric family `/metrics` exports (name, type, labels, help), in one
//!   place, so the collector, the dashboard lint and the rule tests agree on them.
//! - [`json`]: the `/status` document, shared by the agent (which serves it) and
//!   `skewless status` (which reads it).
//! - [`collector`]: turns one [`collector::Scrape`] (plain numbers gathered at scrape time from
//!   the balancers, the kernel counters and the observer) into OpenMetrics families.
//! - [`process`]: the agent process's own figures, parsed from `/proc` texts.
//! - [`window`]: the recent window behind the balancer skew and per-backend p99 gauges.
//! - [`render`]: the `skewless status` text.
//! - [`page`]: the status page on the admin port (`/ui`), from the same document.
//! - [`monitoring`]: the dashboard, rules and PrometheusRule in `deploy/monitoring/`.
//! - [`promql`]: the identifiers of a query, for the checks that its series are exported.
//!
//! Pure logic, no I/O (but for [`monitoring::promtool_check_metrics`], which runs promtool for
//! the tests): the HTTP server and client live in the `skewless` binary. This crate
//! must not depend on the datapath or the balancer; the binary converts their numbers into
//! the plain types here.

#![forbid(unsafe_code)]

pub mod collector;
pub mod json;
pub mod monitoring;
pub mod names;
pub mod page;
pub mod process;
pub mod promql;
pub mod render;
pub mod window;
