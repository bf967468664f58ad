//! A frame-logging HTTP/2 tap: a TCP relay that records every frame each way, exactly as the
//! peer on the other side receives it, so a test can check the wire sequence of a rotation
//! (GOAWAY, PING, final GOAWAY, FIN) as a client or a backend sees it.
//!
//! Put it in front of a backend (it listens where the backend was, forwards to the backend),
//! or next to a client in the client's pod (the client dials the tap, whose own connect goes
//! through the VIP and the eBPF redirect). It forwards frame by frame, whole frames only, and
//! can drop chosen frames towards the client ([`Withhold`]): a client that never sees the GOAWAY
//! keeps opening streams; one that never sees the PING never answers it. Headers are never
//! changed, so the two ends' HPACK state stays in step.
//!
//! The log is JSON lines ([`LogLine`]), written whole lines at a time (every line that is
//! waiting, in one write) so a test can read it while the tap runs and the log keeps up with a
//! loaded machine; [`read_log_when_closed`] waits until it is complete. Frames are decoded with `skewless-frame`; every length a peer declares is bounded by
//! [`MAX_FRAME`] (a longer frame ends that connection, logged).

use std::{
    net::SocketAddr,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use serde::{Deserialize, Serialize};
use skewless_frame::{
    GoAway, HEADER_LEN, Head, Kind, MAX_MAX_FRAME_SIZE, PREFACE, Ping, RstStream,
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    sync::mpsc,
    time::Instant,
};

/// The most the log writer gathers into one write (it writes sooner when no line waits).
const WRITE_BATCH: usize = 1 << 20;

fn push_line(batch: &mut String, line: &LogLine) {
    batch.push_str(&serde_json::to_string(line).unwrap_or_default());
    batch.push('\n');
}

/// The largest frame the tap relays (the largest SETTINGS_MAX_FRAME_SIZE a peer may use).
pub const MAX_FRAME: u32 = MAX_MAX_FRAME_SIZE;

/// Which way a frame went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dir {
    /// From the client towards the server (the backend, or the balancer).
    ToServer,
    /// From the server towards the client.
    ToClient,
}

/// Frames the tap does not pass on to the client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Withhold {
    /// GOAWAY frames (the client behaves as if it never got one).
    pub goaway: bool,
    /// PING frames that are not ACKs (the client never answers the server's PING).
    pub ping: bool,
}

impl Withhold {
    fn drops(self, dir: Dir, head: &Head) -> bool {
        dir == Dir::ToClient
            && ((self.goaway && head.kind == Kind::GoAway)
                || (self.ping && head.kind == Kind::Ping && !head.is_ack()))
    }
}

/// One line of the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum LogLine {
    /// A client connected and the tap reached the server.
    Open { conn: u64, t_ms: f64 },
    /// The tap could not reach the server; the client's connection was closed.
    ConnectFailed { conn: u64, t_ms: f64, error: String },
    /// A frame.
    Frame(FrameRecord),
    /// The client preface (`to_server` only).
    Preface { conn: u64, t_ms: f64 },
    /// Bytes that are not HTTP/2 (a bad preface or an oversized frame); relayed no further.
    Garbage {
        conn: u64,
        t_ms: f64,
        dir: Dir,
        why: String,
    },
    /// One side ended its stream (FIN) or failed; `reset` when it was a connection reset.
    End {
        conn: u64,
        t_ms: f64,
        dir: Dir,
        reset: bool,
    },
}

/// A frame, as it passed the tap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrameRecord {
    pub conn: u64,
    /// Milliseconds since the tap started.
    pub t_ms: f64,
    pub dir: Dir,
    /// `DATA`, `HEADERS`, `GOAWAY`, ... or `UNKNOWN(0xNN)`.
    pub kind: String,
    pub flags: u8,
    pub stream: u32,
    pub len: u32,
    /// Not passed on ([`Withhold`]).
    pub dropped: bool,
    /// GOAWAY: last-stream-id, error code, debug data (lossy UTF-8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goaway: Option<(u32, u32, String)>,
    /// PING: ACK flag and opaque data as hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ping: Option<(bool, String)>,
    /// RST_STREAM: its error code (7 is REFUSED_STREAM, 8 CANCEL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rst: Option<u32>,
}

impl LogLine {
    /// The connection this line belongs to.
    #[must_use]
    pub fn conn(&self) -> u64 {
        match self {
            Self::Open { conn, .. }
            | Self::ConnectFailed { conn, .. }
            | Self::Preface { conn, .. }
            | Self::Garbage { conn, .. }
            | Self::End { conn, .. } => *conn,
            Self::Frame(f) => f.conn,
        }
    }
}

/// The name of a frame type as the log writes it.
#[must_use]
pub fn kind_name(kind: Kind) -> String {
    match kind {
        Kind::Data => "DATA".into(),
        Kind::Headers => "HEADERS".into(),
        Kind::Priority => "PRIORITY".into(),
        Kind::RstStream => "RST_STREAM".into(),
        Kind::Settings => "SETTINGS".into(),
        Kind::PushPromise => "PUSH_PROMISE".into(),
        Kind::Ping => "PING".into(),
        Kind::GoAway => "GOAWAY".into(),
        Kind::WindowUpdate => "WINDOW_UPDATE".into(),
        Kind::Continuation => "CONTINUATION".into(),
        Kind::Unknown(v) => format!("UNKNOWN(0x{v:02x})"),
    }
}

/// Reads a tap's log (complete lines only; a line being written is skipped).
///
/// # Errors
/// When the file cannot be read.
pub fn read_log(path: &Path) -> std::io::Result<Vec<LogLine>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// Reads a tap's log once every connection it opened has ended both ways (both peers are
/// done with it), or after `bound`, whichever comes first: the tap writes its lines behind
/// the bytes it relays, so a log read as soon as the client is done can lack the last frames
/// and ends (on a loaded machine a tap was seen 26 s behind its client at the end of a 60 s
/// run).
///
/// # Errors
/// When the file cannot be read.
pub fn read_log_when_closed(path: &Path, bound: Duration) -> std::io::Result<Vec<LogLine>> {
    let deadline = std::time::Instant::now() + bound;
    loop {
        let log = read_log(path)?;
        if all_closed(&log) || std::time::Instant::now() >= deadline {
            return Ok(log);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Whether every connection that opened in `log` has ended both ways.
fn all_closed(log: &[LogLine]) -> bool {
    let mut ends: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    for line in log {
        match line {
            LogLine::Open { conn, .. } => {
                ends.entry(*conn).or_default();
            }
            LogLine::End { conn, .. } => *ends.entry(*conn).or_default() += 1,
            _ => {}
        }
    }
    ends.values().all(|&n| n >= 2)
}

/// The connections whose client sent the HTTP/2 preface, in the order they opened (a bare
/// TCP connect, such as a readiness probe, is not one).
#[must_use]
pub fn http2_conns(log: &[LogLine]) -> Vec<u64> {
    log.iter()
        .filter_map(|l| match l {
            LogLine::Preface { conn, .. } => Some(*conn),
            _ => None,
        })
        .collect()
}

/// The frames of one connection in one direction, in order.
#[must_use]
pub fn frames(log: &[LogLine], conn: u64, dir: Dir) -> Vec<&FrameRecord> {
    log.iter()
        .filter_map(|l| match l {
            LogLine::Frame(f) if f.conn == conn && f.dir == dir => Some(f),
            _ => None,
        })
        .collect()
}

#[derive(Clone)]
struct Ctx {
    t0: Instant,
    log: mpsc::UnboundedSender<LogLine>,
    drop: Withhold,
}

impl Ctx {
    fn ms(&self) -> f64 {
        (self.t0.elapsed().as_secs_f64() * 1e6).round() / 1e3
    }

    fn log(&self, line: LogLine) {
        let _ = self.log.send(line);
    }
}

/// Accepts connections on `listener` and relays each to `upstream` until both sides are done,
/// logging to `log` (a JSON line each). Runs until the process ends.
///
/// # Errors
/// When the log cannot be written or the listener fails.
pub async fn serve(
    listener: TcpListener,
    upstream: SocketAddr,
    drop: Withhold,
    log: &Path,
) -> std::io::Result<()> {
    let mut file = tokio::fs::File::create(log).await?;
    let (tx, mut rx) = mpsc::unbounded_channel::<LogLine>();
    let writer = tokio::spawn(async move {
        // One write per batch of waiting lines: a write and a flush per line (each a blocking
        // file operation handed to a thread) left the log seconds behind the relayed bytes.
        let mut batch = String::new();
        while let Some(line) = rx.recv().await {
            push_line(&mut batch, &line);
            while batch.len() < WRITE_BATCH {
                let Ok(line) = rx.try_recv() else { break };
                push_line(&mut batch, &line);
            }
            if file.write_all(batch.as_bytes()).await.is_err() || file.flush().await.is_err() {
                return;
            }
            batch.clear();
        }
    });
    let ctx = Ctx {
        t0: Instant::now(),
        log: tx,
        drop,
    };
    let next = Arc::new(AtomicU64::new(0));
    loop {
        let (client, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                writer.abort();
                return Err(e);
            }
        };
        let conn = next.fetch_add(1, Ordering::Relaxed);
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let _ = client.set_nodelay(true);
            let server = match TcpStream::connect(upstream).await {
                Ok(s) => s,
                Err(e) => {
                    ctx.log(LogLine::ConnectFailed {
                        conn,
                        t_ms: ctx.ms(),
                        error: e.to_string(),
                    });
                    return;
                }
            };
            let _ = server.set_nodelay(true);
            ctx.log(LogLine::Open {
                conn,
                t_ms: ctx.ms(),
            });
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            let up = tokio::spawn(pump(cr, sw, conn, Dir::ToServer, ctx.clone()));
            let down = tokio::spawn(pump(sr, cw, conn, Dir::ToClient, ctx));
            let _ = tokio::join!(up, down);
        });
    }
}

/// Relays one direction frame by frame until EOF or an error.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    conn: u64,
    dir: Dir,
    ctx: Ctx,
) {
    let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
    let mut preface = dir == Dir::ToServer;
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut chunk).await {
            Ok(0) => {
                ctx.log(LogLine::End {
                    conn,
                    t_ms: ctx.ms(),
                    dir,
                    reset: false,
                });
                let _ = to.shutdown().await;
                return;
            }
            Ok(n) => n,
            Err(e) => {
                ctx.log(LogLine::End {
                    conn,
                    t_ms: ctx.ms(),
                    dir,
                    reset: e.kind() == std::io::ErrorKind::ConnectionReset,
                });
                let _ = to.shutdown().await;
                return;
            }
        };
        buf.extend_from_slice(&chunk[..n]);
        let mut out: Vec<u8> = Vec::new();
        let mut at = 0;
        if preface {
            if buf.len() < PREFACE.len() {
                if !PREFACE.starts_with(&buf) {
                    garbage(&ctx, conn, dir, "not the HTTP/2 client preface");
                    return;
                }
                continue;
            }
            if &buf[..PREFACE.len()] != PREFACE {
                garbage(&ctx, conn, dir, "not the HTTP/2 client preface");
                return;
            }
            ctx.log(LogLine::Preface {
                conn,
                t_ms: ctx.ms(),
            });
            out.extend_from_slice(PREFACE);
            at = PREFACE.len();
            preface = false;
        }
        while buf.len() - at >= HEADER_LEN {
            let header: &[u8; HEADER_LEN] = buf[at..at + HEADER_LEN]
                .try_into()
                .unwrap_or(&[0; HEADER_LEN]);
            let head = Head::decode(header);
            if head.len > MAX_FRAME {
                garbage(&ctx, conn, dir, "frame longer than 2^24-1");
                return;
            }
            if buf.len() - at < head.frame_len() {
                break;
            }
            let payload = &buf[at + HEADER_LEN..at + head.frame_len()];
            let dropped = ctx.drop.drops(dir, &head);
            ctx.log(LogLine::Frame(record(
                conn,
                ctx.ms(),
                dir,
                &head,
                payload,
                dropped,
            )));
            if !dropped {
                out.extend_from_slice(&buf[at..at + head.frame_len()]);
            }
            at += head.frame_len();
        }
        buf.drain(..at);
        if !out.is_empty() && to.write_all(&out).await.is_err() {
            ctx.log(LogLine::End {
                conn,
                t_ms: ctx.ms(),
                dir,
                reset: true,
            });
            return;
        }
    }
}

fn garbage(ctx: &Ctx, conn: u64, dir: Dir, why: &str) {
    ctx.log(LogLine::Garbage {
        conn,
        t_ms: ctx.ms(),
        dir,
        why: why.to_owned(),
    });
}

fn record(
    conn: u64,
    t_ms: f64,
    dir: Dir,
    head: &Head,
    payload: &[u8],
    dropped: bool,
) -> FrameRecord {
    let goaway = (head.kind == Kind::GoAway)
        .then(|| GoAway::decode(head, payload).ok())
        .flatten()
        .map(|g| {
            (
                g.last_stream_id,
                g.error_code.0,
                String::from_utf8_lossy(g.debug_data).into_owned(),
            )
        });
    let ping = (head.kind == Kind::Ping)
        .then(|| Ping::decode(head, payload).ok())
        .flatten()
        .map(|p| {
            let hex: String = p.opaque.iter().map(|b| format!("{b:02x}")).collect();
            (p.ack, hex)
        });
    let rst = (head.kind == Kind::RstStream)
        .then(|| RstStream::decode(head, payload).ok())
        .flatten()
        .map(|r| r.error_code.0);
    FrameRecord {
        conn,
        t_ms,
        dir,
        kind: kind_name(head.kind),
        flags: head.flags,
        stream: head.stream_id,
        len: head.len,
        dropped,
        goaway,
        ping,
        rst,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_round_trip_through_json() {
        let line = LogLine::Frame(FrameRecord {
            conn: 3,
            t_ms: 1.5,
            dir: Dir::ToClient,
            kind: "GOAWAY".into(),
            flags: 0,
            stream: 0,
            len: 8,
            dropped: false,
            goaway: Some((2_147_483_647, 0, String::new())),
            ping: None,
            rst: None,
        });
        let text = serde_json::to_string(&line).unwrap();
        assert!(text.contains(r#""event":"frame""#), "{text}");
        assert_eq!(serde_json::from_str::<LogLine>(&text).unwrap(), line);
    }

    #[test]
    fn only_frames_towards_the_client_are_dropped() {
        let drop = Withhold {
            goaway: true,
            ping: true,
        };
        let goaway = Head::new(Kind::GoAway, 0, 0, 8);
        let ping = Head::new(Kind::Ping, 0, 0, 8);
        let ack = Head::new(Kind::Ping, skewless_frame::flags::ACK, 0, 8);
        assert!(drop.drops(Dir::ToClient, &goaway));
        assert!(drop.drops(Dir::ToClient, &ping));
        assert!(
            !drop.drops(Dir::ToClient, &ack),
            "ACKs of the client's PINGs pass"
        );
        assert!(!drop.drops(Dir::ToServer, &goaway));
        assert!(!Withhold::default().drops(Dir::ToClient, &goaway));
    }
}
