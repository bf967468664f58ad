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
        // httlib-hpack 0.1.3 indexes past the end of a block cut short inside an integer or
        // before a string (found by the `request_paths` fuzz target): a panic there is this
        // block's decoding error, a connection error, and the decoder goes with the
        // connection. Without this, any peer could end the connection's task with a panic.
        let (inner, input, out) = (&mut self.inner, &mut self.input, &mut self.out);
        let decoded = quiet_panics(|| inner.decode(input, out))
            .unwrap_or(Err(httlib_hpack::DecoderError::IntegerUnderflow));
        decoded.map_err(|e| format!("{e:?}"))?;
        for (n, v, _) in &self.out {
            f(n, v);
        }
        Ok(())
    }
}

/// Runs `f`, `None` if it panicked, without the panic hook's report (it is the peer's input
/// that made the library panic, not a defect of ours to print).
fn quiet_panics<T>(f: impl FnOnce() -> T) -> Option<T> {
    thread_local! {
        static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(std::cell::Cell::get) {
                report(info);
            }
        }));
    });
    QUIET.with(|q| q.set(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).ok();
    QUIET.with(|q| q.set(false));
    result
}

/// One direction's HPACK encoding context.
#[derive(Debug)]
pub(crate) struct HpackEncoder {
    inner: httlib_hpack::Encoder<'static>,
    scratch: Vec<u8>,
    /// Table size changes the next header block must start with (RFC 7541 section 4.2): the
    /// smallest since the last block, then the last.
    resize: Option<(u32, u32)>,
}

/// The most dynamic table an encoder uses, whatever its peer allows: RFC 7541's default.
const MAX_TABLE: u32 = 4096;

impl HpackEncoder {
    pub(crate) fn new() -> Self {
        Self {
            inner: httlib_hpack::Encoder::with_dynamic_size(MAX_TABLE),
            scratch: Vec::new(),
            resize: None,
        }
    }

    /// The peer's decoder allows `size` bytes of table (its SETTINGS_HEADER_TABLE_SIZE):
    /// the encoder uses at most that, from the next header block on.
    pub(crate) fn peer_table_size(&mut self, size: u32) {
        let size = size.min(MAX_TABLE);
        self.resize = Some(match self.resize {
            Some((smallest, _)) => (smallest.min(size), size),
            None => (size, size),
        });
    }

    /// Starts a header block in `scratch`, with the table size changes due.
    fn start_block(&mut self) {
        self.scratch.clear();
        if let Some((smallest, last)) = self.resize.take() {
            let _ = self
                .inner
                .update_max_dynamic_size(smallest, &mut self.scratch);
            if last != smallest {
                let _ = self.inner.update_max_dynamic_size(last, &mut self.scratch);
            }
        }
    }

    fn encode(&mut self, name: &[u8], value: &[u8]) {
        let flags = httlib_hpack::Encoder::BEST_FORMAT | httlib_hpack::Encoder::WITH_INDEXING;
        let _ = self
            .inner
            .encode((name.to_vec(), value.to_vec(), flags), &mut self.scratch);
    }
}

/// Why a regular field (not a pseudo-header) makes its message malformed, if it does: a name
/// that is not a lowercase token (RFC 9113 section 8.2.1 and RFC 9110 section 5.1: no
/// uppercase letter, space, colon, control or non-ASCII byte, no delimiter), or a value with
/// a control character other than HTAB (RFC 9110 section 5.5; RFC 9113 section 8.2.1 names
/// NUL, CR and LF). Stricter than RFC 9113 alone, and on purpose: h2-based servers (tonic,
/// hyper) refuse such a field with their whole connection, so forwarding one would fail every
/// call the upstream connection carries. A value's leading or trailing whitespace is let
/// through, as h2 and the HTTP/2 servers behind a Service let it through.
#[expect(
    clippy::needless_bitwise_bool,
    reason = "every byte is looked at anyway: no branch per byte"
)]
pub(crate) fn invalid_field(name: &[u8], value: &[u8]) -> Option<&'static str> {
    // Every call's every field passes here, both ways: the common case is one pass over each
    // without a branch per byte; the reason is worked out only for a field that fails.
    if name.is_empty()
        || !name
            .iter()
            .fold(true, |ok, &b| ok & FIELD_NAME[usize::from(b)])
    {
        return Some(if name.is_empty() {
            "empty field name"
        } else if name.iter().any(u8::is_ascii_uppercase) {
            "uppercase field name"
        } else {
            "a field name that is not a token"
        });
    }
    let control = value
        .iter()
        .fold(false, |c, &b| c | ((b < 0x20) & (b != b'\t')) | (b == 0x7f));
    control.then_some("a control character in a field value")
}

/// Whether every byte of `bytes` is a token's.
pub(crate) fn all_token(bytes: &[u8]) -> bool {
    bytes.iter().fold(true, |ok, &b| ok & TOKEN[usize::from(b)])
}

/// The bytes of a field name: a token's but uppercase letters (RFC 9113 section 8.2.1).
const FIELD_NAME: [bool; 256] = {
    let mut t = TOKEN;
    let mut b = b'A';
    while b <= b'Z' {
        t[b as usize] = false;
        b += 1;
    }
    t
};

/// The bytes of a token (RFC 9110 section 5.6.2, `tchar`).
pub(crate) const TOKEN: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = c.is_ascii_alphanumeric()
            || matches!(
                c,
                b'!' | b'#'
                    | b'$'
                    | b'%'
                    | b'&'
                    | b'\''
                    | b'*'
                    | b'+'
                    | b'-'
                    | b'.'
                    | b'^'
                    | b'_'
                    | b'`'
                    | b'|'
                    | b'~'
            );
        b += 1;
    }
    t
};

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
    encoder.start_block();
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

/// Why a response's header block (`first`: its headers, else its trailers) is malformed
/// (RFC 9113 section 8.3.2 and the checks of [`invalid_field`]), if it is: a pseudo-header
/// other than one `:status` of three digits at the head of the headers, or an invalid field
/// (connection-specific fields are dropped on the way, not refused). A server that sends one
/// fails its call, not the client connection that would carry it (an h2-based client refuses
/// such a field with the whole connection).
pub(crate) fn malformed_response(fields: &Fields, first: bool) -> Option<&'static str> {
    let mut status = false;
    let mut regular = false;
    for (name, value) in fields.iter() {
        if name.first() == Some(&b':') {
            if !first || regular || name != b":status" || std::mem::replace(&mut status, true) {
                return Some("a pseudo-header a response cannot have there");
            }
            if value.len() != 3 || !value.iter().all(u8::is_ascii_digit) {
                return Some("a :status that is not three digits");
            }
            continue;
        }
        regular = true;
        if let Some(why) = invalid_field(name, value) {
            return Some(why);
        }
    }
    (first && !status).then_some("no :status")
}

/// Connection-specific header fields (RFC 9113 section 8.2.2), which are never forwarded.
pub(crate) fn is_connection_specific(name: &[u8]) -> bool {
    matches!(
        name,
        b"connection" | b"keep-alive" | b"proxy-connection" | b"transfer-encoding" | b"upgrade"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks cut short where httlib-hpack 0.1.3 indexes past their end: each is a decoding
    /// error (the connection's COMPRESSION_ERROR), never a panic.
    #[test]
    fn a_block_cut_short_is_a_compression_error_not_a_panic() {
        for block in [
            // A literal with a new name, and no name.
            &[0x00][..],
            // Two indexed fields, then the same.
            &[0xb5, 0xb5, 0x00],
            // A literal whose name index needs more octets than the block has.
            &[0x7f],
            &[0x0f, 0xff],
        ] {
            let mut decoder = HpackDecoder::new(4096);
            let mut fields = Fields::default();
            assert!(
                matches!(
                    fields.decode(&mut decoder, block, 16 * 1024),
                    Err(FieldsError::Compression(_))
                ),
                "{block:x?} does not decode"
            );
        }
    }

    /// The blocks that do decode still do after a block that made the library panic, on a
    /// decoder of their own (a connection's decoder goes with the connection).
    #[test]
    fn decoding_goes_on_after_a_contained_panic() {
        let mut decoder = HpackDecoder::new(4096);
        let mut fields = Fields::default();
        assert!(fields.decode(&mut decoder, &[0x00], 1024).is_err());
        let mut fresh = HpackDecoder::new(4096);
        // :method GET (static index 2), :path / (index 4).
        fields
            .decode(&mut fresh, &[0x82, 0x84], 1024)
            .expect("a valid block decodes");
        assert_eq!(fields.get(b":method"), Some(&b"GET"[..]));
        assert_eq!(fields.get(b":path"), Some(&b"/"[..]));
    }
}
