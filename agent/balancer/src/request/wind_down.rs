//! Request mode's graceful close of a client connection on the h2 path: h2's two-phase GOAWAY,
//! with the final GOAWAY held until the client has written every stream it created.
//!
//! h2's graceful shutdown sends GOAWAY(2^31-1) and a PING, and the final GOAWAY (the last
//! stream it took) as soon as the PING's ACK comes in. A client that wrote its ACK ahead of a
//! stream it had created before it read GOAWAY(2^31-1) (grpc-core writes no stream frame in a
//! write that carries a PING ACK) then has that stream refused, and fails the call if it is
//! larger than its retry buffer. So the client socket's tap (`flood_guard::Guard`) holds that
//! ACK back from h2 (the frame is made one of an unknown type) and keeps its opaque data;
//! [`Settling`] runs the check connection mode's relay runs ([`crate::settle`]: the client
//! quiet, an empty SETTINGS, a PING) with SETTINGS frames sent through h2, and then has the
//! tap hand h2 the ACK, made up from what it kept, at a frame boundary: h2 sends the final
//! GOAWAY with every stream the client wrote. A client that never goes quiet gets it half the
//! drain grace after the first.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::settle;
use crate::upstream;

/// The shutdown PING's ACK, as the tap keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ack {
    /// Not come yet.
    Awaited,
    /// Its header came (made a frame of an unknown type); `have` bytes of its opaque data so
    /// far.
    Capturing { opaque: [u8; 8], have: u8 },
    /// Held back from h2, with its opaque data.
    Held([u8; 8]),
    /// h2 has it (handed on as it came, or made up from the held one): its final GOAWAY is
    /// out.
    Handed,
}

/// What the tap saw of the client, and what the connection's owner asks of the tap.
#[derive(Debug)]
pub(crate) struct Seen {
    pub(crate) ack: Ack,
    /// The highest stream a HEADERS frame came on.
    pub(crate) highest: u32,
    /// The client has ended every stream it opened and is inside no header block.
    pub(crate) quiet: bool,
    /// SETTINGS ACKs and PING ACKs (other than the held one) the client sent since the wind-down
    /// started (wrapping).
    pub(crate) settings_acks: u32,
    pub(crate) ping_acks: u32,
    /// The owner's word: hand h2 the ACK (now, or as it comes).
    pub(crate) release: bool,
}

/// Shared by a client connection's owner and its socket's tap.
#[derive(Debug)]
pub(crate) struct WindDown {
    started: AtomicBool,
    seen: Mutex<Seen>,
    /// The tap saw something.
    changed: Notify,
}

impl Default for WindDown {
    fn default() -> Self {
        Self {
            started: AtomicBool::new(false),
            seen: Mutex::new(Seen {
                ack: Ack::Awaited,
                highest: 0,
                quiet: false,
                settings_acks: 0,
                ping_acks: 0,
                release: false,
            }),
            changed: Notify::new(),
        }
    }
}

impl WindDown {
    /// Set by the owner before it starts h2's graceful shutdown; the tap follows the client
    /// closely from then on.
    pub(crate) fn start(&self) {
        self.started.store(true, Ordering::Relaxed);
    }

    pub(crate) fn started(&self) -> bool {
        self.started.load(Ordering::Relaxed)
    }

    pub(crate) fn seen(&self) -> MutexGuard<'_, Seen> {
        // Nothing panics while holding it; a poisoned lock's state is still consistent.
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Called by the tap after each read while winding down.
    pub(crate) fn changed(&self) {
        self.changed.notify_one();
    }
}

/// The owner's side of the settling (see the module docs).
pub(crate) struct Settling<'a> {
    shared: &'a WindDown,
    check: settle::Check,
    /// What the client's SETTINGS ACKs count when ours went out: the next one is its ACK; and
    /// whether that SETTINGS stands for the check's PING.
    settings_out: Option<(u32, bool)>,
    /// When the ACK goes to h2 even if the client has not settled.
    deadline: Instant,
    done: bool,
}

impl<'a> Settling<'a> {
    /// Starts the wind-down: h2's graceful shutdown, the final GOAWAY held for at most half of
    /// `grace`.
    pub(crate) fn start<T, B>(
        conn: &mut h2::server::Connection<T, B>,
        shared: &'a WindDown,
        grace: Duration,
    ) -> Self
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
        B: bytes::Buf,
    {
        shared.start();
        conn.graceful_shutdown();
        Self {
            shared,
            check: settle::Check::new(),
            settings_out: None,
            deadline: Instant::now() + grace / 2,
            done: false,
        }
    }

    /// After every turn of the connection: the next frame of the check, or the word to hand
    /// h2 the ACK.
    ///
    /// The check's PING is a second SETTINGS: h2 sends no PING of its own while its shutdown
    /// PING is unanswered (and it stays so until the ACK is handed on), and a SETTINGS sent
    /// once the first one's ACK is here is acknowledged in a later write just the same. Each
    /// SETTINGS carries the stream window h2 already has, so it changes nothing. h2 refuses
    /// to send one while a SETTINGS of its own is unacknowledged; then the ACK of that one
    /// answers the round.
    pub(crate) fn step<T, B>(&mut self, conn: &mut h2::server::Connection<T, B>)
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
        B: bytes::Buf,
    {
        if self.done {
            return;
        }
        let mut seen = self.shared.seen();
        if seen.release || seen.ack == Ack::Handed {
            self.done = true;
            return;
        }
        if !matches!(seen.ack, Ack::Held(_)) {
            return;
        }
        if let Some((at, ping)) = self.settings_out
            && seen.settings_acks != at
        {
            self.settings_out = None;
            if ping {
                self.check.ping_acked();
            } else {
                self.check.settings_acked();
            }
        }
        let ping = match self.check.step(seen.highest, seen.quiet, seen.ping_acks) {
            settle::Next::Wait => return,
            settle::Next::Settings => false,
            settle::Next::Ping => true,
            settle::Next::Final => {
                tracing::debug!(last = seen.highest, "client quiet, final GOAWAY");
                seen.release = true;
                self.done = true;
                return;
            }
        };
        self.settings_out = Some((seen.settings_acks, ping));
        let _ = conn.set_initial_window_size(upstream::STREAM_WINDOW);
    }

    /// Resolves when the tap saw something, or when the deadline passed (after which the
    /// ACK goes to h2); never once the check is done.
    pub(crate) async fn wait(&mut self) {
        if self.done {
            return std::future::pending().await;
        }
        tokio::select! {
            () = self.shared.changed.notified() => {}
            () = tokio::time::sleep_until(self.deadline) => {
                tracing::debug!("client not quiet within half the grace, final GOAWAY");
                self.shared.seen().release = true;
                self.done = true;
            }
        }
    }
}
