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

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// After its FIN, how long a closed connection's socket is kept reading (and discarding) what
/// the peer still sends: long enough for the peer to read our last frames and close first.
pub(crate) const LINGER: Duration = Duration::from_secs(2);

/// Reads into this much at a time while lingering (on the lingering task's stack).
const DISCARD_CHUNK: usize = 4096;

/// Closes a client connection's socket the lingering way (see the module docs): on a task of
/// the current tokio runtime, or at once outside one.
pub(crate) fn close(stream: TcpStream) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(linger(stream));
    }
}

/// FIN after what is written, then read and discard until the peer closes, an error, or
/// [`LINGER`].
async fn linger(mut stream: TcpStream) {
    let _ = tokio::time::timeout(LINGER, stream.shutdown()).await;
    discard(stream).await;
}

/// The lingering of a connection whose halves went separate ways: the write half sends its
/// FIN when it is dropped; this reads the read half and discards what comes until the peer
/// closes, an error, or [`LINGER`].
pub(crate) async fn discard(mut read: impl AsyncRead + Unpin) {
    let _ = tokio::time::timeout(LINGER, async {
        let mut discard = [0u8; DISCARD_CHUNK];
        while matches!(read.read(&mut discard).await, Ok(n) if n > 0) {}
    })
    .await;
}
