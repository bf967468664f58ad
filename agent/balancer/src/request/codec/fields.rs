//! Header lists between HPACK and the wire: a decoded list kept in one reusable buffer
//! ([`Fields`]), decoded from a header block with a bound on its size, and written out as one
//! HEADERS frame with a connection's encoder. HPACK itself is the library's ([`HpackDecoder`]
//! and [`HpackEncoder`] are the one seam to it); nothing here encodes or decodes a
//! representation.

use bytes::{BufMut as _, BytesMut};
use skewless_frame::{HEADER_LEN, Head, Kind, flags};

/// One direction's HPACK decoding context (a connection's peer encodes into it).
#[derive(Debug)]
pub(crate) struct HpackDecoder {
    inner: httlib_hpack::Decoder<'static>,
    input: Vec<u8>,
    out: Vec<(Vec<u8>, Vec<u8>, u8)>,
}

impl HpackDecoder {
    /// A decoder whose dynamic table may hold `max_table` bytes (what this side advertises).
    pub(crate) fn new(max_table: u32) -> Self {
        Self {
            inner: httlib_hpack::Decoder::with_dynamic_size(max_table),
            input: Vec::new(),
            out: Vec::new(),
        }
    }

    fn decode(&mut self, block: &[u8], mut f: impl FnMut(&[u8], &[u8])) -> Result<(), String> {
        self.input.clear();
        self.input.extend_from_slice(block);
        self.out.clear();
        self.inner
            .decode(&mut self.input, &mut self.out)
            .map_err(|e| format!("{e:?}"))?;
        for (n, v, _) in &self.out {
            f(n, v);
        }
        Ok(())
    }
}

/// One direction's HPACK encoding context.
#[derive(Debug)]
pub(crate) struct HpackEncoder {
    inner: httlib_hpack::Encoder<'static>,
    scratch: Vec<u8>,
}

impl HpackEncoder {
    pub(crate) fn new() -> Self {
        Self {
            inner: httlib_hpack::Encoder::with_dynamic_size(4096),
            scratch: Vec::new(),
        }
    }

    fn encode(&mut self, name: &[u8], value: &[u8]) {
        let flags = httlib_hpack::Encoder::BEST_FORMAT | httlib_hpack::Encoder::WITH_INDEXING;
        let _ = self
            .inner
            .encode((name.to_vec(), value.to_vec(), flags), &mut self.scratch);
    }
}

/// Per-entry overhead of a header list's size (RFC 9113 section 6.5.2, RFC 7541 section 4.1).
const ENTRY_OVERHEAD: usize = 32;

/// A decoded header list: names and values back to back in one buffer that is reused from
/// block to block, so decoding a block allocates nothing once the buffer has grown.
#[derive(Debug, Default)]
pub(crate) struct Fields {
    bytes: Vec<u8>,
    /// Per field: where its name starts, where its value starts, where it ends.
    spans: Vec<(u32, u32, u32)>,
    /// The list's size as RFC 9113 counts it (name + value + 32 per field).
    size: usize,
}

/// Why a header block was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FieldsError {
    /// The HPACK block does not decode (a compression error: the connection is broken).
    #[error("header block does not decode: {0:?}")]
    Compression(String),
    /// The decoded list is larger than the bound (the stream is refused; the decoder's state
    /// is intact, so the connection goes on).
    #[error("header list of {size} bytes over the bound of {max}")]
    TooLarge { size: usize, max: usize },
}

impl Fields {
    pub(crate) fn clear(&mut self) {
        self.bytes.clear();
        self.spans.clear();
        self.size = 0;
    }

    /// Decodes `block` (a whole header block) into `self`, replacing what it held. A list
    /// over `max` bytes is refused, but the block is still decoded to its end: the decoder's
    /// dynamic table must follow every block the peer sent.
    pub(crate) fn decode(
        &mut self,
        decoder: &mut HpackDecoder,
        block: &[u8],
        max: usize,
    ) -> Result<(), FieldsError> {
        self.clear();
        let mut size = 0usize;
        decoder
            .decode(block, |name, value| {
                size += name.len() + value.len() + ENTRY_OVERHEAD;
                if size <= max {
                    self.push(name, value);
                }
            })
            .map_err(FieldsError::Compression)?;
        self.size = size;
        if size > max {
            self.clear();
            return Err(FieldsError::TooLarge { size, max });
        }
        Ok(())
    }

    /// Becomes a copy of `other`, in the buffers it has (no allocation once they are large
    /// enough).
    pub(crate) fn copy_from(&mut self, other: &Fields) {
        self.bytes.clear();
        self.bytes.extend_from_slice(&other.bytes);
        self.spans.clear();
        self.spans.extend_from_slice(&other.spans);
        self.size = other.size;
    }

    pub(crate) fn push(&mut self, name: &[u8], value: &[u8]) {
        // Bounded by the header list bound (16 KiB), far below u32.
        let start = self.bytes.len() as u32;
        self.bytes.extend_from_slice(name);
        let mid = self.bytes.len() as u32;
        self.bytes.extend_from_slice(value);
        let end = self.bytes.len() as u32;
        self.spans.push((start, mid, end));
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.spans.iter().map(|&(s, m, e)| {
            (
                &self.bytes[s as usize..m as usize],
                &self.bytes[m as usize..e as usize],
            )
        })
    }

    /// The value of the first field named `name`.
    pub(crate) fn get(&self, name: &[u8]) -> Option<&[u8]> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }
}

/// Writes one HEADERS frame on `stream_id` holding `fields`, encoded with `encoder`, into
/// `out`. The block must fit one frame: a list within the header list bound (16 KiB) always
/// does, since its encoding is never longer than its RFC size and every peer accepts 16 KiB
/// frames.
pub(crate) fn put_headers<'f>(
    out: &mut BytesMut,
    encoder: &mut HpackEncoder,
    stream_id: u32,
    end_stream: bool,
    fields: impl IntoIterator<Item = (&'f [u8], &'f [u8])>,
) {
    let at = out.len();
    out.put_slice(&[0; HEADER_LEN]);
    encoder.scratch.clear();
    for (name, value) in fields {
        encoder.encode(name, value);
    }
    out.put_slice(&encoder.scratch);
    let len = (out.len() - at - HEADER_LEN) as u32;
    let mut f = flags::END_HEADERS;
    if end_stream {
        f |= flags::END_STREAM;
    }
    out[at..at + HEADER_LEN].copy_from_slice(&Head::new(Kind::Headers, f, stream_id, len).encode());
}

/// Writes DATA frames on `stream_id` carrying `payload` (split at `max_frame`), the last one
/// with END_STREAM when `end_stream`.
pub(crate) fn put_data(
    out: &mut BytesMut,
    stream_id: u32,
    payload: &[u8],
    end_stream: bool,
    max_frame: usize,
) {
    let mut rest = payload;
    loop {
        let n = rest.len().min(max_frame);
        let last = n == rest.len();
        let f = if last && end_stream {
            flags::END_STREAM
        } else {
            0
        };
        out.put_slice(&Head::new(Kind::Data, f, stream_id, n as u32).encode());
        out.put_slice(&rest[..n]);
        rest = &rest[n..];
        if last {
            return;
        }
    }
}
