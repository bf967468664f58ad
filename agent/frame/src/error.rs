use crate::error_code::ErrorCode;
use crate::head::Kind;

/// A frame that breaks RFC 9113, or one larger than the receiver allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The connection does not start with the client preface (not HTTP/2, or HTTP/1.1).
    #[error("the connection does not start with the HTTP/2 client preface")]
    BadPreface,
    /// A frame declares more payload than the receiver advertised (SETTINGS_MAX_FRAME_SIZE).
    #[error("a {kind:?} frame declares {len} bytes, above the advertised maximum of {max}")]
    TooLarge { kind: Kind, len: u32, max: u32 },
    /// A fixed-size or structured payload has the wrong length.
    #[error("a {kind:?} frame has a payload of {len} bytes, which its type does not allow")]
    BadLength { kind: Kind, len: u32 },
    /// A connection-level frame on a stream, or a stream-level frame on stream 0.
    #[error("a {kind:?} frame on stream {stream_id}, which its type does not allow")]
    BadStreamId { kind: Kind, stream_id: u32 },
    /// WINDOW_UPDATE with an increment of 0 (or above 2^31 - 1).
    #[error("WINDOW_UPDATE on stream {stream_id} with an invalid increment {increment}")]
    BadIncrement { stream_id: u32, increment: u32 },
    /// A SETTINGS parameter with a value outside its range.
    #[error("SETTINGS parameter {id:#x} with the out-of-range value {value}")]
    BadSetting { id: u16, value: u32 },
}

impl FrameError {
    /// The error code a receiver answers with in its GOAWAY (RFC 9113 section 7).
    #[must_use]
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::TooLarge { .. } | Self::BadLength { .. } => ErrorCode::FRAME_SIZE_ERROR,
            Self::BadSetting { id: 0x4, .. } => ErrorCode::FLOW_CONTROL_ERROR,
            Self::BadPreface
            | Self::BadStreamId { .. }
            | Self::BadIncrement { .. }
            | Self::BadSetting { .. } => ErrorCode::PROTOCOL_ERROR,
        }
    }
}
