//! gRPC's length-prefixed messages (a 1-byte compressed flag and a 4-byte big-endian length,
//! then the message), with the declared length capped: a peer can make the decoder wait for
//! at most `max_len` bytes, never the 4 GiB the prefix can declare.

use bytes::{Buf as _, BufMut as _, Bytes, BytesMut};

/// Length of the prefix before each message.
pub const PREFIX_LEN: usize = 5;

/// A message that cannot be decoded or encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// The prefix declares more than the decoder accepts.
    #[error("a gRPC message declares {len} bytes, above the limit of {max}")]
    TooLarge { len: u64, max: u64 },
    /// The compressed flag is neither 0 nor 1.
    #[error("a gRPC message has the invalid compressed flag {0:#x}")]
    BadFlag(u8),
}

/// One message, still encoded (protobuf, possibly compressed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub compressed: bool,
    pub data: Bytes,
}

/// Takes complete messages off the front of a buffer the caller fills.
#[derive(Debug, Clone, Copy)]
pub struct MessageDecoder {
    max_len: u32,
}

impl MessageDecoder {
    /// Accepts messages of up to `max_len` bytes.
    #[must_use]
    pub const fn new(max_len: u32) -> Self {
        Self { max_len }
    }

    /// The next complete message at the front of `buf`, removed from it; `None` (and `buf`
    /// untouched) until all of it has arrived.
    ///
    /// # Errors
    /// A declared length above the limit (as soon as the prefix has arrived), or a bad flag.
    pub fn decode(&self, buf: &mut BytesMut) -> Result<Option<Message>, MessageError> {
        let Some(prefix) = buf.get(..PREFIX_LEN) else {
            return Ok(None);
        };
        let compressed = match prefix[0] {
            0 => false,
            1 => true,
            other => return Err(MessageError::BadFlag(other)),
        };
        let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]);
        if len > self.max_len {
            return Err(MessageError::TooLarge {
                len: u64::from(len),
                max: u64::from(self.max_len),
            });
        }
        if buf.len() < PREFIX_LEN + len as usize {
            return Ok(None);
        }
        buf.advance(PREFIX_LEN);
        Ok(Some(Message {
            compressed,
            data: buf.split_to(len as usize).freeze(),
        }))
    }
}

/// Appends `data` as one message.
///
/// # Errors
/// `data` is longer than a prefix can declare (4 GiB).
pub fn encode(compressed: bool, data: &[u8], buf: &mut BytesMut) -> Result<(), MessageError> {
    let len = u32::try_from(data.len()).map_err(|_| MessageError::TooLarge {
        len: data.len() as u64,
        max: u64::from(u32::MAX),
    })?;
    buf.reserve(PREFIX_LEN + data.len());
    buf.put_u8(u8::from(compressed));
    buf.put_u32(len);
    buf.put_slice(data);
    Ok(())
}
