//! Closing a client connection without making the kernel reset it.
//!
//! A socket closed with bytes in its receive queue that nobody read is answered with RST, not
//! FIN, and so is every byte that arrives after the close. A client that was still writing when
//! the balancer closed (new streams it opened before it read the final GOAWAY, WINDOW_UPDATEs,
//! PINGs) then meets EPIPE or ECONNRESET on its next write — possibly before it has read the
//! GOAWAY that says which of its streams were never processed and may be retried. grpcio then
//! fails every stream of the connection ("Stream removed"). So a client connection is closed
//! the way the relay closes its peers: FIN after everything written, then what the client still
//! sends is read and discarded until it closes its side too, for at most [`LINGER`].

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio::net::TcpStream;

/// After its FIN, how long a closed connection's socket is kept reading (and discarding) what
/// the peer still sends: long enough for the peer to read our last frames and close first.
pub(crate) const LINGER: Duration = Duration::from_secs(2);

/// Reads into this much at a time while lingering (on the lingering task's stack).
const DISCARD_CHUNK: usize = 4096;

/// A client connection's socket that lingers when dropped (see the module docs). It behaves
/// exactly as the `TcpStream` it wraps until then; dropping it outside a tokio runtime closes
/// the socket at once.
#[derive(Debug)]
pub(crate) struct Lingering {
    /// `None` only once dropped.
    stream: Option<TcpStream>,
}

impl Lingering {
    pub(crate) fn new(stream: TcpStream) -> Self {
        Self {
            stream: Some(stream),
        }
    }

    fn stream(self: Pin<&mut Self>) -> Pin<&mut TcpStream> {
        Pin::new(
            self.get_mut()
                .stream
                .as_mut()
                .expect("the stream is only taken on drop"),
        )
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        let Some(stream) = self.stream.take() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(linger(stream));
        }
    }
}

/// FIN after what is written, then read and discard until the peer closes, an error, or
/// [`LINGER`].
async fn linger(mut stream: TcpStream) {
    let _ = tokio::time::timeout(LINGER, async {
        let _ = stream.shutdown().await;
        let mut discard = [0u8; DISCARD_CHUNK];
        while matches!(stream.read(&mut discard).await, Ok(n) if n > 0) {}
    })
    .await;
}

impl AsyncRead for Lingering {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.stream().poll_read(cx, buf)
    }
}

impl AsyncWrite for Lingering {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.stream().poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.stream().poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream
            .as_ref()
            .is_some_and(AsyncWrite::is_write_vectored)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.stream().poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.stream().poll_shutdown(cx)
    }
}
