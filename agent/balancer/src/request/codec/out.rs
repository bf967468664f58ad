//! The write side of one connection, shared by every task that sends on it: a buffer that
//! frames are appended to under the connection's lock, and a writer task that writes it
//! without blocking once the tasks made ready in the same turn of the runtime have added
//! theirs (so frames for one connection from several readers cost one `write`), and again
//! when a full socket drains.

use std::sync::{Arc, Mutex, MutexGuard};

use bytes::{Buf as _, BytesMut};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::Notify;

/// Bytes waiting to be written, and what became of the socket.
#[derive(Debug, Default)]
pub(crate) struct Out {
    pub(crate) buf: BytesMut,
    /// The socket was full at the last write: the writer task flushes when it drains.
    blocked: bool,
    /// Writing failed: the connection is broken, nothing more is written.
    pub(crate) broken: bool,
}

impl Out {
    /// Writes what it can without blocking; leaves the rest for the writer task.
    fn flush(&mut self, stream: &OwnedWriteHalf) {
        while !self.buf.is_empty() && !self.broken {
            match stream.try_write(&self.buf) {
                Ok(n) => self.buf.advance(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.blocked = true;
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "write failed");
                    self.broken = true;
                    self.buf.clear();
                }
            }
        }
        self.blocked = false;
    }
}

/// A connection's write half and its state `S` (which holds an [`Out`]) behind one lock.
#[derive(Debug)]
pub(crate) struct Shared<S> {
    stream: OwnedWriteHalf,
    state: Mutex<S>,
    /// Wakes the writer task: bytes to write, the socket drained, or the connection closed.
    wake: Notify,
}

/// What a connection's state gives the write side.
pub(crate) trait HasOut {
    fn out(&mut self) -> &mut Out;
}

impl<S: HasOut + Send + 'static> Shared<S> {
    /// The shared state of a connection on `stream`, and its writer task, which ends once
    /// [`Shared::close`] is called.
    pub(crate) fn new(stream: OwnedWriteHalf, state: S) -> Arc<Self> {
        let shared = Arc::new(Self {
            stream,
            state: Mutex::new(state),
            wake: Notify::new(),
        });
        tokio::spawn(writer(shared.clone()));
        shared
    }

    /// Nothing more is written; the writer task ends.
    pub(crate) fn close(&self) {
        let mut state = self.lock();
        let out = state.out();
        out.broken = true;
        out.buf.clear();
        drop(state);
        self.wake.notify_one();
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, S> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Writes what the state's buffer holds now, as far as the socket takes it (for the last
    /// frames of a connection that is closing).
    pub(crate) fn flush_locked(&self, state: &mut S) {
        let out = state.out();
        if out.blocked || out.buf.is_empty() {
            return;
        }
        out.flush(&self.stream);
        if out.blocked {
            self.wake.notify_one();
        }
    }

    /// Has the writer task write what the buffer holds once the tasks made ready with this
    /// one have run: frames that several readers produce for this connection in one turn of
    /// the runtime go out in one write.
    pub(crate) fn flush(&self) {
        self.wake.notify_one();
    }
}

/// Writes a connection's buffer when woken, and again whenever its socket drains, until the
/// connection is closed.
async fn writer<S: HasOut + Send + 'static>(shared: Arc<Shared<S>>) {
    loop {
        shared.wake.notified().await;
        loop {
            {
                let mut state = shared.lock();
                let out = state.out();
                if out.broken {
                    return;
                }
                out.flush(&shared.stream);
                if !out.blocked {
                    break;
                }
            }
            // `close` wakes this wait too.
            tokio::select! {
                res = shared.stream.writable() => if res.is_err() { return },
                () = shared.wake.notified() => {}
            }
        }
    }
}
