//! The one socket adaptor of the balancer's h2 connections: a TCP stream whose reads pass by a
//! [`ReadTap`] before h2 sees them, and which closes at once or lingers when dropped.
//!
//! Request mode's client connections have a flood guard on their reads
//! ([`crate::request::flood_guard`]), which while the connection winds down also rewrites,
//! holds back and makes up frames for h2 ([`crate::request::wind_down`]), and a lingering
//! close ([`crate::linger`]); upstream
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

    /// The end of earlier reads that the tap holds back (part of a frame header it must see
    /// whole before h2 does, so at most 8 bytes): they go first in the next read.
    fn held(&self) -> &[u8] {
        &[]
    }

    /// Sees what one read brought, after the bytes the tap held (never only those), and may
    /// rewrite it. Returns how many bytes at its end the tap holds back from now on. An error
    /// fails that read, and its bytes are not handed on.
    fn read(&mut self, bytes: &mut [u8]) -> io::Result<usize>;

    /// Frames the tap makes up for h2 to read next, put into `buf`; whether there were any.
    /// Asked before every read.
    fn inject(&mut self, buf: &mut ReadBuf<'_>) -> bool {
        let _ = buf;
        false
    }

    /// The first `n` held bytes were handed on as they are (the read buffer had no room for
    /// more, or the peer closed its side).
    fn release(&mut self, n: usize) {
        let _ = n;
    }
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
        if this.tap.inject(buf) {
            return Poll::Ready(Ok(()));
        }
        let stream = this
            .stream
            .as_mut()
            .expect("the stream is only taken on drop");
        let before = buf.filled().len();
        loop {
            let held = this.tap.held();
            let n = held.len();
            if n > 0 && buf.remaining() <= n {
                // No room for what is held and more: it goes on as it is (h2 reads into buffers
                // of kilobytes; this is not expected to happen).
                let n = n.min(buf.remaining());
                buf.put_slice(&held[..n]);
                this.tap.release(n);
                return Poll::Ready(Ok(()));
            }
            buf.put_slice(held);
            match Pin::new(&mut *stream).poll_read(cx, buf) {
                Poll::Ready(Ok(())) if buf.filled().len() > before + n => {
                    match this.tap.read(&mut buf.filled_mut()[before..]) {
                        Ok(keep) => {
                            let end = buf.filled().len() - keep;
                            buf.set_filled(end);
                            if end > before {
                                return Poll::Ready(Ok(()));
                            }
                            // All of it is held: an empty read would tell h2 the peer closed.
                        }
                        Err(error) => {
                            // What this read brought is not handed on.
                            buf.set_filled(before);
                            return Poll::Ready(Err(error));
                        }
                    }
                }
                Poll::Ready(Ok(())) => {
                    // The peer closed its side: what is held goes on, then the end.
                    this.tap.release(n);
                    return Poll::Ready(Ok(()));
                }
                other => {
                    // Held bytes stay held until a read brings more.
                    buf.set_filled(before);
                    return other;
                }
            }
        }
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
