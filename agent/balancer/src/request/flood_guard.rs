//! Request mode's guard against clients that flood a connection with frames that cost the
//! balancer work but carry no call: PINGs (each one answered), SETTINGS (each one applied and
//! acknowledged) and RST_STREAMs (each one a stream torn down).
//!
//! h2 bounds what such frames make it hold (one pending PONG, one pending SETTINGS ack, reset
//! streams capped by `max_pending_accept_reset_streams` and `max_local_error_reset_streams`),
//! but not how many it processes: a client that reads its PONGs can keep a core busy answering
//! them for as long as it likes. So the client's byte stream is followed frame by frame (the
//! frame headers only, as [`crate::upstream::server_frames`] does for upstreams; decoding stays h2's) and each kind
//! spends from its own token bucket ([`crate::flood`]); a client that empties one is cut off
//! and counted: nothing more is read from it, and the connection's owner sends it
//! GOAWAY(ENHANCE_YOUR_CALM) and closes it (RFC 9113 sections 5.4.1 and 10.5). The budgets are
//! far above what a gRPC client sends (grpc-go's BDP and keepalive PINGs, one SETTINGS per
//! connection, one RST_STREAM per cancelled call), the approach of Envoy's and nginx's HTTP/2
//! flood limits.
//!
//! The guard also checks the preface: after the magic, the client's first frame must be a
//! SETTINGS frame that is not an ACK (RFC 9113 section 3.4); h2 accepts any frame there, so a
//! SETTINGS ACK would otherwise pass for a preface and escape the handshake deadline. Any
//! other first frame cuts the client off the same way, with GOAWAY(PROTOCOL_ERROR).
//!
//! Once the connection winds down, the same tap takes part in its graceful close
//! ([`crate::request::wind_down`]; `Closing` here): it holds the shutdown PING's ACK back from
//! h2 until the client has settled, and keeps from h2 the WINDOW_UPDATEs that would make it
//! fail the connection over the streams its final GOAWAY refused.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use skewless_frame::{Follower, HEADER_LEN, Head, Kind, Ping, flags};
use tokio::io::ReadBuf;
use tokio::{sync::oneshot, time::Instant};

use crate::flood::FrameBudgets;
pub(crate) use crate::flood::{Flood, FloodLimits};
use crate::request::wind_down::{Ack, WindDown};
use crate::socket::ReadTap;

/// Why the guard cut a client off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// It emptied a frame budget.
    Flood(Flood),
    /// Its first frame after the magic was not a SETTINGS frame without ACK.
    BadPreface,
}

impl Cut {
    /// The error code of the GOAWAY the client gets.
    pub(crate) fn reason(self) -> h2::Reason {
        match self {
            Self::Flood(_) => h2::Reason::ENHANCE_YOUR_CALM,
            Self::BadPreface => h2::Reason::PROTOCOL_ERROR,
        }
    }
}

/// The per-connection state: where the frame boundaries are, and the buckets.
#[derive(Debug)]
pub(crate) struct FloodGuard {
    frames: Follower,
    state: Followed,
}

/// What the guard learned from the frame headers so far.
#[derive(Debug)]
struct Followed {
    budgets: FrameBudgets,
    tripped: Option<Cut>,
    /// The client's first frame was a SETTINGS without ACK: its preface is complete (the
    /// magic, which h2's handshake ends with, then that SETTINGS).
    settings_seen: bool,
    /// A frame came by after the magic.
    first_seen: bool,
    /// A PING (not an ACK) came by since this was last cleared: the client keeps its
    /// connection alive (see `Config::idle_timeout`).
    pinged: bool,
    /// The highest stream id a HEADERS frame came by on.
    last_headers: u32,
    /// The client's streams it has not ended yet (END_STREAM or RST_STREAM), oldest first:
    /// whether it is quiet when its connection winds down (see `request::wind_down`).
    open: Vec<u32>,
    /// More streams were open at once than `open` keeps: the client is never taken for quiet.
    open_overflow: bool,
    /// A header block is under way (HEADERS or CONTINUATION without END_HEADERS).
    in_block: bool,
}

/// Most open streams [`Followed::open`] keeps: twice the streams h2 lets a client have.
const MAX_OPEN_KEPT: usize = 2 * crate::request::client::MAX_CLIENT_STREAMS as usize;

impl Followed {
    /// One frame header: the preface check and what it spends. `now` is read from `clock`
    /// once, when a first header needs it.
    fn head(&mut self, head: &Head, now: &mut Option<Instant>, clock: &impl Fn() -> Instant) {
        if self.tripped.is_some() {
            return;
        }
        if !std::mem::replace(&mut self.first_seen, true) {
            if head.kind == Kind::Settings && !head.is_ack() {
                self.settings_seen = true;
            } else {
                self.tripped = Some(Cut::BadPreface);
                return;
            }
        }
        let ends = head.flags & flags::END_STREAM != 0;
        match head.kind {
            Kind::Headers => {
                self.in_block = head.flags & flags::END_HEADERS == 0;
                if head.stream_id > self.last_headers {
                    // A new stream (h2 checks that it is odd and rising).
                    self.last_headers = head.stream_id;
                    if !ends {
                        if self.open.len() < MAX_OPEN_KEPT {
                            self.open.push(head.stream_id);
                        } else {
                            self.open_overflow = true;
                        }
                    }
                } else if ends {
                    self.ended(head.stream_id);
                }
                return;
            }
            Kind::Continuation => {
                self.in_block = head.flags & flags::END_HEADERS == 0;
                return;
            }
            Kind::Data if ends => {
                self.ended(head.stream_id);
                return;
            }
            Kind::RstStream => self.ended(head.stream_id),
            Kind::Ping | Kind::Settings => {}
            _ => return,
        }
        self.pinged |= head.kind == Kind::Ping && !head.is_ack();
        let now = *now.get_or_insert_with(clock);
        self.tripped = self.budgets.spend(head, now).map(Cut::Flood);
    }
}

impl Followed {
    /// The client ended stream `id`.
    fn ended(&mut self, id: u32) {
        if let Some(at) = self.open.iter().position(|&s| s == id) {
            self.open.remove(at);
        }
    }

    /// The client has ended every stream it opened and is inside no header block.
    fn quiet(&self) -> bool {
        self.open.is_empty() && !self.open_overflow && !self.in_block
    }
}

impl FloodGuard {
    pub(crate) fn new(limits: FloodLimits, now: Instant) -> Self {
        Self {
            // Frame sizes are h2's to check: the follower accepts any.
            frames: Follower::client(skewless_frame::MAX_MAX_FRAME_SIZE),
            state: Followed {
                budgets: FrameBudgets::new(limits, now),
                tripped: None,
                settings_seen: false,
                first_seen: false,
                pinged: false,
                last_headers: 0,
                open: Vec::new(),
                open_overflow: false,
                in_block: false,
            },
        }
    }

    /// Follows `bytes` read from the client; the cut-off they complete (a flood, or a first
    /// frame that is not the preface's SETTINGS), if any. Once tripped it stays tripped. A
    /// broken magic or frame is h2's to report: the guard stops following.
    /// `clock` is read only when a frame that can spend from a budget (PING, SETTINGS,
    /// RST_STREAM) comes by, at most once per read: most reads carry none and need
    /// no clock (a call's reads are part of its CPU cost).
    pub(crate) fn feed(&mut self, bytes: &[u8], clock: impl Fn() -> Instant) -> Option<Cut> {
        if self.state.tripped.is_none() {
            let mut now = None;
            let Self { frames, state } = self;
            // An error (a broken preface) ends the following; the headers before it count.
            let _ = frames.each_head(bytes, |head| state.head(&head, &mut now, &clock));
        }
        self.state.tripped
    }

    /// As [`FloodGuard::feed`], also handing `f` each header (until a cut-off), with its bytes
    /// when they lie whole in `bytes`, to rewrite, what follows it (see
    /// [`Follower::each_head_mut`]), and what the guard has followed up to it.
    fn feed_mut(
        &mut self,
        bytes: &mut [u8],
        clock: impl Fn() -> Instant,
        mut f: impl FnMut(&Head, Option<&mut [u8; HEADER_LEN]>, &[u8], &Followed),
    ) -> Option<Cut> {
        if self.state.tripped.is_none() {
            let mut now = None;
            let Self { frames, state } = self;
            let _ = frames.each_head_mut(bytes, |head, whole, after| {
                state.head(&head, &mut now, &clock);
                if state.tripped.is_none() {
                    f(&head, whole, after, state);
                }
            });
        }
        self.state.tripped
    }
}

/// Client connections cut off for a flood, by kind.
#[derive(Debug, Default)]
pub(crate) struct FloodCounters {
    pub(crate) ping: AtomicU64,
    pub(crate) settings: AtomicU64,
    pub(crate) rst_stream: AtomicU64,
}

impl FloodCounters {
    pub(crate) fn count(&self, flood: Flood) {
        let cell = match flood {
            Flood::Ping => &self.ping,
            Flood::Settings => &self.settings,
            Flood::RstStream => &self.rst_stream,
        };
        cell.fetch_add(1, Ordering::Relaxed);
    }
}

/// A client socket's [`ReadTap`]. The read that completes a cut-off is still handed to h2
/// (at most one read buffer of frames, so h2 has seen the magic and can send its GOAWAY),
/// the cut-off is counted once (floods) and sent on `cut`, and nothing more is read.
/// It also tells when the client's preface is complete (its first SETTINGS came by):
/// h2's server handshake ends with the 24-byte magic, so a client that sends the magic and
/// nothing more would otherwise hold its connection with no deadline.
pub(crate) struct Guard {
    guard: FloodGuard,
    counters: Arc<FloodCounters>,
    preface_done: Option<oneshot::Sender<()>>,
    cut: Option<oneshot::Sender<Cut>>,
    /// Set when the client sends a PING, cleared by the connection's idle check.
    pinged: Arc<AtomicBool>,
    closing: Closing,
}

impl Guard {
    /// `wind_down` is shared with the connection's owner (see [`Closing`]).
    pub(crate) fn new(
        limits: FloodLimits,
        counters: Arc<FloodCounters>,
        preface_done: oneshot::Sender<()>,
        cut: oneshot::Sender<Cut>,
        pinged: Arc<AtomicBool>,
        wind_down: Arc<WindDown>,
    ) -> Self {
        Self {
            guard: FloodGuard::new(limits, Instant::now()),
            counters,
            preface_done: Some(preface_done),
            cut: Some(cut),
            pinged,
            closing: Closing {
                shared: wind_down,
                refused_above: None,
                held: [0; HEADER_LEN],
                held_len: 0,
            },
        }
    }
}

/// A frame type no endpoint knows: a receiver ignores the frame (RFC 9113 section 4.1).
const IGNORED_KIND: u8 = 0xfb;

/// The tap's part in a connection's wind-down (`request::wind_down`), from the moment the
/// owner starts it: it holds the shutdown PING's ACK back from h2 and hands h2 one made up
/// from it when told; it reports the client's streams and ACKs; and it keeps from h2 the
/// client's WINDOW_UPDATEs for streams h2's final GOAWAY refused.
///
/// h2 (0.4) ignores HEADERS above its final GOAWAY's last stream without counting the stream
/// as opened, so a WINDOW_UPDATE for it (grpc-core sends one for a large message before it
/// has read the final GOAWAY) looks to h2 like one on an idle stream: a connection error,
/// GOAWAY(PROTOCOL_ERROR), and every call still finishing on the connection fails. RFC 9113
/// section 6.8 says the frame is to be ignored; so it is made a frame of an unknown type. The
/// streams refused are those above the highest a HEADERS frame came on when h2 got the ACK.
///
/// While winding down, the bytes of a frame header split across reads are held back until it
/// is whole, so that each can be rewritten.
struct Closing {
    shared: Arc<WindDown>,
    /// Once h2 has the ACK: the streams above this one are refused.
    refused_above: Option<u32>,
    /// The start of a frame header held back from h2 (see [`ReadTap::held`]).
    held: [u8; HEADER_LEN],
    held_len: u8,
}

impl Closing {
    /// Follows what a read brought (the held bytes, then the new ones; the follower has
    /// forgotten the held ones) while the connection winds down; returns how many bytes at
    /// its end to hold back.
    fn feed(&mut self, guard: &mut FloodGuard, bytes: &mut [u8]) -> (Option<Cut>, usize) {
        let mut seen = self.shared.seen();
        if let Ack::Capturing { mut opaque, have } = seen.ack {
            // The rest of the held ACK's opaque data comes first (no header is held inside a
            // payload).
            let have = usize::from(have);
            let n = (opaque.len() - have).min(bytes.len());
            opaque[have..have + n].copy_from_slice(&bytes[..n]);
            seen.ack = capturing(opaque, have + n);
        }
        let refused_above = &mut self.refused_above;
        let cut = guard.feed_mut(
            bytes,
            Instant::now,
            |head, whole, after, followed| match head.kind {
                Kind::Ping if head.is_ack() && seen.ack == Ack::Awaited => match whole {
                    Some(whole) if !seen.release && head.len == 8 => {
                        whole[3] = IGNORED_KIND;
                        let n = after.len().min(8);
                        let mut opaque = [0; 8];
                        opaque[..n].copy_from_slice(&after[..n]);
                        seen.ack = capturing(opaque, n);
                    }
                    _ => {
                        // h2 gets it as it came: its final GOAWAY takes the streams so far.
                        seen.ack = Ack::Handed;
                        *refused_above = Some(followed.last_headers);
                    }
                },
                Kind::Ping if head.is_ack() => seen.ping_acks = seen.ping_acks.wrapping_add(1),
                Kind::Settings if head.is_ack() => {
                    seen.settings_acks = seen.settings_acks.wrapping_add(1);
                }
                Kind::WindowUpdate
                    if head.stream_id != 0 && refused_above.is_some_and(|l| head.stream_id > l) =>
                {
                    if let Some(whole) = whole {
                        whole[3] = IGNORED_KIND;
                    } else {
                        tracing::debug!(
                            stream = head.stream_id,
                            "a WINDOW_UPDATE for a refused stream was handed on before it was whole"
                        );
                    }
                }
                _ => {}
            },
        );
        seen.highest = guard.state.last_headers;
        seen.quiet = guard.state.quiet();
        drop(seen);
        self.shared.changed();
        let partial = guard.frames.partial_header().len();
        // Only a header begun in this read can be held back whole.
        if cut.is_some() || partial == 0 || partial > bytes.len() {
            return (cut, 0);
        }
        guard.frames.unread_partial_header();
        self.held[..partial].copy_from_slice(&bytes[bytes.len() - partial..]);
        // A header is 9 bytes.
        self.held_len = partial as u8;
        (cut, partial)
    }

    /// Once the owner said so: the held ACK, made up again, for h2 to read next, at a frame
    /// boundary of the client's.
    fn inject(&mut self, guard: &FloodGuard, buf: &mut ReadBuf<'_>) -> bool {
        let frame_len = HEADER_LEN + 8;
        if self.held_len > 0 || !guard.frames.at_boundary() || buf.remaining() < frame_len {
            return false;
        }
        let mut seen = self.shared.seen();
        let (Ack::Held(opaque), true) = (seen.ack, seen.release) else {
            return false;
        };
        seen.ack = Ack::Handed;
        self.refused_above = Some(seen.highest);
        let mut frame = Vec::with_capacity(frame_len);
        Ping { ack: true, opaque }.encode(&mut frame);
        buf.put_slice(&frame);
        true
    }
}

/// The ACK's state with `have` bytes of its opaque data in `opaque`.
fn capturing(opaque: [u8; 8], have: usize) -> Ack {
    if have >= opaque.len() {
        Ack::Held(opaque)
    } else {
        // Fewer than 8.
        Ack::Capturing {
            opaque,
            have: have as u8,
        }
    }
}

impl ReadTap for Guard {
    fn stalled(&self) -> bool {
        self.guard.state.tripped.is_some()
    }

    fn held(&self) -> &[u8] {
        &self.closing.held[..usize::from(self.closing.held_len)]
    }

    fn inject(&mut self, buf: &mut ReadBuf<'_>) -> bool {
        self.closing.shared.started() && self.closing.inject(&self.guard, buf)
    }

    fn read(&mut self, bytes: &mut [u8]) -> io::Result<usize> {
        // Before the wind-down (almost every read) nothing is rewritten nor held.
        let (cut, keep) = if self.closing.shared.started() {
            self.closing.held_len = 0;
            self.closing.feed(&mut self.guard, bytes)
        } else {
            (self.guard.feed(bytes, Instant::now), 0)
        };
        let state = &mut self.guard.state;
        if std::mem::take(&mut state.pinged) {
            self.pinged.store(true, Ordering::Relaxed);
        }
        if state.settings_seen
            && let Some(done) = self.preface_done.take()
        {
            let _ = done.send(());
        }
        if let Some(cut) = cut
            && let Some(tx) = self.cut.take()
        {
            if let Cut::Flood(flood) = cut {
                self.counters.count(flood);
            }
            tracing::debug!(?cut, "client cut off, closing its connection");
            let _ = tx.send(cut);
        }
        Ok(keep)
    }

    fn release(&mut self, n: usize) {
        let f = &mut self.closing;
        let len = usize::from(f.held_len);
        // Handed on as they are: the follower takes them now (they complete no header).
        self.guard.feed(&f.held[..n], Instant::now);
        f.held.copy_within(n..len, 0);
        // At most 9.
        f.held_len = (len - n) as u8;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::BytesMut;
    use skewless_frame::{Head, Kind, PREFACE, Ping};

    use crate::flood::FrameBudget;

    use super::*;

    fn frame(kind: Kind, flags: u8, stream_id: u32, len: u32) -> Vec<u8> {
        let mut b = Head::new(kind, flags, stream_id, len).encode().to_vec();
        b.resize(b.len() + len as usize, 0);
        b
    }

    fn ping() -> Vec<u8> {
        let mut b = BytesMut::new();
        Ping {
            ack: false,
            opaque: [1; 8],
        }
        .encode(&mut b);
        b.to_vec()
    }

    /// The magic and the client's SETTINGS: a complete preface (it spends one SETTINGS).
    fn hello() -> Vec<u8> {
        let mut b = PREFACE.to_vec();
        b.extend(frame(Kind::Settings, 0, 0, 0));
        b
    }

    fn limits(burst: u32, per_second: u32) -> FloodLimits {
        let b = FrameBudget { burst, per_second };
        FloodLimits {
            ping: b,
            settings: b,
            rst_stream: b,
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_burst_within_the_budget_passes_and_one_more_trips_it() {
        let mut g = FloodGuard::new(limits(10, 10), Instant::now());
        assert_eq!(g.feed(&hello(), Instant::now), None);
        for _ in 0..10 {
            assert_eq!(g.feed(&ping(), Instant::now), None, "within the burst");
        }
        assert_eq!(g.feed(&ping(), Instant::now), Some(Cut::Flood(Flood::Ping)));
        assert_eq!(
            g.feed(&frame(Kind::Data, 0, 1, 0), Instant::now),
            Some(Cut::Flood(Flood::Ping)),
            "tripped for good"
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_steady_rate_at_the_refill_never_trips() {
        let mut g = FloodGuard::new(limits(5, 100), Instant::now());
        g.feed(&hello(), Instant::now);
        for _ in 0..10_000 {
            tokio::time::advance(Duration::from_millis(10)).await;
            assert_eq!(
                g.feed(&ping(), Instant::now),
                None,
                "100 per second is allowed"
            );
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn each_kind_has_its_own_budget_and_acks_and_other_frames_are_free() {
        let mut g = FloodGuard::new(limits(3, 1), Instant::now());
        g.feed(&hello(), Instant::now);
        let mut bytes = Vec::new();
        for i in 0..3 {
            bytes.extend(ping());
            // The preface spent one SETTINGS.
            if i > 0 {
                bytes.extend(frame(Kind::Settings, 0, 0, 0));
            }
            bytes.extend(frame(Kind::RstStream, 0, 1, 4));
        }
        for _ in 0..1_000 {
            bytes.extend(frame(Kind::Settings, 0x1, 0, 0));
            bytes.extend(frame(Kind::Ping, 0x1, 0, 8));
            bytes.extend(frame(Kind::Data, 0, 1, 16));
            bytes.extend(frame(Kind::WindowUpdate, 0, 0, 4));
        }
        assert_eq!(g.feed(&bytes, Instant::now), None);
        assert_eq!(
            g.feed(&frame(Kind::Settings, 0, 0, 0), Instant::now),
            Some(Cut::Flood(Flood::Settings))
        );
        let mut g = FloodGuard::new(limits(3, 1), Instant::now());
        g.feed(&hello(), Instant::now);
        let rsts: Vec<u8> = (0..4)
            .flat_map(|i| frame(Kind::RstStream, 0, 2 * i + 1, 4))
            .collect();
        assert_eq!(
            g.feed(&rsts, Instant::now),
            Some(Cut::Flood(Flood::RstStream))
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn only_frames_that_spend_read_the_clock() {
        let mut g = FloodGuard::new(limits(10, 10), Instant::now());
        assert_eq!(g.feed(&hello(), Instant::now), None);
        let no_clock = || -> Instant { panic!("the clock was read for frames that cost nothing") };
        let mut bytes = frame(Kind::Headers, 0x4, 1, 20);
        bytes.extend(frame(Kind::Data, 0x1, 1, 100));
        bytes.extend(frame(Kind::WindowUpdate, 0, 0, 4));
        bytes.extend(frame(Kind::GoAway, 0, 0, 8));
        assert_eq!(g.feed(&bytes, no_clock), None);
        let reads = std::cell::Cell::new(0);
        let counting = || {
            reads.set(reads.get() + 1);
            Instant::now()
        };
        let mut pings = ping();
        pings.extend(ping());
        assert_eq!(g.feed(&pings, counting), None);
        assert_eq!(reads.get(), 1, "one clock read for the PINGs of one read");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn frames_split_across_reads_are_followed() {
        let mut g = FloodGuard::new(limits(2, 1), Instant::now());
        let mut bytes = hello();
        for _ in 0..3 {
            bytes.extend(ping());
        }
        let mut tripped = None;
        for b in bytes.chunks(1) {
            tripped = tripped.or(g.feed(b, Instant::now));
        }
        assert_eq!(
            tripped,
            Some(Cut::Flood(Flood::Ping)),
            "a byte at a time, the third PING trips it"
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_preface_is_complete_only_with_a_settings_frame_that_is_no_ack() {
        let mut g = FloodGuard::new(FloodLimits::default(), Instant::now());
        assert_eq!(g.feed(PREFACE, Instant::now), None, "the magic alone");
        assert!(!g.state.settings_seen, "not complete after the magic");
        assert_eq!(g.feed(&frame(Kind::Settings, 0, 0, 6), Instant::now), None);
        assert!(g.state.settings_seen, "complete with the client's SETTINGS");
        assert_eq!(
            g.feed(&frame(Kind::Settings, 0x1, 0, 0), Instant::now),
            None,
            "an ACK after it is fine"
        );
        for (first, what) in [
            (frame(Kind::Settings, 0x1, 0, 0), "a SETTINGS ACK"),
            (frame(Kind::Ping, 0, 0, 8), "a PING"),
            (frame(Kind::Headers, 0x4, 1, 3), "HEADERS"),
            (frame(Kind::WindowUpdate, 0, 0, 4), "a WINDOW_UPDATE"),
        ] {
            let mut g = FloodGuard::new(FloodLimits::default(), Instant::now());
            let mut bytes = PREFACE.to_vec();
            bytes.extend(&first);
            bytes.extend(frame(Kind::Settings, 0, 0, 0));
            assert_eq!(
                g.feed(&bytes, Instant::now),
                Some(Cut::BadPreface),
                "{what} as the first frame is no preface"
            );
            assert!(!g.state.settings_seen, "{what}: never complete");
        }
    }

    /// A guard whose connection winds down from its start, and the flag.
    /// A guard whose connection winds down from its start; `released`: the owner has already
    /// said to hand h2 the shutdown PING's ACK as it comes (the settle deadline passed).
    fn winding_guard(released: bool) -> Guard {
        let wind_down = Arc::new(WindDown::default());
        wind_down.start();
        wind_down.seen().release = released;
        Guard::new(
            FloodLimits::default(),
            Arc::default(),
            oneshot::channel().0,
            oneshot::channel().0,
            Arc::default(),
            wind_down,
        )
    }

    /// What a client sends across a wind-down whose shutdown PING's ACK goes to h2 as it
    /// comes, and what h2 must get: WINDOW_UPDATEs for streams above the last HEADERS before
    /// that ACK (stream 1) ignored, from the ACK on; every other byte as sent.
    fn across_the_final_go_away() -> (Vec<u8>, Vec<u8>) {
        let window_update = |stream| frame(Kind::WindowUpdate, 0, stream, 4);
        let (mut sent, mut ignored) = (hello(), Vec::new());
        let mut put = |f: Vec<u8>, ignore: bool| {
            if ignore {
                ignored.push(sent.len() + 3);
            }
            sent.extend(f);
        };
        put(frame(Kind::Headers, 0x4, 1, 20), false);
        put(window_update(1), false);
        put(window_update(3), false);
        put(frame(Kind::Ping, 0x1, 0, 8), false);
        put(frame(Kind::Headers, 0x4, 3, 20), false);
        put(window_update(3), true);
        put(window_update(0), false);
        put(window_update(1), false);
        put(frame(Kind::Data, 0, 1, 30), false);
        put(window_update(7), true);
        put(frame(Kind::Ping, 0x1, 0, 8), false);
        put(window_update(5), true);
        let mut want = sent.clone();
        for at in ignored {
            want[at] = IGNORED_KIND;
        }
        (sent, want)
    }

    /// Passes `sent` through `guard` in reads of `cut` bytes as [`crate::socket::Tapped`]
    /// does: what the guard holds goes first in the next read.
    fn through(guard: &mut Guard, sent: &[u8], cut: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for piece in sent.chunks(cut) {
            let mut bytes = guard.held().to_vec();
            bytes.extend_from_slice(piece);
            let keep = guard.read(&mut bytes).expect("read");
            out.extend_from_slice(&bytes[..bytes.len() - keep]);
        }
        assert!(
            guard.held().is_empty(),
            "the stream ends at a frame boundary"
        );
        out
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn window_updates_for_streams_the_final_goaway_refused_are_ignored_in_any_reads() {
        let (sent, want) = across_the_final_go_away();
        for cut in 1..=sent.len() {
            assert_eq!(
                through(&mut winding_guard(true), &sent, cut),
                want,
                "in reads of {cut} bytes"
            );
        }
        let mut before = Guard::new(
            FloodLimits::default(),
            Arc::default(),
            oneshot::channel().0,
            oneshot::channel().0,
            Arc::default(),
            Arc::default(),
        );
        assert_eq!(
            through(&mut before, &sent, 7),
            sent,
            "nothing is rewritten before the connection winds down"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_tapped_socket_hands_on_held_bytes_first_and_in_order() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (sent, want) = across_the_final_go_away();
        for read_size in [4096, 11, 5] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let mut client = tokio::net::TcpStream::connect(listener.local_addr().expect("addr"))
                .await
                .expect("connect");
            let (server, _) = listener.accept().await.expect("accept");
            let mut tapped = crate::socket::Tapped::new(
                server,
                winding_guard(true),
                crate::socket::Close::AtOnce,
            );
            let writer = {
                let sent = sent.clone();
                tokio::spawn(async move {
                    // Pieces that split frame headers, each read on its own.
                    for piece in sent.chunks(6) {
                        client.write_all(piece).await.expect("write");
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                })
            };
            let mut got = Vec::new();
            let mut buf = vec![0u8; read_size];
            loop {
                let n = tapped.read(&mut buf).await.expect("read");
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
            writer.await.expect("writer");
            if read_size > HEADER_LEN {
                assert_eq!(got, want, "reads of at most {read_size} bytes");
            } else {
                // Too small a buffer for the held bytes and more: they go on as they are.
                assert_eq!(got.len(), sent.len(), "reads of at most {read_size} bytes");
                let differ: Vec<usize> = (0..sent.len()).filter(|&i| got[i] != sent[i]).collect();
                assert!(
                    differ.iter().all(|&i| want[i] == got[i]),
                    "only rewrites differ: {differ:?}"
                );
            }
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_shutdown_pings_ack_is_held_until_released_then_made_up_for_h2() {
        let opaque = *b"shutdown";
        let ack = |f: &mut Vec<u8>| {
            Ping { ack: true, opaque }.encode(f);
        };
        let mut sent = hello();
        sent.extend(frame(Kind::Headers, 0x4 | 0x1, 1, 20));
        sent.extend(frame(Kind::Headers, 0x4, 3, 20));
        let ack_at = sent.len();
        ack(&mut sent);
        sent.extend(frame(Kind::Headers, 0x4, 5, 20));
        sent.extend(frame(Kind::Data, 0x1, 3, 10));
        for cut in 1..=sent.len() {
            let mut g = winding_guard(false);
            let got = through(&mut g, &sent, cut);
            let mut want = sent.clone();
            want[ack_at + 3] = IGNORED_KIND;
            assert_eq!(
                got, want,
                "the ACK is kept from h2, in reads of {cut} bytes"
            );
            {
                let seen = g.closing.shared.seen();
                assert_eq!(seen.ack, Ack::Held(opaque), "in reads of {cut} bytes");
                assert_eq!((seen.highest, seen.quiet), (5, false), "stream 5 is open");
            }
            let mut space = [0u8; 64];
            let mut buf = ReadBuf::new(&mut space);
            assert!(!g.inject(&mut buf), "not before the owner says so");
            g.closing.shared.seen().release = true;
            assert!(g.inject(&mut buf));
            let mut made_up = Vec::new();
            ack(&mut made_up);
            assert_eq!(buf.filled(), made_up, "the ACK, made up again");
            assert_eq!(g.closing.shared.seen().ack, Ack::Handed);
            assert!(!g.inject(&mut ReadBuf::new(&mut space)), "once");
            // From then on the streams above 5 are refused.
            let mut late = frame(Kind::WindowUpdate, 0, 7, 4);
            late.extend(frame(Kind::WindowUpdate, 0, 5, 4));
            let mut want = late.clone();
            want[3] = IGNORED_KIND;
            assert_eq!(through(&mut g, &late, cut), want, "in reads of {cut} bytes");
        }
        // Quiet once every stream is ended.
        let mut g = winding_guard(false);
        let mut ended = sent.clone();
        ended.extend(frame(Kind::RstStream, 0, 5, 4));
        through(&mut g, &ended, 7);
        assert!(g.closing.shared.seen().quiet, "streams 1, 3 and 5 ended");
    }
}
