//! What both sides of the codec path do alike with a peer's frames: header blocks collected
//! over HEADERS and CONTINUATION ([`HeaderBlocks`]), payloads without their padding, PING
//! answers, and flow control: the limits on what may be sent to the peer ([`SendLimits`]),
//! body bytes held until the peer's window takes them ([`Held`]), and what the peer may still
//! send and is given back once it has been passed on ([`RecvWindow`]).

use bytes::{Buf as _, BytesMut};
use skewless_frame::{ErrorCode, Head, Kind, Ping, Setting, SettingId, WindowUpdate, flags};

use super::fields::{self, Fields, HpackEncoder};
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
/// priority fields). `Err` (a connection error): on stream 0, or padded beyond its length.
pub(crate) fn strip(head: Head, payload: &[u8]) -> Result<&[u8], ErrorCode> {
    if head.stream_id == 0 {
        // DATA and HEADERS belong to a stream (RFC 9113 sections 6.1 and 6.2).
        return Err(ErrorCode::PROTOCOL_ERROR);
    }
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

    /// How many bytes a stream with `stream_window` may send now.
    fn room(&self, stream_window: i64) -> usize {
        stream_window.min(self.window).max(0) as usize
    }

    /// `len` bytes were sent on a stream with `stream_window`.
    fn spend(&mut self, stream_window: &mut i64, len: usize) {
        *stream_window -= len as i64;
        self.window -= len as i64;
    }
}

/// A stream's body bytes that the peer's windows did not take yet, and how the stream ends
/// after them. Bounded by the window this side gave the sender of those bytes: it is given
/// back only once the bytes leave here.
#[derive(Debug, Default)]
pub(crate) struct Held {
    data: BytesMut,
    /// END_STREAM follows the held bytes.
    end: bool,
    /// Trailers follow the held bytes (and end the stream).
    trailers: Option<Fields>,
}

impl Held {
    /// Whether anything waits: then what comes next for the stream must wait behind it.
    pub(crate) fn is_waiting(&self) -> bool {
        !self.data.is_empty() || self.end || self.trailers.is_some()
    }

    pub(crate) fn len(&self) -> usize {
        self.data.len()
    }

    /// Holds nothing any more, keeping its buffer.
    pub(crate) fn clear(&mut self) {
        self.data.clear();
        self.end = false;
        self.trailers = None;
    }

    /// Holds `data` (and the end after it) behind what is held already.
    pub(crate) fn push(&mut self, data: &[u8], end: bool) {
        self.data.extend_from_slice(data);
        self.end |= end;
    }

    /// What is held: the bytes, whether END_STREAM follows them, the trailers that follow.
    pub(crate) fn parts(&self) -> (&[u8], bool, Option<&Fields>) {
        (&self.data, self.end, self.trailers.as_ref())
    }

    /// Holds trailers behind the waiting bytes.
    pub(crate) fn hold_trailers<'f>(
        &mut self,
        trailers: impl IntoIterator<Item = (&'f [u8], &'f [u8])>,
    ) {
        let mut kept = Fields::default();
        for (name, value) in trailers {
            kept.push(name, value);
        }
        self.trailers = Some(kept);
    }
}

/// What one stream's outgoing body needs: its id, its send window, what waits for window.
pub(crate) struct Outgoing<'a> {
    pub(crate) stream: u32,
    pub(crate) window: &'a mut i64,
    pub(crate) held: &'a mut Held,
}

impl Outgoing<'_> {
    /// Sends as much of `data` as the stream's and the connection's windows take, as DATA
    /// frames into `out`, and holds the rest (after anything already held, so the order
    /// stays). Returns the bytes sent now.
    pub(crate) fn send(
        &mut self,
        out: &mut BytesMut,
        limits: &mut SendLimits,
        data: &[u8],
        end_stream: bool,
    ) -> usize {
        if self.held.is_waiting() {
            self.held.data.extend_from_slice(data);
            self.held.end |= end_stream;
            return 0;
        }
        let n = limits.room(*self.window).min(data.len());
        if n > 0 || (data.is_empty() && end_stream) {
            limits.spend(self.window, n);
            fields::put_data(
                out,
                self.stream,
                &data[..n],
                end_stream && n == data.len(),
                limits.max_frame,
            );
        }
        if n < data.len() {
            self.held.data.extend_from_slice(&data[n..]);
            self.held.end = end_stream;
        }
        n
    }

    /// Sends what the windows take of the held bytes, then the held END_STREAM or trailers
    /// once nothing is left before them. Returns the bytes sent, and whether the stream's
    /// side is now over.
    pub(crate) fn resume(
        &mut self,
        out: &mut BytesMut,
        limits: &mut SendLimits,
        encoder: &mut HpackEncoder,
    ) -> (usize, bool) {
        let n = limits.room(*self.window).min(self.held.data.len());
        let last = n == self.held.data.len();
        let end_on_data = last && self.held.end && self.held.trailers.is_none();
        if n > 0 || end_on_data {
            limits.spend(self.window, n);
            fields::put_data(
                out,
                self.stream,
                &self.held.data[..n],
                end_on_data,
                limits.max_frame,
            );
            self.held.data.advance(n);
        }
        if !last {
            return (n, false);
        }
        self.held.end = false;
        if let Some(trailers) = self.held.trailers.take() {
            fields::put_headers(out, encoder, self.stream, true, trailers.iter());
            return (n, true);
        }
        (n, end_on_data)
    }
}

/// A stream whose outgoing body may wait for the peer's windows.
pub(crate) trait Sending {
    /// Its send window and what waits for it.
    fn outgoing(&mut self) -> (&mut i64, &mut Held);
}

/// Applies one of the peer's settings to what may be sent: `limits`, and every open stream's
/// send window when the initial window changes (RFC 9113 section 6.9.2).
pub(crate) fn apply_setting<S: Sending>(
    setting: Setting,
    limits: &mut SendLimits,
    streams: &mut super::StreamMap<S>,
) -> Result<(), ErrorCode> {
    let delta = limits.apply(setting);
    if delta != 0 {
        for s in streams.values_mut() {
            let window = s.outgoing().0;
            *window += delta;
            if *window > MAX_WINDOW {
                // A new initial window that takes a stream's beyond 2^31-1: a connection
                // error (RFC 9113 section 6.9.2).
                return Err(ErrorCode::FLOW_CONTROL_ERROR);
            }
        }
    }
    Ok(())
}

/// The largest a flow-control window may be (RFC 9113 section 6.9.1).
const MAX_WINDOW: i64 = skewless_frame::MAX_WINDOW as i64;

/// Which window a peer's WINDOW_UPDATE took beyond 2^31-1 (RFC 9113 section 6.9.1): the
/// connection's (a connection error) or a stream's (a stream error), both FLOW_CONTROL_ERROR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Overflow {
    Connection,
    Stream,
}

/// Applies a peer's WINDOW_UPDATE of `increment` on `stream` (0: the connection) to what may
/// be sent; an update for a stream no longer open is ignored.
pub(crate) fn open_window<S: Sending>(
    stream: u32,
    increment: i64,
    limits: &mut SendLimits,
    streams: &mut super::StreamMap<S>,
) -> Result<(), Overflow> {
    if stream == 0 {
        limits.window += increment;
        if limits.window > MAX_WINDOW {
            return Err(Overflow::Connection);
        }
    } else if let Some(s) = streams.get_mut(&stream) {
        let window = s.outgoing().0;
        *window += increment;
        if *window > MAX_WINDOW {
            return Err(Overflow::Stream);
        }
    }
    Ok(())
}

/// Sends as much of `data` on `stream` (state `s`) as the windows take and holds the rest
/// (see [`Outgoing::send`]); a stream that begins to wait joins `waiting`. Returns the bytes
/// sent now, and whether anything is held.
pub(crate) fn send_or_hold<S: Sending>(
    waiting: &mut Vec<u32>,
    s: &mut S,
    stream: u32,
    out: &mut BytesMut,
    limits: &mut SendLimits,
    data: &[u8],
    end_stream: bool,
) -> (usize, bool) {
    let (window, held) = s.outgoing();
    let was_waiting = held.is_waiting();
    let sent = Outgoing {
        stream,
        window,
        held,
    }
    .send(out, limits, data, end_stream);
    let waits = s.outgoing().1.is_waiting();
    if waits && !was_waiting {
        waiting.push(stream);
    }
    (sent, waits)
}

/// The peer's windows opened: sends what they now take of the held bytes of each stream in
/// `waiting`, in the order they began to wait. `sent(stream, state, bytes, over)` learns what
/// each one sent and whether its side is over, and returns whether to forget the stream
/// (remove it from `streams`). Streams gone, or with nothing held any more, leave `waiting`.
pub(crate) fn resume_waiting<S: Sending>(
    waiting: &mut Vec<u32>,
    streams: &mut super::StreamMap<S>,
    out: &mut BytesMut,
    limits: &mut SendLimits,
    encoder: &mut HpackEncoder,
    mut sent: impl FnMut(u32, &mut S, usize, bool) -> bool,
) {
    let mut list = std::mem::take(waiting);
    list.retain(|&stream| {
        let Some(s) = streams.get_mut(&stream) else {
            return false;
        };
        let (window, held) = s.outgoing();
        let (n, over) = Outgoing {
            stream,
            window,
            held,
        }
        .resume(out, limits, encoder);
        let waits = s.outgoing().1.is_waiting();
        if sent(stream, s, n, over) {
            streams.remove(&stream);
        }
        waits
    });
    *waiting = list;
}

/// What a peer may still send on a stream or a connection, and the bytes it sent that were
/// passed on but not yet given back in a WINDOW_UPDATE (given back in batches of half the
/// window).
#[derive(Debug)]
pub(crate) struct RecvWindow {
    window: i64,
    unacked: u32,
    size: u32,
}

impl RecvWindow {
    /// A window of `size` bytes: what this side advertised.
    pub(crate) fn new(size: u32) -> Self {
        Self {
            window: i64::from(size),
            unacked: 0,
            size,
        }
    }

    /// The peer sent `len` bytes (padding included): `Err` when they overrun the window
    /// (a FLOW_CONTROL_ERROR, RFC 9113 section 6.9.1).
    pub(crate) fn receive(&mut self, len: usize) -> Result<(), ErrorCode> {
        self.window -= len as i64;
        if self.window < 0 {
            return Err(ErrorCode::FLOW_CONTROL_ERROR);
        }
        Ok(())
    }

    /// `n` received bytes were passed on (or dropped): once half the window waits to be
    /// given back, the WINDOW_UPDATE for stream `stream` goes into `out`.
    pub(crate) fn release(&mut self, n: usize, stream: u32, out: &mut BytesMut) {
        self.unacked = self.unacked.saturating_add(n as u32);
        if self.unacked >= self.size / 2 {
            let increment = std::mem::take(&mut self.unacked);
            self.window += i64::from(increment);
            WindowUpdate {
                stream_id: stream,
                increment,
            }
            .encode(out);
        }
    }
}

#[cfg(test)]
mod tests {
    use skewless_frame::Frames;

    use super::*;

    /// The frames in `out` as (kind, END_STREAM, payload length), and `out` emptied.
    fn sent(out: &mut BytesMut) -> Vec<(Kind, bool, usize)> {
        let frames = Frames::new(out, 1 << 24)
            .map(|f| {
                let (head, payload) = f.expect("a whole frame");
                (head.kind, head.has(flags::END_STREAM), payload.len())
            })
            .collect();
        out.clear();
        frames
    }

    fn limits(window: i64) -> SendLimits {
        SendLimits {
            window,
            initial_window: window,
            max_frame: 16_384,
        }
    }

    #[test]
    fn bytes_over_the_window_are_held_and_go_out_in_order_as_it_opens() {
        let (mut out, mut limits) = (BytesMut::new(), limits(1_000));
        let (mut window, mut held) = (10i64, Held::default());
        let mut o = Outgoing {
            stream: 1,
            window: &mut window,
            held: &mut held,
        };
        assert_eq!(o.send(&mut out, &mut limits, &[1; 25], false), 10);
        assert_eq!(sent(&mut out), [(Kind::Data, false, 10)]);
        // More bytes wait behind the held ones even once the window has room.
        *o.window += 100;
        assert_eq!(o.send(&mut out, &mut limits, &[2; 5], true), 0);
        assert!(sent(&mut out).is_empty(), "nothing overtakes held bytes");
        assert_eq!(o.held.len(), 20);
        let mut encoder = HpackEncoder::new();
        assert_eq!(o.resume(&mut out, &mut limits, &mut encoder), (20, true));
        assert_eq!(sent(&mut out), [(Kind::Data, true, 20)]);
        assert!(!o.held.is_waiting());
        assert_eq!(
            limits.window,
            1_000 - 30,
            "the connection's window is spent too"
        );
    }

    #[test]
    fn the_connection_window_holds_bytes_back_like_the_streams() {
        let (mut out, mut limits) = (BytesMut::new(), limits(4));
        let (mut window, mut held) = (100i64, Held::default());
        let mut o = Outgoing {
            stream: 3,
            window: &mut window,
            held: &mut held,
        };
        assert_eq!(o.send(&mut out, &mut limits, &[0; 6], true), 4);
        assert_eq!(sent(&mut out), [(Kind::Data, false, 4)]);
        let mut encoder = HpackEncoder::new();
        assert_eq!(o.resume(&mut out, &mut limits, &mut encoder), (0, false));
        limits.window += 2;
        assert_eq!(o.resume(&mut out, &mut limits, &mut encoder), (2, true));
        assert_eq!(sent(&mut out), [(Kind::Data, true, 2)]);
    }

    #[test]
    fn trailers_wait_behind_held_bytes_and_end_the_stream() {
        let (mut out, mut limits) = (BytesMut::new(), limits(1_000));
        let (mut window, mut held) = (0i64, Held::default());
        let mut o = Outgoing {
            stream: 5,
            window: &mut window,
            held: &mut held,
        };
        assert_eq!(o.send(&mut out, &mut limits, &[0; 8], false), 0);
        o.held.hold_trailers([(&b"grpc-status"[..], &b"0"[..])]);
        *o.window = 8;
        let mut encoder = HpackEncoder::new();
        assert_eq!(o.resume(&mut out, &mut limits, &mut encoder), (8, true));
        let frames: Vec<_> = sent(&mut out)
            .into_iter()
            .map(|(kind, end, len)| (kind, end, (kind == Kind::Data).then_some(len)))
            .collect();
        assert_eq!(
            frames,
            [(Kind::Data, false, Some(8)), (Kind::Headers, true, None)],
            "the data, then the trailers with END_STREAM"
        );
    }

    #[test]
    fn an_empty_end_needs_no_window() {
        let (mut out, mut limits) = (BytesMut::new(), limits(0));
        let (mut window, mut held) = (0i64, Held::default());
        let mut o = Outgoing {
            stream: 7,
            window: &mut window,
            held: &mut held,
        };
        assert_eq!(o.send(&mut out, &mut limits, &[], true), 0);
        assert_eq!(sent(&mut out), [(Kind::Data, true, 0)]);
        assert!(!o.held.is_waiting());
    }

    #[test]
    fn a_receive_window_comes_back_in_halves_and_an_overrun_is_an_error() {
        let mut out = BytesMut::new();
        let mut w = RecvWindow::new(100);
        w.receive(60).expect("within the window");
        w.release(49, 9, &mut out);
        assert!(out.is_empty(), "under half the window: nothing yet");
        w.release(1, 9, &mut out);
        let frames: Vec<_> = Frames::new(&out, 1 << 14)
            .map(|f| f.expect("frame"))
            .collect();
        assert_eq!(frames.len(), 1);
        let (head, payload) = frames[0];
        let update = WindowUpdate::decode(&head, payload).expect("WINDOW_UPDATE");
        assert_eq!((update.stream_id, update.increment), (9, 50));
        // 40 left plus the 50 given back: 90 more fit, 91 do not.
        w.receive(90).expect("within the window");
        assert_eq!(w.receive(1), Err(ErrorCode::FLOW_CONTROL_ERROR));
    }
}
