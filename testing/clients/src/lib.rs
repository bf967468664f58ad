//! The real-client harness of skewless's tests: independent gRPC clients (Python grpcio,
//! Node's @grpc/grpc-js, tonic) that run the same bounded load against the echo service and
//! report one typed [`ClientResult`] — per-pod tallies from the replies, every failure with
//! its status — plus a frame-logging HTTP/2 tap that records the exact frames a client or a
//! backend sees ([`framelog`]).
//!
//! The clients run in testbed pods (through the Service VIP and the eBPF redirect) or on
//! loopback ([`Harness`]). Owns: the clients' shared command line ([`ClientSpec`]), their
//! result type, and the tonic client and the frame tap (binaries of this crate). Must not
//! touch: the agent (it is a black box the clients talk to).
#![forbid(unsafe_code)]

pub mod framelog;
pub mod result;
mod run;
mod spec;
pub mod tonic_client;

pub use result::{CallTally, ClientResult, Failure, StreamResult, skew};
pub use run::{BIN_DIR_ENV, BINS, Harness, HarnessError, Running, bin_dir, node_modules};
pub use spec::{ClientKind, ClientSpec, FOUR_MIB};
