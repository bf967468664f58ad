//! The rotation state machine of one relayed connection: the graceful two-phase GOAWAY the
//! relay sends the client, and the GOAWAYs the backend sends, as one last-stream-id.
//!
//! `Open -> [Quiescing ->] Announced -> Settling -> Final` (docs/connection-mode.md has the
//! diagram): a phase never goes back, and the final GOAWAY is sent at most once.
//! Invariants: the last-stream-id the client is told never rises (ours or a backend's
//! GOAWAY, forwarded lowered when needed); no GOAWAY of ours goes out before the rotation is
//! announced; client streams above the final GOAWAY's last-stream-id are refused. Pure state:
//! the frames it sends are queued on the client's [`Out`], the time is passed in, and the
//! stream table's figures (highest client stream, whether the client is quiet) are given.

use skewless_frame::{ErrorCode, MAX_STREAM_ID, Settings};
use tokio::time::Instant;

use super::conn::{Out, Side};
use crate::metrics::RotationReason;
use crate::settle;

/// Our PING's opaque data: no gRPC server uses it (grpc-go sends 0x0106010800030309, Java a
/// counter), so its ACK is recognised and swallowed, every other ACK is forwarded.
pub(super) const OUR_PING: [u8; 8] = *b"skwl\x00rot";

/// The opaque data of the PING that starts a quiesce (see [`Phase::Quiescing`]).
pub(super) const OUR_QUIESCE_PING: [u8; 8] = *b"skwl\x00qui";

/// The opaque data of our last PING before the final GOAWAY, the one that shows the client
/// has written everything it had queued (see [`Rotation::settle_step`]).
pub(super) const OUR_QUIET_PING: [u8; 8] = *b"skwl\x00fin";

/// Where a rotation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Open,
    /// A client that writes its requests lazily is being rotated: our quiesce PING is sent and
    /// no frame of the backend's goes to the client until its ACK (or the quiesce timeout).
    ///
    /// nghttp2 (Node's http2, under grpc-js) gives a request its stream id and writes its
    /// HEADERS only when it next sends, and once any GOAWAY has been received it refuses every
    /// request not written yet, GOAWAY(2^31-1) included; grpc-js retries such a call only
    /// while it fits its retry buffer, so a large one fails. Node answers a PING in its next
    /// send, and one send writes everything nghttp2 has queued (the ACK first, then the
    /// HEADERS of new requests). Holding the backend's frames from our PING until its ACK means
    /// that when the ACK comes, every request the client made in reaction to a frame it read
    /// is written; GOAWAY(2^31-1) then goes out before any later frame that could make it
    /// start another. A request started from a timer (not in reaction to a frame) can still
    /// meet the GOAWAY unwritten.
    Quiescing,
    /// GOAWAY(2^31-1) and our PING sent; waiting for its ACK or the timeout.
    Announced,
    /// The ACK came: the client has read GOAWAY(2^31-1) and opens no new stream, but streams
    /// it had already created may still be on their way (a client may write the ACK ahead
    /// of them). Every stream is still relayed; the final GOAWAY waits until the client is
    /// quiet (see [`Rotation::settle_step`]).
    Settling,
    /// The final GOAWAY sent: streams above its last-stream-id are refused.
    Final,
}

/// What became of a client's PING ACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ack {
    /// The ACK of a PING of ours: swallowed.
    Ours,
    /// The ACK of a backend's PING: forwarded.
    Theirs,
}

#[derive(Debug)]
pub(super) struct Rotation {
    pub(super) phase: Phase,
    pub(super) reason: Option<RotationReason>,
    /// Lowest last-stream-id any GOAWAY to the client carried (ours or the backend's).
    go_last: Option<u32>,
    /// Our final GOAWAY's last-stream-id: client streams above it are refused.
    refuse_above: Option<u32>,
    /// When the final GOAWAY went out (for the refusal's trace line).
    final_at: Option<Instant>,
    /// Our PING's ACK arrived (taken by the run loop).
    pub(super) ping_acked: bool,
    /// Our quiesce PING's ACK arrived (taken by the run loop).
    pub(super) quiesce_acked: bool,
    /// Settling: where the check for unwritten streams stands.
    check: settle::Check,
    /// The backend's SETTINGS frames the client has not acknowledged yet (it acknowledges in
    /// the order it received them).
    backend_settings: u32,
    /// PING ACKs the client sent (wrapping): a write that carries one carries no stream.
    client_ping_acks: u32,
}

impl Rotation {
    pub(super) fn new() -> Self {
        Self {
            phase: Phase::Open,
            reason: None,
            go_last: None,
            refuse_above: None,
            final_at: None,
            ping_acked: false,
            quiesce_acked: false,
            check: settle::Check::new(),
            backend_settings: 0,
            client_ping_acks: 0,
        }
    }

    /// Whether the client stream `id` is refused: above our final GOAWAY.
    pub(super) fn refused(&self, id: u32) -> bool {
        id % 2 == 1 && self.refuse_above.is_some_and(|last| id > last)
    }

    /// Our final GOAWAY's last-stream-id, once it is out.
    pub(super) fn refuse_above(&self) -> Option<u32> {
        self.refuse_above
    }

    /// How long ago the final GOAWAY went out (0 before).
    pub(super) fn since_final(&self) -> std::time::Duration {
        self.final_at
            .map_or(std::time::Duration::ZERO, |t| t.elapsed())
    }

    /// Whether a GOAWAY the client was told (the backend's) puts stream `id` above it.
    pub(super) fn above_go_away(&self, id: u32) -> bool {
        self.go_last.is_some_and(|last| id > last)
    }

    /// The client acknowledged a SETTINGS: whether it was ours (it acknowledges in the order
    /// it read them, and ours went out behind the backend's then unacknowledged).
    pub(super) fn client_settings_ack(&mut self) -> Ack {
        if self.check.client_settings_ack() {
            return Ack::Ours;
        }
        self.backend_settings = self.backend_settings.saturating_sub(1);
        Ack::Theirs
    }

    /// The backend sent a SETTINGS (not an ACK) on its way to the client.
    pub(super) fn backend_settings(&mut self) {
        self.backend_settings = self.backend_settings.saturating_add(1);
    }

    /// The client sent a PING ACK with `opaque`: whether it answers a PING of ours.
    pub(super) fn client_ping_ack(&mut self, opaque: [u8; 8]) -> Ack {
        self.client_ping_acks = self.client_ping_acks.wrapping_add(1);
        match opaque {
            OUR_PING => self.ping_acked = true,
            OUR_QUIESCE_PING => self.quiesce_acked = true,
            OUR_QUIET_PING => self.check.ping_acked(),
            _ => return Ack::Theirs,
        }
        Ack::Ours
    }

    /// Whether a client's GOAWAY with `code` is its graceful close in answer to ours: not
    /// forwarded (the relay ends the backend's side itself, with FIN once every stream is done).
    pub(super) fn swallows_client_go_away(&self, code: ErrorCode) -> bool {
        self.phase != Phase::Open && code == ErrorCode::NO_ERROR
    }

    /// The backend sent a GOAWAY with `last`: the last-stream-id to forward, lowered to the
    /// one the client was already told if that is lower (it must never see one rise).
    pub(super) fn backend_go_away(&mut self, last: u32) -> u32 {
        let last = self.go_last.map_or(last, |sent| sent.min(last));
        self.go_last = Some(last);
        last
    }

    /// A rotation starts: with the quiesce (see [`Phase::Quiescing`]) when `quiesce` (a client
    /// that writes its requests lazily, or may) and no GOAWAY went to the client yet; else at
    /// once with step 1 ([`Rotation::announce`]). Returns whether step 1 went out; false also
    /// when a rotation is under way (it keeps its reason).
    pub(super) fn rotate(&mut self, reason: RotationReason, quiesce: bool, out: &mut Out) -> bool {
        if self.phase != Phase::Open {
            return false;
        }
        self.reason = Some(reason);
        if quiesce && self.go_last.is_none() {
            self.phase = Phase::Quiescing;
            out.ping(OUR_QUIESCE_PING);
            return false;
        }
        self.announce(out);
        true
    }

    /// Whether frames from `side` are held now (see [`Phase::Quiescing`]).
    pub(super) fn withholds(&self, side: Side) -> bool {
        side == Side::Backend && self.phase == Phase::Quiescing
    }

    /// Step 1 of a rotation: GOAWAY(2^31-1) (unless a GOAWAY already went to the client) and
    /// our PING; after the quiesce, ahead of the frames it held.
    pub(super) fn announce(&mut self, out: &mut Out) {
        if !matches!(self.phase, Phase::Open | Phase::Quiescing) {
            return;
        }
        self.phase = Phase::Announced;
        if self.go_last.is_none() {
            out.go_away(MAX_STREAM_ID, ErrorCode::NO_ERROR);
            self.go_last = Some(MAX_STREAM_ID);
        }
        out.ping(OUR_PING);
    }

    /// Our PING's ACK came: the client has read GOAWAY(2^31-1). Settle until it is quiet
    /// (see [`Rotation::settle_step`]).
    pub(super) fn settle(&mut self) {
        if self.phase == Phase::Announced {
            self.phase = Phase::Settling;
        }
    }

    /// Settling, called after every round of I/O with the highest stream the client opened
    /// and whether it is `quiet` (it has ended every stream it opened and is inside no header
    /// block): sends the final GOAWAY once the client has shown it has no stream left to
    /// write, else the next frame of that check ([`settle`]: an empty SETTINGS, then our quiet
    /// PING). Returns whether a frame was queued. A client that never goes quiet meets the
    /// settle deadline instead (the run loop's, half the drain grace). The previous rule (two
    /// quiet PINGs) relied on the client starting its next write before it read the second
    /// one.
    pub(super) fn settle_step(&mut self, highest: u32, quiet: bool, out: &mut Out) -> bool {
        if self.phase != Phase::Settling {
            return false;
        }
        if self.go_last.is_some_and(|sent| sent <= highest) {
            // A GOAWAY of the backend's already said as much as ours would: nothing to wait for.
            return self.finalize(highest, out);
        }
        match self.check.step(highest, quiet, self.client_ping_acks) {
            settle::Next::Wait => false,
            settle::Next::Settings => {
                self.check.settings_sent(self.backend_settings);
                Settings::encode(false, &[], &mut out.buf);
                true
            }
            settle::Next::Ping => {
                out.ping(OUR_QUIET_PING);
                true
            }
            settle::Next::Final => {
                tracing::debug!(last = highest, "client quiet, final GOAWAY");
                self.finalize(highest, out)
            }
        }
    }

    /// Step 2: the final GOAWAY with `highest`, the highest stream id the client opened (never
    /// above one already sent); later client streams are refused. Returns whether a frame was
    /// queued (none when a GOAWAY as low went out already, or on a second call).
    pub(super) fn finalize(&mut self, highest: u32, out: &mut Out) -> bool {
        if self.phase == Phase::Final {
            return false;
        }
        self.phase = Phase::Final;
        self.final_at = Some(Instant::now());
        let last = self.last_stream_id(highest);
        let queued = self.go_last != Some(last);
        if queued {
            out.go_away(last, ErrorCode::NO_ERROR);
            self.go_last = Some(last);
        }
        self.refuse_above = Some(last);
        queued
    }

    /// The last-stream-id of a GOAWAY to the client now: the highest stream it opened, never
    /// above one it was told.
    pub(super) fn last_stream_id(&self, highest: u32) -> u32 {
        self.go_last.map_or(highest, |sent| sent.min(highest))
    }
}

#[cfg(test)]
mod tests {
    use skewless_frame::{Frames, GoAway, Kind};

    use super::*;

    /// The frames queued for the client, as (kind, what identifies it), taken off `out`.
    fn sent(out: &mut Out) -> Vec<(Kind, u32)> {
        out.settle();
        let frames = Frames::new(&out.buf, 1 << 14)
            .map(|f| {
                let (head, payload) = f.expect("a well-formed frame");
                let id = match head.kind {
                    Kind::GoAway => GoAway::decode(&head, payload).unwrap().last_stream_id,
                    Kind::Ping => u32::from(payload[7]),
                    _ => 0,
                };
                (head.kind, id)
            })
            .collect();
        out.buf.clear();
        frames
    }

    const ROT: u32 = b't' as u32;
    const QUI: u32 = b'i' as u32;
    const FIN: u32 = b'n' as u32;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_rotation_announces_settles_when_quiet_and_ends_with_the_highest_stream() {
        let (mut r, mut out) = (Rotation::new(), Out::default());
        assert!(r.rotate(RotationReason::Skew, false, &mut out));
        assert_eq!(r.phase, Phase::Announced);
        assert_eq!(
            sent(&mut out),
            [(Kind::GoAway, MAX_STREAM_ID), (Kind::Ping, ROT)]
        );
        assert!(!r.rotate(RotationReason::Drain, false, &mut out), "once");
        assert_eq!(
            r.reason,
            Some(RotationReason::Skew),
            "the first reason stays"
        );
        assert!(
            !r.settle_step(7, true, &mut out),
            "nothing before our PING's ACK"
        );
        assert_eq!(r.client_ping_ack(OUR_PING), Ack::Ours);
        assert!(r.ping_acked);
        r.settle();
        // Quiet at stream 7: our SETTINGS, its ACK (no PING ACK between), the quiet PING, its
        // ACK: the final GOAWAY names 7.
        assert!(r.settle_step(7, true, &mut out));
        assert_eq!(sent(&mut out), [(Kind::Settings, 0)]);
        assert!(!r.settle_step(7, true, &mut out), "waiting for the ACK");
        assert_eq!(r.client_settings_ack(), Ack::Ours);
        assert!(r.settle_step(7, true, &mut out));
        assert_eq!(sent(&mut out), [(Kind::Ping, FIN)]);
        assert_eq!(r.client_ping_ack(OUR_QUIET_PING), Ack::Ours);
        assert!(r.settle_step(7, true, &mut out));
        assert_eq!(sent(&mut out), [(Kind::GoAway, 7)]);
        assert_eq!(r.phase, Phase::Final);
        assert!(
            r.refused(9) && !r.refused(7) && !r.refused(10),
            "odd ids above 7"
        );
        // Refused streams raise the highest id; a later final GOAWAY (the grace's) says
        // nothing new: the last-stream-id cannot rise.
        assert!(!r.finalize(11, &mut out));
        assert!(sent(&mut out).is_empty());
        assert!(r.refused(9), "still refused above 7");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_check_starts_over_when_a_stream_or_a_ping_ack_comes_in_between() {
        let (mut r, mut out) = (Rotation::new(), Out::default());
        r.rotate(RotationReason::MaxAge, false, &mut out);
        r.client_ping_ack(OUR_PING);
        r.settle();
        sent(&mut out);
        // A PING ACK between our SETTINGS and its ACK: that write may have been cut.
        assert!(r.settle_step(3, true, &mut out));
        assert_eq!(r.client_ping_ack(*b"backend!"), Ack::Theirs);
        r.client_settings_ack();
        assert!(r.settle_step(3, true, &mut out), "a new SETTINGS");
        assert_eq!(sent(&mut out), [(Kind::Settings, 0), (Kind::Settings, 0)]);
        // A stream opened between the SETTINGS and its ACK: over again.
        r.client_settings_ack();
        assert!(r.settle_step(5, true, &mut out));
        assert_eq!(sent(&mut out), [(Kind::Settings, 0)], "not the quiet PING");
        r.client_settings_ack();
        assert!(r.settle_step(5, true, &mut out));
        assert_eq!(sent(&mut out), [(Kind::Ping, FIN)]);
        // A stream after the quiet PING: over again, and nothing while the client is busy.
        r.client_ping_ack(OUR_QUIET_PING);
        assert!(
            !r.settle_step(7, false, &mut out),
            "not quiet: nothing to check"
        );
        assert_eq!(r.phase, Phase::Settling);
        assert!(r.settle_step(7, true, &mut out));
        assert_eq!(sent(&mut out), [(Kind::Settings, 0)]);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_last_stream_id_the_client_is_told_never_rises() {
        let (mut r, mut out) = (Rotation::new(), Out::default());
        assert_eq!(r.backend_go_away(99), 99);
        assert_eq!(
            r.backend_go_away(200),
            99,
            "lowered to what the client was told"
        );
        assert_eq!(r.backend_go_away(41), 41);
        assert!(r.above_go_away(43) && !r.above_go_away(41));
        // A rotation after a backend's GOAWAY: no GOAWAY(2^31-1), no quiesce.
        assert!(r.rotate(RotationReason::BackendRemoved, true, &mut out));
        assert_eq!(sent(&mut out), [(Kind::Ping, ROT)]);
        r.client_ping_ack(OUR_PING);
        r.settle();
        // The client opened up to 51 (above the backend's 41): the final GOAWAY says 41 again,
        // so nothing new goes out, and the check is not needed.
        assert!(!r.settle_step(51, false, &mut out));
        assert_eq!(r.phase, Phase::Final);
        assert!(sent(&mut out).is_empty());
        assert!(r.refused(43));
        assert_eq!(r.last_stream_id(51), 41);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_lazy_client_is_quiesced_before_it_sees_any_goaway() {
        let (mut r, mut out) = (Rotation::new(), Out::default());
        assert!(!r.rotate(RotationReason::Skew, true, &mut out));
        assert_eq!(r.phase, Phase::Quiescing);
        assert_eq!(sent(&mut out), [(Kind::Ping, QUI)], "a PING, no GOAWAY yet");
        assert!(r.withholds(Side::Backend) && !r.withholds(Side::Client));
        assert_eq!(r.client_ping_ack(OUR_QUIESCE_PING), Ack::Ours);
        assert!(r.quiesce_acked);
        r.announce(&mut out);
        assert!(!r.withholds(Side::Backend));
        assert_eq!(
            sent(&mut out),
            [(Kind::GoAway, MAX_STREAM_ID), (Kind::Ping, ROT)]
        );
        r.announce(&mut out);
        assert!(sent(&mut out).is_empty(), "step 1 goes out once");
    }

    #[test]
    fn our_settings_ack_is_told_from_the_backends_by_their_order() {
        let (mut r, mut out) = (Rotation::new(), Out::default());
        r.rotate(RotationReason::Skew, false, &mut out);
        r.client_ping_ack(OUR_PING);
        r.settle();
        // Two backend SETTINGS on their way to the client, then ours.
        r.backend_settings();
        r.backend_settings();
        assert!(r.settle_step(1, true, &mut out));
        assert_eq!(r.client_settings_ack(), Ack::Theirs);
        assert_eq!(r.client_settings_ack(), Ack::Theirs);
        assert_eq!(r.client_settings_ack(), Ack::Ours);
        assert_eq!(
            r.client_settings_ack(),
            Ack::Theirs,
            "a later one is not ours"
        );
    }

    #[test]
    fn only_a_graceful_client_goaway_during_a_rotation_is_swallowed() {
        let (mut r, mut out) = (Rotation::new(), Out::default());
        assert!(
            !r.swallows_client_go_away(ErrorCode::NO_ERROR),
            "no rotation"
        );
        r.rotate(RotationReason::Skew, false, &mut out);
        assert!(r.swallows_client_go_away(ErrorCode::NO_ERROR));
        assert!(!r.swallows_client_go_away(ErrorCode::PROTOCOL_ERROR));
    }
}
