//! Kubernetes discovery for skewless (in progress).
#![forbid(unsafe_code)]
