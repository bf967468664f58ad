//! Connection mode: every redirected client connection is relayed 1:1 to one backend (the
//! frame-level relay, [`crate::relay`]), placed by load, and rotated with a graceful two-phase
//! GOAWAY when the Service's connections are pinned unevenly.

pub mod policy;
