//! The check before a graceful close's final GOAWAY that the client has no stream it created
//! and has not written yet: connection mode's relay runs it (`connection::relay::rotation`),
//! and request mode's h2 path (`request::wind_down`).
//!
//! The PING that follows GOAWAY(2^31-1) proves, once acknowledged, that the client has read
//! that GOAWAY, so it creates no stream any more, but not that every stream it created before
//! has reached us. grpc-core (its `writing.cc`) writes the streams' frames only in a write
//! that carries no PING ACK: a write with an ACK is cut to the ACK and the connection's
//! control frames. A stream it created just before it read the GOAWAY may so come one or
//! several writes after the ACK, and after any number of further ACKs if PINGs keep coming. A
//! final GOAWAY below such a stream makes the client fail or retry a call it had sent
//! (grpc-core cannot retry one larger than its retry buffer, 256 KiB).
//!
//! So once the client is quiet (it has ended every stream it opened, so nothing of its own is
//! left to write ahead of a new stream's HEADERS), an empty SETTINGS goes out. The client's
//! ACK of it goes in a write that also writes every stream it has queued; if no PING ACK came
//! between our SETTINGS and its ACK, that write was not cut. Then a PING of ours: its ACK comes
//! in a later write, so once it is here that whole write is too. The client quiet throughout
//! with no new stream: the final GOAWAY names the highest stream it opened. Otherwise the
//! check starts over when it is quiet again; a client that never goes quiet meets the
//! caller's deadline instead.

/// What the check needs next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Nothing: wait for the client (quiet, or an ACK).
    Wait,
    /// Send an empty SETTINGS (and say behind how many unacknowledged ones it went:
    /// [`Check::settings_sent`]; or report its ACK: [`Check::settings_acked`]).
    Settings,
    /// Send our PING (and report its ACK: [`Check::ping_acked`]).
    Ping,
    /// The client has written every stream it created: the final GOAWAY may go.
    Final,
}

/// Where the check stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Nothing of ours in flight: the check starts when the client is quiet.
    Idle,
    /// Our empty SETTINGS is out; `highest` and `acks` (the client's PING ACKs so far) as
    /// when it was sent.
    Settings { highest: u32, acks: u32 },
    /// Its ACK came in a write with no PING ACK; our PING is out, sent at `highest`.
    Ping { highest: u32 },
}

/// The check (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Check {
    stage: Stage,
    /// Our SETTINGS' ACK arrived (taken by [`Check::step`]).
    settings_acked: bool,
    /// Our PING's ACK arrived (taken by [`Check::step`]).
    ping_acked: bool,
    /// Our SETTINGS is out, behind this many the client has not acknowledged yet.
    ours_behind: Option<u32>,
}

impl Check {
    pub(crate) const fn new() -> Self {
        Self {
            stage: Stage::Idle,
            settings_acked: false,
            ping_acked: false,
            ours_behind: None,
        }
    }

    /// The client acknowledged our SETTINGS.
    pub(crate) fn settings_acked(&mut self) {
        self.settings_acked = true;
    }

    /// Our SETTINGS went out behind `behind` SETTINGS frames the client has not acknowledged.
    pub(crate) fn settings_sent(&mut self, behind: u32) {
        self.ours_behind = Some(behind);
    }

    /// The client acknowledged a SETTINGS: whether it was ours (it acknowledges in the order
    /// it read them; see [`Check::settings_sent`]).
    pub(crate) fn client_settings_ack(&mut self) -> bool {
        match self.ours_behind {
            Some(0) => {
                self.ours_behind = None;
                self.settings_acked();
                true
            }
            Some(n) => {
                self.ours_behind = Some(n - 1);
                false
            }
            None => false,
        }
    }

    /// The client acknowledged our PING.
    pub(crate) fn ping_acked(&mut self) {
        self.ping_acked = true;
    }

    /// One step, after every round of I/O, with the highest stream the client opened, whether
    /// it is `quiet` (it has ended every stream it opened and is inside no header block), and
    /// how many PING ACKs it has sent (wrapping): what to send next, or that the final GOAWAY
    /// may go.
    pub(crate) fn step(&mut self, highest: u32, quiet: bool, ping_acks: u32) -> Next {
        match self.stage {
            Stage::Settings { highest: at, acks } if std::mem::take(&mut self.settings_acked) => {
                if quiet && at == highest && acks == ping_acks {
                    self.stage = Stage::Ping { highest };
                    self.ping_acked = false;
                    return Next::Ping;
                }
                self.stage = Stage::Idle;
            }
            Stage::Ping { highest: at } if std::mem::take(&mut self.ping_acked) => {
                if quiet && at == highest {
                    return Next::Final;
                }
                self.stage = Stage::Idle;
            }
            _ => {}
        }
        if quiet && self.stage == Stage::Idle {
            self.stage = Stage::Settings {
                highest,
                acks: ping_acks,
            };
            self.settings_acked = false;
            return Next::Settings;
        }
        Next::Wait
    }
}
