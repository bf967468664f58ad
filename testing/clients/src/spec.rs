//! What a client run does, as the three clients' shared command line.

use std::time::Duration;

/// Which client library.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientKind {
    /// Python `grpcio` (gRPC C-core), from the venv `cargo xtask setup` makes.
    Grpcio,
    /// Node's `@grpc/grpc-js`, from the npm packages `cargo xtask setup` installs.
    GrpcJs,
    /// tonic (hyper + h2), the `skewless-tonic-client` binary of this crate.
    Tonic,
}

impl ClientKind {
    /// Every client, in the order the compatibility table lists them.
    pub const ALL: [Self; 3] = [Self::Grpcio, Self::GrpcJs, Self::Tonic];

    /// The name the client reports in [`crate::ClientResult::client`].
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Grpcio => "grpcio",
            Self::GrpcJs => "grpc-js",
            Self::Tonic => "tonic",
        }
    }
}

impl std::fmt::Display for ClientKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One run's load. Every run is bounded: `calls` unary calls at most, and no new call after
/// `duration` (when set); streams last `stream`/`bidi`.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientSpec {
    /// `host:port` (an IPv6 host in brackets).
    pub target: String,
    /// Unary calls at most.
    pub calls: u64,
    /// Unary calls in flight.
    pub concurrency: u32,
    /// No new unary (or large) call after this; `None`: until `calls` are done.
    pub duration: Option<Duration>,
    /// Deadline of each small unary call.
    pub timeout: Duration,
    /// Channels, each one HTTP/2 connection (pick_first); calls are dealt over them.
    pub channels: u32,
    /// Request payload of the small calls, bytes.
    pub payload: u32,
    /// Server-side delay of each small call (the echo request's `delay_ms`): keeps
    /// `concurrency` calls in flight at a bounded rate.
    pub call_delay: Option<Duration>,
    /// Large unary calls (one at a time, next to the others).
    pub large_calls: u32,
    /// Their request and reply size, bytes.
    pub large_bytes: u32,
    /// Hold one server-streaming call open this long (a reply every 50 ms).
    pub stream: Option<Duration>,
    /// Run one bidi stream this long: a message every 50 ms (or as often as the client
    /// manages), each answered, then the client half-closes.
    pub bidi: Option<Duration>,
    /// The client's own keepalive PINGs at this interval.
    pub keepalive: Option<Duration>,
    /// Fixed reconnect backoff (instead of the library's default).
    pub reconnect_backoff: Option<Duration>,
}

/// 4 MiB: gRPC's default message size limit, the size the compatibility tests push.
pub const FOUR_MIB: u32 = 4 * 1024 * 1024;

impl ClientSpec {
    /// `calls` unary calls with 4 in flight on one connection, nothing else.
    #[must_use]
    pub fn unary(target: impl Into<String>, calls: u64) -> Self {
        Self {
            target: target.into(),
            calls,
            concurrency: 4,
            duration: None,
            timeout: Duration::from_secs(5),
            channels: 1,
            payload: 2,
            call_delay: None,
            large_calls: 0,
            large_bytes: FOUR_MIB,
            stream: None,
            bidi: None,
            keepalive: None,
            reconnect_backoff: None,
        }
    }

    /// The longest this run may take: its duration (or a generous bound per call), the
    /// streams, and the deadlines of what is still in flight at the end.
    #[must_use]
    pub fn time_bound(&self) -> Duration {
        let issuing = self.duration.unwrap_or_else(|| {
            Duration::from_millis(50).saturating_mul(u32::try_from(self.calls).unwrap_or(u32::MAX))
                + Duration::from_secs(10)
        });
        let streams = self.stream.max(self.bidi).unwrap_or_default();
        issuing.max(streams) + self.timeout.max(Duration::from_secs(30)) + Duration::from_secs(30)
    }

    /// The command-line flags all three clients take (the client-specific ones, `--gen` or
    /// `--proto`, and `--json` for grpcio, come first).
    #[must_use]
    pub fn args(&self) -> Vec<String> {
        let Self {
            target,
            calls,
            concurrency,
            duration,
            timeout,
            channels,
            payload,
            call_delay,
            large_calls,
            large_bytes,
            stream,
            bidi,
            keepalive,
            reconnect_backoff,
        } = self;
        let secs = |d: &Duration| format!("{}", d.as_secs_f64());
        let ms = |d: &Option<Duration>| d.map_or(0, |d| d.as_millis()).to_string();
        vec![
            "--target".into(),
            target.clone(),
            "--calls".into(),
            calls.to_string(),
            "--concurrency".into(),
            concurrency.to_string(),
            "--duration".into(),
            duration.as_ref().map_or_else(|| "0".into(), secs),
            "--timeout".into(),
            secs(timeout),
            "--channels".into(),
            channels.to_string(),
            "--payload".into(),
            payload.to_string(),
            "--delay-ms".into(),
            ms(call_delay),
            "--large-calls".into(),
            large_calls.to_string(),
            "--large-bytes".into(),
            large_bytes.to_string(),
            "--stream-ms".into(),
            ms(stream),
            "--bidi-ms".into(),
            ms(bidi),
            "--keepalive-ms".into(),
            ms(keepalive),
            "--reconnect-backoff-ms".into(),
            ms(reconnect_backoff),
        ]
    }
}
