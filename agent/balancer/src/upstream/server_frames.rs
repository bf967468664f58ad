//! The read tap of an upstream connection's socket ([`crate::socket`]): it reports what the
//! connection's monitors need: the first bytes the server sends, the first GOAWAY frame it
//! sends, and (for the liveness monitor) every read that carried HEADERS or DATA.
//!
//! h2's client handshake completes without hearing from the server, so a connection to a
//! listener that still exists but no longer serves (a pod shutting down, a backlog nobody
//! accepts) would look usable, and requests written to it would be lost: the connection is only
//! published once the server has spoken (its SETTINGS frame). And h2 gives no signal when the
//! server sends GOAWAY (its streams in flight go on; new ones fail), while the balancer wants to
//! stop using the connection and open its replacement at once. So the tap follows the frame
//! boundaries of what it reads: it looks at each 9-byte frame header and skips the payload,
//! which is all it takes to see a GOAWAY (type 0x7) go by, and to tell the server's own frames
//! (HEADERS, DATA: what gRPC servers count as activity) from PING answers. Decoding stays h2's.

use std::io;
use std::sync::Arc;

use skewless_frame::{Follower, Kind};
use tokio::net::TcpStream;
use tokio::sync::{Notify, oneshot};

use crate::liveness::Signals;
use crate::socket::{Close, ReadTap, Tapped};

/// What the tap reports, each at most once.
pub(crate) struct Events {
    /// The server sent its first bytes.
    pub(crate) spoke: oneshot::Receiver<()>,
    /// Notified (once) when the server sends a GOAWAY.
    pub(crate) go_away: Arc<Notify>,
}

/// An upstream socket's tap: reports [`Events`] as the server's bytes are read.
pub(crate) struct ServerFrames {
    spoke: Option<oneshot::Sender<()>>,
    go_away: Option<Arc<Notify>>,
    frames: FrameHeaders,
    signals: Arc<Signals>,
}

/// Wraps an upstream `stream` (closed at once when dropped); reads carrying HEADERS or DATA
/// are counted in `signals`.
pub(crate) fn watched(stream: TcpStream, signals: Arc<Signals>) -> (Tapped<ServerFrames>, Events) {
    let (spoke_tx, spoke) = oneshot::channel();
    let go_away = Arc::new(Notify::new());
    let tap = ServerFrames {
        spoke: Some(spoke_tx),
        go_away: Some(go_away.clone()),
        frames: FrameHeaders::default(),
        signals,
    };
    (
        Tapped::new(stream, tap, Close::AtOnce),
        Events { spoke, go_away },
    )
}

/// Follows frame boundaries in a server-to-client HTTP/2 byte stream (which, unlike the
/// client's, has no preface: it starts with a frame).
#[derive(Debug)]
struct FrameHeaders(Follower);

impl Default for FrameHeaders {
    fn default() -> Self {
        // Frame sizes are h2's to check: the follower accepts any.
        Self(Follower::new(skewless_frame::MAX_MAX_FRAME_SIZE))
    }
}

/// What one read carried.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Seen {
    go_away: bool,
    /// A HEADERS, CONTINUATION or DATA frame header.
    heard: bool,
}

impl FrameHeaders {
    /// Consumes `bytes`: which of the frame headers we care about were among them.
    fn feed(&mut self, bytes: &[u8]) -> Seen {
        let mut seen = Seen::default();
        // A server's stream has no preface and any frame length is accepted: no error.
        let _ = self.0.each_head(bytes, |head| {
            seen.go_away |= head.kind == Kind::GoAway;
            seen.heard |= matches!(head.kind, Kind::Headers | Kind::Continuation | Kind::Data);
        });
        seen
    }
}

impl ReadTap for ServerFrames {
    fn read(&mut self, bytes: &mut [u8]) -> io::Result<usize> {
        if let Some(tx) = self.spoke.take() {
            let _ = tx.send(());
        }
        let seen = self.frames.feed(bytes);
        if seen.heard {
            self.signals.heard();
        }
        if seen.go_away
            && let Some(go_away) = self.go_away.take()
        {
            // Stores a permit if nobody waits yet: the event is not lost.
            go_away.notify_one();
        }
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use skewless_frame::HEADER_LEN;

    const GOAWAY: u8 = 0x7;

    fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            kind,
            0,
            0,
            0,
            0,
            0,
        ];
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn a_goaway_header_is_seen_across_any_read_boundaries() {
        // SETTINGS, a DATA frame whose payload looks like a GOAWAY header, then a GOAWAY.
        let mut stream = frame(0x4, &[0; 6]);
        stream.extend(frame(0x0, &frame(GOAWAY, &[0; 8])));
        let before_goaway = stream.len();
        stream.extend(frame(GOAWAY, &[0; 8]));
        for chunk in 1..=stream.len() {
            let mut f = FrameHeaders::default();
            let mut seen_at = None;
            for (i, piece) in stream.chunks(chunk).enumerate() {
                if f.feed(piece).go_away && seen_at.is_none() {
                    seen_at = Some((i + 1) * chunk);
                }
            }
            let seen_at = seen_at.expect("the GOAWAY is seen");
            assert!(
                seen_at >= before_goaway + HEADER_LEN,
                "chunk {chunk}: seen after {seen_at} bytes, inside the DATA payload"
            );
        }
    }

    #[test]
    fn payloads_are_skipped_not_parsed() {
        let mut f = FrameHeaders::default();
        assert!(!f.feed(&frame(0x0, &[GOAWAY; 100])).go_away);
        assert!(!f.feed(&frame(0x1, &[0; 3])).go_away);
        assert!(f.feed(&frame(GOAWAY, &[0; 8])).go_away);
    }

    #[test]
    fn headers_and_data_count_as_the_server_speaking_ping_answers_do_not() {
        const PING: u8 = 0x6;
        let mut f = FrameHeaders::default();
        assert!(!f.feed(&frame(0x4, &[0; 6])).heard, "SETTINGS");
        assert!(!f.feed(&frame(PING, &[0; 8])).heard, "a PING answer");
        assert!(!f.feed(&frame(0x8, &[0; 4])).heard, "WINDOW_UPDATE");
        assert!(f.feed(&frame(0x1, &[0; 3])).heard, "HEADERS");
        assert!(f.feed(&frame(0x0, &[PING; 20])).heard, "DATA");
        let mut split = frame(PING, &[0; 8]);
        split.extend(frame(0x0, &[0; 2]));
        let (a, b) = split.split_at(14);
        assert!(
            !f.feed(a).heard && f.feed(b).heard,
            "DATA after a PING, split"
        );
    }
}
