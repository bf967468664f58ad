//! The side-by-side proxy benchmark of issue 4, the parts that do not spawn anything: peer
//! configurations ([`peers`]), `/proc` accounting ([`sampling`]), the folding of repeated runs
//! ([`stats`]), the load-independent counts per call ([`counted`]: callgrind, `perf stat`), the
//! third-party load section ([`h2load`]: its request body, h2load's report, its table), and the
//! markdown ([`report`]) and SVG ([`chart`]) output. The driver is `src/bin/skewless-bench/`.
#![forbid(unsafe_code)]

pub mod chart;
pub mod convergence;
pub mod counted;
pub mod h2load;
pub mod peers;
pub mod report;
pub mod sampling;
pub mod stats;

pub use chart::bar_chart_svg;
pub use peers::{Pod, haproxy_config, nginx_config};
pub use report::{
    builds_table, connection_targets_table, low_load_table, markdown_table, open_table,
    open_targets_table, replace_section, targets_table,
};
pub use sampling::{stat_cpu_ticks, stat_ppid, status_vm_hwm_kib};
pub use stats::{Row, Spread, Summary, interleave, summarize};
