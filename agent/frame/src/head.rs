//! The 9-byte frame header (RFC 9113 section 4.1).

use crate::HEADER_LEN;

/// A frame type; types this crate does not know are kept (receivers must ignore them, a relay
/// forwards them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Data,
    Headers,
    Priority,
    RstStream,
    Settings,
    PushPromise,
    Ping,
    GoAway,
    WindowUpdate,
    Continuation,
    Unknown(u8),
}

impl From<u8> for Kind {
    fn from(v: u8) -> Self {
        match v {
            0x0 => Self::Data,
            0x1 => Self::Headers,
            0x2 => Self::Priority,
            0x3 => Self::RstStream,
            0x4 => Self::Settings,
            0x5 => Self::PushPromise,
            0x6 => Self::Ping,
            0x7 => Self::GoAway,
            0x8 => Self::WindowUpdate,
            0x9 => Self::Continuation,
            other => Self::Unknown(other),
        }
    }
}

impl From<Kind> for u8 {
    fn from(k: Kind) -> Self {
        match k {
            Kind::Data => 0x0,
            Kind::Headers => 0x1,
            Kind::Priority => 0x2,
            Kind::RstStream => 0x3,
            Kind::Settings => 0x4,
            Kind::PushPromise => 0x5,
            Kind::Ping => 0x6,
            Kind::GoAway => 0x7,
            Kind::WindowUpdate => 0x8,
            Kind::Continuation => 0x9,
            Kind::Unknown(v) => v,
        }
    }
}

/// Frame flags (their meaning depends on the frame type).
pub mod flags {
    /// DATA, HEADERS: the sender's last frame on this stream.
    pub const END_STREAM: u8 = 0x1;
    /// SETTINGS, PING: an acknowledgement.
    pub const ACK: u8 = 0x1;
    /// HEADERS, PUSH_PROMISE, CONTINUATION: the header block ends with this frame.
    pub const END_HEADERS: u8 = 0x4;
    /// DATA, HEADERS, PUSH_PROMISE: a pad length byte and padding are present.
    pub const PADDED: u8 = 0x8;
    /// HEADERS: stream dependency and weight are present.
    pub const PRIORITY: u8 = 0x20;
}

/// A frame header: what a relay needs to follow and route frames without their payloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    /// Payload length (24 bits).
    pub len: u32,
    pub kind: Kind,
    pub flags: u8,
    /// Stream id (31 bits); 0 is the connection.
    pub stream_id: u32,
    /// The reserved bit before the stream id: senders must leave it unset, receivers ignore
    /// it; kept so that encode(decode(x)) == x.
    pub reserved: bool,
}

impl Head {
    /// A header with the reserved bit unset. `len` is cut to 24 bits and `stream_id` to 31.
    #[must_use]
    pub fn new(kind: Kind, flags: u8, stream_id: u32, len: u32) -> Self {
        Self {
            len: len & 0x00ff_ffff,
            kind,
            flags,
            stream_id: stream_id & crate::MAX_STREAM_ID,
            reserved: false,
        }
    }

    #[must_use]
    pub fn decode(b: &[u8; HEADER_LEN]) -> Self {
        let id = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
        Self {
            len: u32::from_be_bytes([0, b[0], b[1], b[2]]),
            kind: Kind::from(b[3]),
            flags: b[4],
            stream_id: id & crate::MAX_STREAM_ID,
            reserved: id >> 31 == 1,
        }
    }

    #[must_use]
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let [_, l0, l1, l2] = self.len.to_be_bytes();
        let id = (self.stream_id & crate::MAX_STREAM_ID) | (u32::from(self.reserved) << 31);
        let [i0, i1, i2, i3] = id.to_be_bytes();
        [l0, l1, l2, u8::from(self.kind), self.flags, i0, i1, i2, i3]
    }

    /// Whether `flag` is set.
    #[must_use]
    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    /// END_STREAM on a DATA or HEADERS frame.
    #[must_use]
    pub fn is_end_stream(&self) -> bool {
        matches!(self.kind, Kind::Data | Kind::Headers) && self.has(flags::END_STREAM)
    }

    /// END_HEADERS on a HEADERS, PUSH_PROMISE or CONTINUATION frame.
    #[must_use]
    pub fn is_end_headers(&self) -> bool {
        matches!(
            self.kind,
            Kind::Headers | Kind::PushPromise | Kind::Continuation
        ) && self.has(flags::END_HEADERS)
    }

    /// ACK on a SETTINGS or PING frame.
    #[must_use]
    pub fn is_ack(&self) -> bool {
        matches!(self.kind, Kind::Settings | Kind::Ping) && self.has(flags::ACK)
    }

    /// Header plus payload length.
    #[must_use]
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.len as usize
    }
}
