//! Local YAML file source for skewless (in progress).
#![forbid(unsafe_code)]
