//! The one socket adaptor of the balancer's h2 connections: a TCP stream whose reads pass by a
//! [`ReadTap`] before h2 sees them, and which closes at once or lingers when dropped.
//!
//! Request mode's client connections have a flood guard on their reads
//! ([`crate::request::flood_guard`]) and a lingering close ([`crate::linger`]); upstream
//! connections (both modes) have their server's frames watched
//! ([`crate::upstream::server_frames`]). The stream is wrapped once, with one pass-through of
//! every `AsyncWrite` method; what differs is the tap and the way it closes.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// What a [`Tapped`] socket does with what it reads.
pub(crate) trait ReadTap {
    /// Checked before every read: once true, nothing more is read and every read stays
    /// pending (the tap has cut the peer off; what h2 still writes, such as its GOAWAY, goes
    /// out, and the connection's owner closes it).
    fn stalled(&self) -> bool {
        false
    }

    /// Sees the bytes one read brought (never empty). An error fails that read, and its bytes
    /// are not handed on.
    fn read(&mut self, bytes: &[u8]) -> io::Result<()>;
}

/// How a [`Tapped`] socket closes when dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Close {
    /// The socket is closed at once.
    AtOnce,
    /// FIN after what is written, then what the peer still sends is read and discarded for a
    /// while ([`crate::linger`]); at once when dropped outside a tokio runtime.
    Linger,
}

/// A TCP stream whose reads pass by `R` (see the module docs).
#[derive(Debug)]
pub(crate) struct Tapped<R> {
    /// `None` only once dropped.
    stream: Option<TcpStream>,
    tap: R,
    close: Close,
}

impl<R> Tapped<R> {
    pub(crate) fn new(stream: TcpStream, tap: R, close: Close) -> Self {
        Self {
            stream: Some(stream),
            tap,
            close,
        }
    }
}

impl<R: Unpin> Tapped<R> {
    fn stream(self: Pin<&mut Self>) -> Pin<&mut TcpStream> {
        Pin::new(
            self.get_mut()
                .stream
                .as_mut()
                .expect("the stream is only taken on drop"),
        )
    }
}

impl<R> Drop for Tapped<R> {
    fn drop(&mut self) {
        if let (Close::Linger, Some(stream)) = (self.close, self.stream.take()) {
            crate::linger::close(stream);
        }
    }
}

impl<R: ReadTap + Unpin> AsyncRead for Tapped<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.tap.stalled() {
            // No waker is registered: the owner drives the connection to its close.
            return Poll::Pending;
        }
        let stream = this
            .stream
            .as_mut()
            .expect("the stream is only taken on drop");
        let before = buf.filled().len();
        let res = Pin::new(stream).poll_read(cx, buf);
        if matches!(res, Poll::Ready(Ok(())))
            && buf.filled().len() > before
            && let Err(error) = this.tap.read(&buf.filled()[before..])
        {
            // What this read brought is not handed on.
            buf.set_filled(before);
            return Poll::Ready(Err(error));
        }
        res
    }
}

impl<R: Unpin> AsyncWrite for Tapped<R> {
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
