//! Request mode's handling of one client connection: terminate its HTTP/2, run every stream
//! through [`proxy::handle`] on its own task, and wind down with h2's graceful two-phase GOAWAY
//! when the server's lifecycle says so. The socket lingers on close ([`crate::linger`]) so what
//! the client still sends is never answered with a reset.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::metrics::{ClientErrorReason, RotationReason};
use crate::request::config::Config;
use crate::request::flood_guard::{Cut, FloodLimits, Guard};
use crate::request::pool::Pool;
use crate::request::proxy;
use crate::request::wind_down::{Settling, WindDown};
use crate::server::{Lifecycle, NewConnection, Stop};
use crate::socket::{Close, Tapped};
use crate::upstream;

/// Most streams one client connection may have open at once. A pinned client sends all its
/// calls over one connection, so this is its concurrency; what it can make the balancer buffer
/// is bounded by the connection's flow-control window, not by this.
pub(crate) const MAX_CLIENT_STREAMS: u32 = 1024;
/// Streams the balancer may reset for a client's protocol errors before it closes the
/// connection (h2's guard against reset floods; hyper's default).
const MAX_LOCAL_ERROR_RESETS: usize = 1024;
/// How long a new client connection may take to send its HTTP/2 preface and SETTINGS.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl Lifecycle for Config {
    fn max_connection_age(&self) -> Option<std::time::Duration> {
        self.max_connection_age
    }

    fn drain_grace(&self) -> std::time::Duration {
        self.drain_grace
    }

    fn idle_timeout(&self) -> Option<std::time::Duration> {
        self.idle_timeout
    }

    fn max_client_connections(&self) -> usize {
        self.max_client_connections
    }
}

impl NewConnection for crate::Balancer {
    type Config = Config;

    fn config(&self) -> watch::Receiver<Arc<Config>> {
        self.pool.subscribe_config()
    }

    fn random_unit(&self) -> f64 {
        self.pool.random_unit()
    }

    fn metrics(&self) -> Arc<crate::metrics::ServiceMetrics> {
        self.pool.metrics.clone()
    }

    fn serve_connection(
        &self,
        stream: TcpStream,
        _peer: SocketAddr,
        stop: Stop<Config>,
    ) -> impl Future<Output = ()> + Send + 'static {
        serve(self.pool.clone(), stream, stop)
    }
}

async fn serve(pool: Arc<Pool>, stream: TcpStream, mut stop: Stop<Config>) {
    // The preface (the magic, then the client's SETTINGS) is due within the handshake
    // timeout of the accept; h2's handshake covers only the magic (see `Guard`).
    let preface_deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
    let (preface_done, mut preface_in) = tokio::sync::oneshot::channel();
    let (cut_tx, mut cut_rx) = tokio::sync::oneshot::channel();
    let pinged = Arc::new(AtomicBool::new(false));
    let wind_down = Arc::new(WindDown::default());
    let handshake = h2::server::Builder::new()
        // Fixed windows; see `upstream::STREAM_WINDOW`.
        .initial_window_size(upstream::STREAM_WINDOW)
        .initial_connection_window_size(upstream::CONNECTION_WINDOW)
        .max_concurrent_streams(MAX_CLIENT_STREAMS)
        .max_header_list_size(upstream::MAX_HEADER_LIST)
        .max_send_buffer_size(upstream::MAX_SEND_BUFFER)
        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
        .handshake::<_, Bytes>(Tapped::new(
            stream,
            Guard::new(
                FloodLimits::default(),
                pool.counters.floods.clone(),
                preface_done,
                cut_tx,
                pinged.clone(),
                wind_down.clone(),
            ),
            Close::Linger,
        ));
    // Every stream runs on its own task; this one drives the connection.
    let spawn_stream = |(req, respond)| {
        // Boxed: tokio moves a task's future by value when it spawns and finishes it; a
        // pointer is cheaper to move than the call's state machine.
        tokio::spawn(Box::pin(proxy::handle(pool.clone(), req, respond)));
    };
    let mut conn = {
        // Told to wind down by a drain before its preface is in, the client has no stream to
        // finish: dropping the handshake closes it at once (lingering, see `Tapped`). Its max
        // age counts from the preface on (see `Stop::drained`).
        let handshook = tokio::select! {
            biased;
            handshook = tokio::time::timeout_at(preface_deadline, handshake) => handshook,
            reason = stop.drained() => {
                tracing::debug!(?reason, "client wound down before its preface, closing");
                return;
            }
        };
        let mut conn = match handshook {
            Ok(Ok(conn)) => conn,
            Ok(Err(error)) => {
                count_client_error(&pool, &error);
                tracing::debug!(%error, "client handshake failed");
                return;
            }
            Err(_) => {
                pool.metrics.client_error(ClientErrorReason::NoPreface);
                tracing::debug!("client sent no HTTP/2 preface in time");
                return;
            }
        };
        // h2's handshake ends with the magic; the preface ends with the client's SETTINGS,
        // which the guard reports. Until then only a drain (or the handshake deadline) ends
        // the connection; from then on its max age counts too, armed once for its life.
        let wind_down = async {
            tokio::select! {
                biased;
                _ = &mut preface_in => {}
                reason = stop.drained() => return Err(Some(reason)),
                () = tokio::time::sleep_until(preface_deadline) => return Err(None),
            }
            Ok(stop.stopped().await)
        };
        tokio::pin!(wind_down);
        // The idle check: every eighth of the idle timeout (as configured at each check), the
        // connection is idle since the last check that saw a stream or a PING.
        // One timer for the connection's life, reset at each check: a timer made per turn of
        // this loop would be one per accepted stream.
        let mut idle_since = tokio::time::Instant::now();
        let mut next_check = idle_check_after(&pool, idle_since);
        let idle_timer = tokio::time::sleep_until(next_check.unwrap_or(idle_since));
        tokio::pin!(idle_timer);
        loop {
            let mut check_idle = false;
            tokio::select! {
                () = &mut idle_timer, if next_check.is_some() => check_idle = true,
                Ok(cut) = &mut cut_rx => {
                    if cut == Cut::BadPreface {
                        pool.metrics.client_error(ClientErrorReason::Malformed);
                    }
                    // The guard reads nothing more from the client: GOAWAY with the reason
                    // (its streams end with it), then close.
                    conn.abrupt_shutdown(cut.reason());
                    flush_go_away(&mut conn).await;
                    return;
                }
                next = conn.accept() => match next {
                    Some(Ok(stream)) => spawn_stream(stream),
                    Some(Err(error)) => {
                        count_client_error(&pool, &error);
                        tracing::debug!(%error, "client connection failed");
                        return;
                    }
                    None => return,
                },
                end = &mut wind_down => match end {
                    Ok(_) => break,
                    Err(Some(reason)) => {
                        tracing::debug!(?reason, "client wound down before its preface, closing");
                        return;
                    }
                    Err(None) => {
                        pool.metrics.client_error(ClientErrorReason::NoPreface);
                        tracing::debug!("client sent the magic but no SETTINGS in time");
                        return;
                    }
                },
            }
            if check_idle {
                let now = tokio::time::Instant::now();
                if conn.has_streams() || pinged.swap(false, Ordering::Relaxed) {
                    idle_since = now;
                } else if pool
                    .config()
                    .idle_timeout
                    .is_some_and(|t| now.saturating_duration_since(idle_since) >= t)
                    // Before the handshake deadline, that deadline applies (past it, a connection
                    // still open has its preface in).
                    && now >= preface_deadline
                {
                    tracing::debug!("client connection idle, winding it down");
                    pool.metrics.rotated(RotationReason::Idle);
                    break;
                }
                next_check = idle_check_after(&pool, now);
                if let Some(at) = next_check {
                    idle_timer.as_mut().reset(at);
                }
            }
        }
        conn
    };
    let grace = stop.grace();
    // Two-phase GOAWAY (last stream id 2^31-1 and a PING, then the real last stream id): the
    // client stops opening streams on this connection and reconnects; streams in flight
    // finish within the grace period, and streams the client opened before it saw the GOAWAY
    // are still served: the final GOAWAY waits until the client has written them (see
    // `wind_down`).
    let mut settling = Settling::start(&mut conn, &wind_down, grace);
    let drained = tokio::time::timeout(grace, async {
        loop {
            settling.step(&mut conn);
            tokio::select! {
                biased;
                next = conn.accept() => match next {
                    Some(Ok(stream)) => spawn_stream(stream),
                    Some(Err(error)) => {
                        count_client_error(&pool, &error);
                        tracing::debug!(%error, "client connection failed while draining");
                        return;
                    }
                    None => return,
                },
                () = settling.wait() => {}
            }
        }
    })
    .await;
    if drained.is_err() {
        tracing::debug!("grace period over, closing client connection");
        conn.abrupt_shutdown(h2::Reason::NO_ERROR);
        flush_go_away(&mut conn).await;
    }
}

/// When the next idle check is due after `now`: an eighth of the idle timeout in effect.
fn idle_check_after(pool: &Pool, now: tokio::time::Instant) -> Option<tokio::time::Instant> {
    pool.config().idle_timeout.map(|t| now + t / 8)
}

/// Drives a connection told to shut down until its GOAWAY is written and it closes, briefly:
/// a client that does not read cannot hold it.
async fn flush_go_away<T, B>(conn: &mut h2::server::Connection<T, B>)
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    B: bytes::Buf,
{
    let _ = tokio::time::timeout(
        std::time::Duration::from_millis(100),
        std::future::poll_fn(|cx| conn.poll_closed(cx)),
    )
    .await;
}

/// Counts a client connection h2 ended for the client's protocol error: the GOAWAY h2 sent it
/// says what (ENHANCE_YOUR_CALM: it kept opening streams h2 had to refuse or reset, past
/// `MAX_LOCAL_ERROR_RESETS` or h2's pending-reset bound; any other code: a malformed frame or
/// header block). Socket errors and the client's own GOAWAY are not counted; the flood
/// guard's cut-offs are counted where they are handled.
fn count_client_error(pool: &Pool, error: &h2::Error) {
    if !(error.is_go_away() && error.is_library()) {
        return;
    }
    let reason = match error.reason() {
        Some(h2::Reason::NO_ERROR) | None => return,
        Some(h2::Reason::ENHANCE_YOUR_CALM) => ClientErrorReason::TooManyStreams,
        Some(_) => ClientErrorReason::Malformed,
    };
    pool.metrics.client_error(reason);
}
