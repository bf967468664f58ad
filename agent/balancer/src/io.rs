//! A TCP stream wrapper that reports the first bytes the peer sends.
//!
//! hyper's HTTP/2 client handshake completes without hearing from the server, so a connection
//! to a listener that still exists but no longer serves (a pod shutting down, a backlog nobody
//! accepts) would look usable, and requests written to it would be lost. The connection is
//! only published once the server has spoken (its SETTINGS frame).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;

/// Wraps `T` and fires `first_read` when the first byte arrives.
pub(crate) struct FirstRead<T> {
    inner: T,
    first_read: Option<oneshot::Sender<()>>,
}

impl<T> FirstRead<T> {
    pub(crate) fn new(inner: T) -> (Self, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        (
            Self {
                inner,
                first_read: Some(tx),
            },
            rx,
        )
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for FirstRead<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let res = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(res, Poll::Ready(Ok(())))
            && buf.filled().len() > before
            && let Some(tx) = self.first_read.take()
        {
            let _ = tx.send(());
        }
        res
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for FirstRead<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
