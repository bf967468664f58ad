//! Typed HTTP/2 frames for what h2 does not expose to a relay (RFC 9113 section 4 and 6): the
//! 9-byte frame header, the payloads of the connection-control frames (GOAWAY, PING, SETTINGS,
//! RST_STREAM, WINDOW_UPDATE), the client connection preface, a follower of frame boundaries
//! in a byte stream read in arbitrary pieces, and a bounded decoder of gRPC's 5-byte
//! length-prefixed messages.
//!
//! No I/O and no HPACK: header blocks (HEADERS, PUSH_PROMISE, CONTINUATION payloads) are opaque
//! bytes here; decoding them stays the business of h2 (or of the two peers a relay connects).
//! Decoders borrow from the caller's buffer and never allocate; every length a peer declares
//! is checked against a bound the caller gives.
#![forbid(unsafe_code)]

mod error;
mod error_code;
mod follow;
pub mod grpc;
mod head;
mod payload;

pub use error::FrameError;
pub use error_code::ErrorCode;
pub use follow::{Follower, Frames};
pub use head::{Head, Kind, flags};
pub use payload::{GoAway, Ping, RstStream, Setting, SettingId, Settings, WindowUpdate};

/// Length of an HTTP/2 frame header.
pub const HEADER_LEN: usize = 9;
/// The client connection preface (RFC 9113 section 3.4); a SETTINGS frame follows it.
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// SETTINGS_MAX_FRAME_SIZE until a peer advertises another value.
pub const DEFAULT_MAX_FRAME_SIZE: u32 = 16_384;
/// The largest SETTINGS_MAX_FRAME_SIZE a peer may advertise (2^24 - 1).
pub const MAX_MAX_FRAME_SIZE: u32 = (1 << 24) - 1;
/// The largest stream id, and the last-stream-id of a GOAWAY that refuses nothing.
pub const MAX_STREAM_ID: u32 = (1 << 31) - 1;
/// The largest flow-control window (2^31 - 1).
pub const MAX_WINDOW: u32 = (1 << 31) - 1;
