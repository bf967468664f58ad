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

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use skewless_frame::{Follower, HEADER_LEN, Head, Kind};
use tokio::{sync::oneshot, time::Instant};

use crate::flood::FrameBudgets;
pub(crate) use crate::flood::{Flood, FloodLimits};
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
}

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
        if head.kind == Kind::Headers {
            self.last_headers = self.last_headers.max(head.stream_id);
        }
        if !matches!(head.kind, Kind::Ping | Kind::Settings | Kind::RstStream) {
            return;
        }
        self.pinged |= head.kind == Kind::Ping && !head.is_ack();
        let now = *now.get_or_insert_with(clock);
        self.tripped = self.budgets.spend(head, now).map(Cut::Flood);
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
    /// when they lie whole in `bytes`, to rewrite (see [`Follower::each_head_mut`]).
    pub(crate) fn feed_mut(
        &mut self,
        bytes: &mut [u8],
        clock: impl Fn() -> Instant,
        mut f: impl FnMut(&Head, Option<&mut [u8; HEADER_LEN]>),
    ) -> Option<Cut> {
        if self.state.tripped.is_none() {
            let mut now = None;
            let Self { frames, state } = self;
            let _ = frames.each_head_mut(bytes, |head, whole| {
                state.head(&head, &mut now, &clock);
                if state.tripped.is_none() {
                    f(&head, whole);
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
    final_go_away: FinalGoAway,
}

impl Guard {
    /// `winding_down` is set by the connection's owner before it starts h2's graceful
    /// shutdown (see [`FinalGoAway`]).
    pub(crate) fn new(
        limits: FloodLimits,
        counters: Arc<FloodCounters>,
        preface_done: oneshot::Sender<()>,
        cut: oneshot::Sender<Cut>,
        pinged: Arc<AtomicBool>,
        winding_down: Arc<AtomicBool>,
    ) -> Self {
        Self {
            guard: FloodGuard::new(limits, Instant::now()),
            counters,
            preface_done: Some(preface_done),
            cut: Some(cut),
            pinged,
            final_go_away: FinalGoAway {
                winding_down,
                refused_above: None,
                held: [0; HEADER_LEN],
                held_len: 0,
            },
        }
    }
}

/// A frame type no endpoint knows: a receiver ignores the frame (RFC 9113 section 4.1).
const IGNORED_KIND: u8 = 0xfb;

/// Keeps the client's WINDOW_UPDATEs for streams h2's final GOAWAY refused from h2.
///
/// h2's graceful shutdown sends GOAWAY (last stream 2^31-1) and a PING; when the client's PING
/// ACK comes in, h2 sends the final GOAWAY with the last stream it took and ignores HEADERS
/// above it. But h2 (0.4) does not count such a stream as opened, so a WINDOW_UPDATE for it
/// (grpc-core sends one for a large message before it has read the final GOAWAY) looks to h2
/// like one on an idle stream: a connection error, GOAWAY(PROTOCOL_ERROR), and every call
/// still finishing on the connection fails. RFC 9113 section 6.8 says the frame is to be
/// ignored; so it is made a frame of an unknown type before h2 reads it.
///
/// The stream h2 takes last is at most the highest stream a HEADERS frame came by on before
/// the first PING ACK after the owner set `winding_down` (the balancer sends no PING of its
/// own on a client connection). From then on the guard holds back the bytes of a frame header
/// split across reads until it is whole, so that each can be rewritten.
struct FinalGoAway {
    winding_down: Arc<AtomicBool>,
    /// Once the shutdown's PING came back: the streams above this one are refused.
    refused_above: Option<u32>,
    /// The start of a frame header held back from h2 (see [`ReadTap::held`]).
    held: [u8; HEADER_LEN],
    held_len: u8,
}

impl FinalGoAway {
    /// Follows what a read brought (the held bytes, then the new ones; the follower has
    /// forgotten the held ones) while the connection winds down; returns how many bytes at
    /// its end to hold back.
    fn feed(&mut self, guard: &mut FloodGuard, bytes: &mut [u8]) -> (Option<Cut>, usize) {
        let mut last_headers = guard.state.last_headers;
        let refused_above = &mut self.refused_above;
        let cut = guard.feed_mut(bytes, Instant::now, |head, whole| match head.kind {
            Kind::Headers => last_headers = last_headers.max(head.stream_id),
            Kind::Ping if head.is_ack() && refused_above.is_none() => {
                *refused_above = Some(last_headers);
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
        });
        let partial = guard.frames.partial_header().len();
        // Only a header begun in this read can be held back whole.
        if self.refused_above.is_none() || cut.is_some() || partial == 0 || partial > bytes.len() {
            return (cut, 0);
        }
        guard.frames.unread_partial_header();
        self.held[..partial].copy_from_slice(&bytes[bytes.len() - partial..]);
        // A header is 9 bytes.
        self.held_len = partial as u8;
        (cut, partial)
    }
}

impl ReadTap for Guard {
    fn stalled(&self) -> bool {
        self.guard.state.tripped.is_some()
    }

    fn held(&self) -> &[u8] {
        &self.final_go_away.held[..usize::from(self.final_go_away.held_len)]
    }

    fn read(&mut self, bytes: &mut [u8]) -> io::Result<usize> {
        // Before the wind-down (almost every read) nothing is rewritten nor held.
        let (cut, keep) = if self.final_go_away.winding_down.load(Ordering::Relaxed) {
            self.final_go_away.held_len = 0;
            self.final_go_away.feed(&mut self.guard, bytes)
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
        let f = &mut self.final_go_away;
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
    fn winding_guard() -> Guard {
        Guard::new(
            FloodLimits::default(),
            Arc::default(),
            oneshot::channel().0,
            oneshot::channel().0,
            Arc::default(),
            Arc::new(AtomicBool::new(true)),
        )
    }

    /// What a client sends across a wind-down, and what h2 must get: WINDOW_UPDATEs for
    /// streams above the last HEADERS before the shutdown PING's ACK (stream 1) ignored, from
    /// that ACK on; every other byte as sent.
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
                through(&mut winding_guard(), &sent, cut),
                want,
                "in reads of {cut} bytes"
            );
        }
        let mut before = winding_guard();
        before
            .final_go_away
            .winding_down
            .store(false, Ordering::Relaxed);
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
            let mut tapped =
                crate::socket::Tapped::new(server, winding_guard(), crate::socket::Close::AtOnce);
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
}
