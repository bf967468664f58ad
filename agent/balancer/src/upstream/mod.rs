//! Backend HTTP/2 connections, used by both modes: request mode's pool sends its calls on
//! them, connection mode opens one per backend for its active health checks (a relayed
//! connection belongs to its client). [`connect`] returns a connection only once its server has
//! spoken and answered a PING; [`server_frames`] is its socket's read tap, [`liveness`] tells whether it
//! is still alive, [`health`] follows `grpc.health.v1` on it.

pub mod health;
pub mod liveness;
pub(crate) mod server_frames;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use tokio::sync::Notify;
use tracing::Instrument as _;

use liveness::{LivenessConfig, Signals};

/// A task aborted when its handle is dropped.
#[derive(Debug)]
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// HTTP/2 flow-control window of one stream (both directions of the balancer): enough for
/// a 4 MiB+ message to stream at loopback speed, small enough that a slow reader holds little.
pub(crate) const STREAM_WINDOW: u32 = 1024 * 1024;
/// HTTP/2 connection window of a client connection (request mode): what one client can have
/// in flight across its own streams.
pub(crate) const CONNECTION_WINDOW: u32 = 4 * 1024 * 1024;
/// HTTP/2 connection window of an upstream connection: the largest there is (2^31-1), so it
/// is never the limit. An upstream connection carries the streams of many clients, and what
/// h2 has received for a stream stays charged to the connection window until that stream's
/// client has taken it: with a smaller window, one client that leaves its responses unread
/// (4 MiB of them, at 1 MiB per stream) stopped the backend from sending anything on that
/// connection to anyone else. At the maximum, the connection window exceeds what all its
/// streams' windows can hold together (`max_streams_per_connection` x [`STREAM_WINDOW`]), so
/// what a stream's reader leaves unread is bounded by that stream's window alone and blocks
/// no other stream; memory stays bounded by the stream windows, as before.
pub(crate) const UPSTREAM_CONNECTION_WINDOW: u32 = (1 << 31) - 1;
/// Largest header list (headers or trailers) accepted from a peer, as hyper's default: gRPC
/// metadata is small, and this bounds what one stream's headers can cost.
pub(crate) const MAX_HEADER_LIST: u32 = 16 * 1024;
/// Most bytes h2 buffers for sending on one stream (h2's and hyper's default).
pub(crate) const MAX_SEND_BUFFER: usize = 400 * 1024;

/// A connected, handshaken upstream connection whose server has answered a PING.
pub(crate) struct Connected {
    pub(crate) sender: SendRequest<Bytes>,
    /// Resolves when the connection is over (closed by either side, or failed). It runs on its
    /// own task, so streams in flight finish however the balancer stops using it: h2 closes it
    /// once every handle and stream is gone. Aborting it closes the connection at once (its
    /// streams fail with a broken pipe): what happens to a dead one.
    pub(crate) ended: tokio::task::JoinHandle<()>,
    /// Notified when the server sends GOAWAY.
    pub(crate) go_away: Arc<Notify>,
    /// The connection's PINGs, for its liveness monitor.
    pub(crate) pings: h2::PingPong,
    pub(crate) signals: Arc<Signals>,
}

/// Connects and handshakes, and returns once the server has sent its first frame and answered
/// a PING (a server that stopped reading, or a path that lost its way back, is not published).
pub(crate) async fn connect(
    addr: SocketAddr,
    timeout: Duration,
    liveness: &LivenessConfig,
) -> Result<Connected, ConnectError> {
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(ConnectError::Tcp)?;
        // gRPC is latency bound: small messages must not wait for Nagle.
        tcp.set_nodelay(true).map_err(ConnectError::Tcp)?;
        liveness::set_tcp_options(&tcp, liveness).map_err(ConnectError::Tcp)?;
        let signals = Arc::new(Signals::default());
        let (io, events) = server_frames::watched(tcp, signals.clone());
        let (sender, mut conn) = h2::client::Builder::new()
            // Fixed windows. h2 sizes its budget for small DATA frames from the connection
            // window, so small adaptive windows got gRPC's many small frames the connection
            // closed (ENHANCE_YOUR_CALM, too_many_data_frames) under load. The stream window
            // bounds what one stream can buffer; the connection window never binds (see
            // `UPSTREAM_CONNECTION_WINDOW`).
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(UPSTREAM_CONNECTION_WINDOW)
            .max_header_list_size(MAX_HEADER_LIST)
            .max_send_buffer_size(MAX_SEND_BUFFER)
            .enable_push(false)
            .handshake::<_, Bytes>(io)
            .await
            .map_err(ConnectError::Handshake)?;
        let mut pings = conn.ping_pong().ok_or(ConnectError::Silent)?;
        let mut conn = Box::pin(conn);
        // Drive the connection until the server has spoken and answered a PING; if it ends
        // first, it never served.
        let mut spoke = events.spoke;
        let answered = async {
            (&mut spoke).await.map_err(|_| ConnectError::Silent)?;
            pings
                .ping(h2::Ping::opaque())
                .await
                .map_err(ConnectError::Handshake)
        };
        tokio::select! {
            res = &mut conn => {
                return Err(match res {
                    Ok(()) => ConnectError::Silent,
                    Err(error) => ConnectError::Handshake(error),
                });
            }
            res = answered => { res?; }
        }
        let ended = tokio::spawn(
            async move {
                match conn.await {
                    Ok(()) => tracing::debug!("connection closed"),
                    Err(error) => tracing::debug!(%error, "connection failed"),
                }
            }
            .in_current_span(),
        );
        Ok(Connected {
            sender,
            ended,
            go_away: events.go_away,
            pings,
            signals,
        })
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .map_err(|_| ConnectError::Timeout)?
}

/// Errors of one connection attempt to an endpoint.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    /// TCP connect failed.
    #[error("tcp connect failed")]
    Tcp(#[source] std::io::Error),
    /// TCP connect or the handshake took longer than the connect timeout.
    #[error("connect timed out")]
    Timeout,
    /// The connection closed before the server sent anything (nobody serves the listener).
    #[error("server closed the connection without speaking HTTP/2")]
    Silent,
    /// The HTTP/2 handshake failed.
    #[error("http/2 handshake failed")]
    Handshake(#[source] h2::Error),
}
