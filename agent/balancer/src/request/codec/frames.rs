//! What both sides of the codec path do alike with a peer's frames: header blocks collected
//! over HEADERS and CONTINUATION ([`HeaderBlocks`]), payloads without their padding, PING
//! answers, and the limits on what may be sent to the peer ([`SendLimits`]).

use bytes::BytesMut;
use skewless_frame::{ErrorCode, Head, Kind, Ping, Setting, SettingId, WindowUpdate, flags};

use crate::upstream::MAX_HEADER_LIST;

/// The initial flow-control window of RFC 9113 (before SETTINGS say otherwise).
pub(crate) const DEFAULT_WINDOW: i64 = 65_535;

/// A whole header block: borrowed from its one HEADERS frame, or collected over several.
pub(crate) enum Block<'a> {
    Borrowed(&'a [u8]),
    Collected(BytesMut),
}

impl std::ops::Deref for Block<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Block::Borrowed(b) => b,
            Block::Collected(b) => b,
        }
    }
}

/// A header block split over CONTINUATION frames, collected until it ends.
struct Partial {
    stream: u32,
    end_stream: bool,
    block: BytesMut,
}

/// Follows a peer's header blocks: a HEADERS frame without END_HEADERS must be followed by
/// CONTINUATION frames of the same stream and nothing else (RFC 9113 section 6.10); what they
/// collect is bounded at twice the header list bound.
#[derive(Default)]
pub(crate) struct HeaderBlocks {
    partial: Option<Partial>,
}

impl HeaderBlocks {
    /// Whether a block is open: only its CONTINUATION may come next.
    pub(crate) fn open(&self) -> bool {
        self.partial.is_some()
    }

    /// A HEADERS or CONTINUATION frame (or any frame while a block is open): the stream, its
    /// END_STREAM and the whole block once it ends. `Err`: a connection error.
    pub(crate) fn frame<'a>(
        &mut self,
        head: Head,
        payload: &'a [u8],
    ) -> Result<Option<(u32, bool, Block<'a>)>, ErrorCode> {
        if let Some(p) = &mut self.partial {
            if head.kind != Kind::Continuation || head.stream_id != p.stream {
                return Err(ErrorCode::PROTOCOL_ERROR);
            }
            if p.block.len() + payload.len() > MAX_HEADER_LIST as usize * 2 {
                return Err(ErrorCode::ENHANCE_YOUR_CALM);
            }
            p.block.extend_from_slice(payload);
            if !head.has(flags::END_HEADERS) {
                return Ok(None);
            }
            return Ok(self
                .partial
                .take()
                .map(|p| (p.stream, p.end_stream, Block::Collected(p.block))));
        }
        if head.kind != Kind::Headers {
            // A CONTINUATION with no block open.
            return Err(ErrorCode::PROTOCOL_ERROR);
        }
        let block = strip(head, payload)?;
        let end_stream = head.has(flags::END_STREAM);
        if head.has(flags::END_HEADERS) {
            return Ok(Some((head.stream_id, end_stream, Block::Borrowed(block))));
        }
        self.partial = Some(Partial {
            stream: head.stream_id,
            end_stream,
            block: BytesMut::from(block),
        });
        Ok(None)
    }
}

/// The payload of a DATA or HEADERS frame without its padding (and a HEADERS frame's
/// priority fields).
pub(crate) fn strip(head: Head, payload: &[u8]) -> Result<&[u8], ErrorCode> {
    let mut p = payload;
    let mut pad = 0usize;
    if head.has(flags::PADDED) {
        let (&n, rest) = p.split_first().ok_or(ErrorCode::PROTOCOL_ERROR)?;
        pad = usize::from(n);
        p = rest;
    }
    if head.kind == Kind::Headers && head.has(flags::PRIORITY) {
        p = p.get(5..).ok_or(ErrorCode::PROTOCOL_ERROR)?;
    }
    if pad > p.len() {
        return Err(ErrorCode::PROTOCOL_ERROR);
    }
    Ok(&p[..p.len() - pad])
}

/// Answers a PING (not a PING ACK) into `out`.
pub(crate) fn answer_ping(
    head: &Head,
    payload: &[u8],
    out: &mut BytesMut,
) -> Result<(), ErrorCode> {
    let ping = Ping::decode(head, payload).map_err(|_| ErrorCode::PROTOCOL_ERROR)?;
    if !ping.ack {
        Ping {
            ack: true,
            opaque: ping.opaque,
        }
        .encode(out);
    }
    Ok(())
}

/// A WINDOW_UPDATE's stream and increment.
pub(crate) fn window_update(head: &Head, payload: &[u8]) -> Result<(u32, i64), ErrorCode> {
    let wu = WindowUpdate::decode(head, payload).map_err(|_| ErrorCode::PROTOCOL_ERROR)?;
    Ok((wu.stream_id, i64::from(wu.increment)))
}

/// What this side may send to a peer: the connection's send window, the peer's initial
/// stream window, its largest frame.
#[derive(Debug)]
pub(crate) struct SendLimits {
    pub(crate) window: i64,
    pub(crate) initial_window: i64,
    pub(crate) max_frame: usize,
}

impl SendLimits {
    pub(crate) fn new() -> Self {
        Self {
            window: DEFAULT_WINDOW,
            initial_window: DEFAULT_WINDOW,
            max_frame: skewless_frame::DEFAULT_MAX_FRAME_SIZE as usize,
        }
    }

    /// Applies one of the peer's settings; returns what every open stream's send window
    /// changes by (a new SETTINGS_INITIAL_WINDOW_SIZE moves them all, RFC 9113 6.9.2).
    pub(crate) fn apply(&mut self, s: Setting) -> i64 {
        match s.id {
            SettingId::INITIAL_WINDOW_SIZE => {
                let delta = i64::from(s.value) - self.initial_window;
                self.initial_window = i64::from(s.value);
                delta
            }
            SettingId::MAX_FRAME_SIZE => {
                self.max_frame = s.value as usize;
                0
            }
            _ => 0,
        }
    }

    /// Takes `len` bytes of `stream_window` and of the connection's window, if both have them.
    pub(crate) fn take(&mut self, stream_window: &mut i64, len: usize) -> bool {
        let len = len as i64;
        if len > *stream_window || len > self.window {
            return false;
        }
        *stream_window -= len;
        self.window -= len;
        true
    }
}
