//! Per-connection budgets for the frames that cost work but carry no call: PINGs (each one
//! answered), SETTINGS (each one applied and acknowledged) and RST_STREAMs (each one a stream
//! torn down). A peer gets one token bucket per kind; a frame header of that kind spends a
//! token, and a peer that empties a bucket is flooding.
//!
//! Shared by both modes: request mode's [`crate::request::flood_guard`] follows the client's
//! byte stream for the frame headers and spends here; connection mode's relay spends here from
//! the frame headers it reads anyway. The budgets are far above what a gRPC client sends (grpc-go's BDP
//! and keepalive PINGs, one SETTINGS per connection, one RST_STREAM per cancelled call), the
//! approach of Envoy's and nginx's HTTP/2 flood limits.

use skewless_frame::{Head, Kind};
use tokio::time::Instant;

/// A token bucket: `burst` frames at once, refilled at `per_second`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct FrameBudget {
    pub(crate) burst: u32,
    pub(crate) per_second: u32,
}

/// The budgets of one client connection, per frame kind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct FloodLimits {
    /// PINGs that ask for an answer (not acks).
    pub(crate) ping: FrameBudget,
    /// SETTINGS that ask for an ack (not acks).
    pub(crate) settings: FrameBudget,
    /// RST_STREAMs (a cancelled call sends one).
    pub(crate) rst_stream: FrameBudget,
}

impl Default for FloodLimits {
    fn default() -> Self {
        Self {
            ping: FrameBudget {
                burst: 1_000,
                per_second: 1_000,
            },
            settings: FrameBudget {
                burst: 100,
                per_second: 10,
            },
            rst_stream: FrameBudget {
                burst: 10_000,
                per_second: 10_000,
            },
        }
    }
}

/// Which budget a client emptied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Flood {
    #[error("PING flood")]
    Ping,
    #[error("SETTINGS flood")]
    Settings,
    #[error("RST_STREAM flood")]
    RstStream,
}

impl Flood {
    /// The flood as the `client_protocol_errors` label.
    #[must_use]
    pub fn client_error_reason(self) -> crate::metrics::ClientErrorReason {
        use crate::metrics::ClientErrorReason;
        match self {
            Self::Ping => ClientErrorReason::PingFlood,
            Self::Settings => ClientErrorReason::SettingsFlood,
            Self::RstStream => ClientErrorReason::RstStreamFlood,
        }
    }
}

#[derive(Debug)]
struct Bucket {
    budget: FrameBudget,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new(budget: FrameBudget, now: Instant) -> Self {
        Self {
            budget,
            tokens: f64::from(budget.burst),
            at: now,
        }
    }

    /// Spends one token; false when there was none.
    fn spend(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + elapsed * f64::from(self.budget.per_second))
            .min(f64::from(self.budget.burst));
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }
}

/// Whether a frame of this kind spends from a budget (so a caller can skip reading the clock
/// for every other frame).
pub(crate) fn budgeted(head: &Head) -> bool {
    matches!(head.kind, Kind::Ping | Kind::Settings | Kind::RstStream)
}

/// The buckets of one connection.
#[derive(Debug)]
pub(crate) struct FrameBudgets {
    ping: Bucket,
    settings: Bucket,
    rst_stream: Bucket,
}

impl FrameBudgets {
    pub(crate) fn new(limits: FloodLimits, now: Instant) -> Self {
        Self {
            ping: Bucket::new(limits.ping, now),
            settings: Bucket::new(limits.settings, now),
            rst_stream: Bucket::new(limits.rst_stream, now),
        }
    }

    /// Spends for the frame `head` (PINGs and SETTINGS that are not acks, RST_STREAMs; other
    /// frames are free); the flood it completes, if any.
    pub(crate) fn spend(&mut self, head: &Head, now: Instant) -> Option<Flood> {
        let (bucket, flood) = match head.kind {
            Kind::Ping if !head.is_ack() => (&mut self.ping, Flood::Ping),
            Kind::Settings if !head.is_ack() => (&mut self.settings, Flood::Settings),
            Kind::RstStream => (&mut self.rst_stream, Flood::RstStream),
            _ => return None,
        };
        (!bucket.spend(now)).then_some(flood)
    }
}
