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

use skewless_frame::{Follower, Kind};
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
    budgets: FrameBudgets,
    tripped: Option<Cut>,
    /// The client's first frame was a SETTINGS without ACK: its preface is complete (the
    /// magic, which h2's handshake ends with, then that SETTINGS).
    settings_seen: bool,
    /// A frame came by after the magic.
    first_seen: bool,
    /// A PING (not an ACK) came by since this was last cleared: the client keeps its
    /// connection alive (see `Config::idle_timeout`).
    pub(crate) pinged: bool,
}

impl FloodGuard {
    pub(crate) fn new(limits: FloodLimits, now: Instant) -> Self {
        Self {
            // Frame sizes are h2's to check: the follower accepts any.
            frames: Follower::client(skewless_frame::MAX_MAX_FRAME_SIZE),
            budgets: FrameBudgets::new(limits, now),
            tripped: None,
            settings_seen: false,
            first_seen: false,
            pinged: false,
        }
    }

    /// Follows `bytes` read from the client; the cut-off they complete (a flood, or a first
    /// frame that is not the preface's SETTINGS), if any. Once tripped it stays tripped. A
    /// broken magic or frame is h2's to report: the guard stops following.
    /// `clock` is read only when a frame that can spend from a budget (PING, SETTINGS,
    /// RST_STREAM) comes by, at most once per read: most reads carry none and need
    /// no clock (a call's reads are part of its CPU cost).
    pub(crate) fn feed(&mut self, bytes: &[u8], clock: impl Fn() -> Instant) -> Option<Cut> {
        if self.tripped.is_some() {
            return self.tripped;
        }
        let mut now = None;
        let Self {
            frames,
            budgets,
            tripped,
            settings_seen,
            first_seen,
            pinged,
        } = self;
        // An error (a broken preface) ends the following; the headers before it count.
        let _ = frames.each_head(bytes, |head| {
            if tripped.is_some() {
                return;
            }
            if !std::mem::replace(first_seen, true) {
                if head.kind == Kind::Settings && !head.is_ack() {
                    *settings_seen = true;
                } else {
                    *tripped = Some(Cut::BadPreface);
                    return;
                }
            }
            if !matches!(head.kind, Kind::Ping | Kind::Settings | Kind::RstStream) {
                return;
            }
            *pinged |= head.kind == Kind::Ping && !head.is_ack();
            let now = *now.get_or_insert_with(&clock);
            *tripped = budgets.spend(&head, now).map(Cut::Flood);
        });
        *tripped
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
}

impl Guard {
    pub(crate) fn new(
        limits: FloodLimits,
        counters: Arc<FloodCounters>,
        preface_done: oneshot::Sender<()>,
        cut: oneshot::Sender<Cut>,
        pinged: Arc<AtomicBool>,
    ) -> Self {
        Self {
            guard: FloodGuard::new(limits, Instant::now()),
            counters,
            preface_done: Some(preface_done),
            cut: Some(cut),
            pinged,
        }
    }
}

impl ReadTap for Guard {
    fn stalled(&self) -> bool {
        self.guard.tripped.is_some()
    }

    fn read(&mut self, bytes: &[u8]) -> io::Result<()> {
        let cut = self.guard.feed(bytes, Instant::now);
        if std::mem::take(&mut self.guard.pinged) {
            self.pinged.store(true, Ordering::Relaxed);
        }
        if self.guard.settings_seen
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
        Ok(())
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
        assert!(!g.settings_seen, "not complete after the magic");
        assert_eq!(g.feed(&frame(Kind::Settings, 0, 0, 6), Instant::now), None);
        assert!(g.settings_seen, "complete with the client's SETTINGS");
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
            assert!(!g.settings_seen, "{what}: never complete");
        }
    }
}
