//! Payloads of the connection-control frames (RFC 9113 section 6): decoded from a borrowed
//! payload after checking its length and stream id, encoded as whole frames (header included).

use bytes::BufMut;

use crate::error::FrameError;
use crate::error_code::ErrorCode;
use crate::head::{Head, Kind, flags};

/// Checks that `payload` is the frame's whole payload and that its length satisfies `ok`.
fn check(
    head: &Head,
    payload: &[u8],
    kind: Kind,
    ok: impl FnOnce(usize) -> bool,
) -> Result<(), FrameError> {
    debug_assert_eq!(head.kind, kind, "decoded with the wrong payload type");
    if payload.len() != head.len as usize || !ok(payload.len()) {
        return Err(FrameError::BadLength {
            kind,
            len: u32::try_from(payload.len()).unwrap_or(u32::MAX),
        });
    }
    Ok(())
}

fn on_connection(head: &Head) -> Result<(), FrameError> {
    if head.stream_id == 0 {
        Ok(())
    } else {
        Err(FrameError::BadStreamId {
            kind: head.kind,
            stream_id: head.stream_id,
        })
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn put_head(buf: &mut impl BufMut, kind: Kind, flags: u8, stream_id: u32, len: usize) {
    let len = u32::try_from(len).unwrap_or(u32::MAX);
    buf.put_slice(&Head::new(kind, flags, stream_id, len).encode());
}

/// PING (section 6.7): 8 opaque bytes on stream 0; an ACK echoes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ping {
    pub ack: bool,
    pub opaque: [u8; 8],
}

impl Ping {
    /// Length of a whole PING frame.
    pub const FRAME_LEN: usize = crate::HEADER_LEN + 8;

    /// # Errors
    /// A payload other than 8 bytes, or a stream other than 0.
    pub fn decode(head: &Head, payload: &[u8]) -> Result<Self, FrameError> {
        check(head, payload, Kind::Ping, |n| n == 8)?;
        on_connection(head)?;
        let mut opaque = [0; 8];
        opaque.copy_from_slice(payload);
        Ok(Self {
            ack: head.has(flags::ACK),
            opaque,
        })
    }

    pub fn encode(&self, buf: &mut impl BufMut) {
        let f = if self.ack { flags::ACK } else { 0 };
        put_head(buf, Kind::Ping, f, 0, 8);
        buf.put_slice(&self.opaque);
    }
}

/// GOAWAY (section 6.8): the last stream the sender processes or might, an error code, and
/// opaque debug data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GoAway<'a> {
    pub last_stream_id: u32,
    pub error_code: ErrorCode,
    pub debug_data: &'a [u8],
}

impl<'a> GoAway<'a> {
    /// # Errors
    /// A payload under 8 bytes, or a stream other than 0.
    pub fn decode(head: &Head, payload: &'a [u8]) -> Result<Self, FrameError> {
        check(head, payload, Kind::GoAway, |n| n >= 8)?;
        on_connection(head)?;
        Ok(Self {
            last_stream_id: be32(payload) & crate::MAX_STREAM_ID,
            error_code: ErrorCode(be32(&payload[4..])),
            debug_data: &payload[8..],
        })
    }

    pub fn encode(&self, buf: &mut impl BufMut) {
        put_head(buf, Kind::GoAway, 0, 0, 8 + self.debug_data.len());
        buf.put_u32(self.last_stream_id & crate::MAX_STREAM_ID);
        buf.put_u32(self.error_code.0);
        buf.put_slice(self.debug_data);
    }
}

/// RST_STREAM (section 6.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RstStream {
    pub stream_id: u32,
    pub error_code: ErrorCode,
}

impl RstStream {
    /// Length of a whole RST_STREAM frame.
    pub const FRAME_LEN: usize = crate::HEADER_LEN + 4;

    /// # Errors
    /// A payload other than 4 bytes, or stream 0.
    pub fn decode(head: &Head, payload: &[u8]) -> Result<Self, FrameError> {
        check(head, payload, Kind::RstStream, |n| n == 4)?;
        if head.stream_id == 0 {
            return Err(FrameError::BadStreamId {
                kind: Kind::RstStream,
                stream_id: 0,
            });
        }
        Ok(Self {
            stream_id: head.stream_id,
            error_code: ErrorCode(be32(payload)),
        })
    }

    pub fn encode(&self, buf: &mut impl BufMut) {
        put_head(buf, Kind::RstStream, 0, self.stream_id, 4);
        buf.put_u32(self.error_code.0);
    }
}

/// WINDOW_UPDATE (section 6.9); stream 0 is the connection window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowUpdate {
    pub stream_id: u32,
    pub increment: u32,
}

impl WindowUpdate {
    /// Length of a whole WINDOW_UPDATE frame.
    pub const FRAME_LEN: usize = crate::HEADER_LEN + 4;

    /// # Errors
    /// A payload other than 4 bytes, or an increment of 0.
    pub fn decode(head: &Head, payload: &[u8]) -> Result<Self, FrameError> {
        check(head, payload, Kind::WindowUpdate, |n| n == 4)?;
        let increment = be32(payload) & crate::MAX_WINDOW;
        if increment == 0 {
            return Err(FrameError::BadIncrement {
                stream_id: head.stream_id,
                increment,
            });
        }
        Ok(Self {
            stream_id: head.stream_id,
            increment,
        })
    }

    pub fn encode(&self, buf: &mut impl BufMut) {
        put_head(buf, Kind::WindowUpdate, 0, self.stream_id, 4);
        buf.put_u32(self.increment & crate::MAX_WINDOW);
    }
}

/// A SETTINGS parameter identifier (section 6.5.2); unknown ones must be ignored.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct SettingId(pub u16);

impl SettingId {
    pub const HEADER_TABLE_SIZE: Self = Self(0x1);
    pub const ENABLE_PUSH: Self = Self(0x2);
    pub const MAX_CONCURRENT_STREAMS: Self = Self(0x3);
    pub const INITIAL_WINDOW_SIZE: Self = Self(0x4);
    pub const MAX_FRAME_SIZE: Self = Self(0x5);
    pub const MAX_HEADER_LIST_SIZE: Self = Self(0x6);
    pub const ENABLE_CONNECT_PROTOCOL: Self = Self(0x8);
}

/// One SETTINGS parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    pub id: SettingId,
    pub value: u32,
}

impl Setting {
    fn validate(self) -> Result<Self, FrameError> {
        let ok = match self.id {
            SettingId::ENABLE_PUSH | SettingId::ENABLE_CONNECT_PROTOCOL => self.value <= 1,
            SettingId::INITIAL_WINDOW_SIZE => self.value <= crate::MAX_WINDOW,
            SettingId::MAX_FRAME_SIZE => {
                (crate::DEFAULT_MAX_FRAME_SIZE..=crate::MAX_MAX_FRAME_SIZE).contains(&self.value)
            }
            _ => true,
        };
        if ok {
            Ok(self)
        } else {
            Err(FrameError::BadSetting {
                id: self.id.0,
                value: self.value,
            })
        }
    }
}

/// SETTINGS (section 6.5): a validated, borrowed list of parameters, or an ACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings<'a> {
    pub ack: bool,
    payload: &'a [u8],
}

impl<'a> Settings<'a> {
    /// # Errors
    /// A length that is not a multiple of 6 (or not 0 on an ACK), a stream other than 0, or a
    /// parameter out of its range.
    pub fn decode(head: &Head, payload: &'a [u8]) -> Result<Self, FrameError> {
        let ack = head.has(flags::ACK);
        check(head, payload, Kind::Settings, |n| {
            n.is_multiple_of(6) && !(ack && n > 0)
        })?;
        on_connection(head)?;
        let s = Self { ack, payload };
        for setting in s.iter() {
            setting.validate()?;
        }
        Ok(s)
    }

    /// The parameters in the order sent (a later value of the same id wins).
    pub fn iter(&self) -> impl Iterator<Item = Setting> + 'a {
        self.payload.chunks_exact(6).map(|c| Setting {
            id: SettingId(u16::from_be_bytes([c[0], c[1]])),
            value: be32(&c[2..]),
        })
    }

    /// The last value sent for `id`.
    #[must_use]
    pub fn get(&self, id: SettingId) -> Option<u32> {
        self.iter().filter(|s| s.id == id).last().map(|s| s.value)
    }

    /// Encodes a SETTINGS frame with `settings` (empty when `ack`).
    pub fn encode(ack: bool, settings: &[Setting], buf: &mut impl BufMut) {
        let (f, list) = if ack {
            (flags::ACK, &[][..])
        } else {
            (0, settings)
        };
        put_head(buf, Kind::Settings, f, 0, 6 * list.len());
        for s in list {
            buf.put_u16(s.id.0);
            buf.put_u32(s.value);
        }
    }
}
