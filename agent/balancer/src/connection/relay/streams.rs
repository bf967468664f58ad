//! The stream table of one relayed connection: the streams the client opened that are not
//! over yet, which sides have ended each, and when it opened.
//!
//! Invariants: at most `max` streams; `client_open` is the number of streams the client has
//! not ended (it may still send on them); `highest_client` (the highest stream id the client
//! opened, refused ones included) never decreases. A stream leaves the table when both sides
//! have ended it, when either side resets it, or when a GOAWAY from the backend puts it above
//! the last stream the backend processes; the caller records the durations it returns.

use std::collections::HashMap;

use tokio::time::Instant;

use super::conn::Side;

/// One open stream.
#[derive(Debug, Clone, Copy)]
struct Stream {
    client_ended: bool,
    backend_ended: bool,
    opened: Instant,
}

/// More streams than the table holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Full;

#[derive(Debug)]
pub(super) struct Streams {
    max: usize,
    open: HashMap<u32, Stream>,
    client_open: usize,
    highest_client: u32,
}

impl Streams {
    pub(super) fn new(max: usize) -> Self {
        Self {
            max,
            open: HashMap::new(),
            client_open: 0,
            highest_client: 0,
        }
    }

    /// Most streams the table holds.
    pub(super) fn max(&self) -> usize {
        self.max
    }

    /// Streams open now.
    pub(super) fn len(&self) -> usize {
        self.open.len()
    }

    /// Open streams the client has not ended.
    pub(super) fn client_open(&self) -> usize {
        self.client_open
    }

    /// The highest stream id the client opened (0 before its first).
    pub(super) fn highest_client(&self) -> u32 {
        self.highest_client
    }

    /// Whether `id` is a new client stream: odd and above every one it opened before.
    pub(super) fn is_new_client_stream(&self, id: u32) -> bool {
        id % 2 == 1 && id > self.highest_client
    }

    /// The client sent the HEADERS of its new stream `id`, which the relay does not track
    /// (refused, or above a GOAWAY of the backend's): it counts for the highest id only.
    pub(super) fn skip(&mut self, id: u32) {
        self.highest_client = self.highest_client.max(id);
    }

    /// The client opened stream `id` at `now` (ended at once when `end_stream`).
    pub(super) fn open(&mut self, id: u32, end_stream: bool, now: Instant) -> Result<(), Full> {
        self.skip(id);
        if self.open.len() >= self.max {
            return Err(Full);
        }
        self.open.insert(
            id,
            Stream {
                client_ended: end_stream,
                backend_ended: false,
                opened: now,
            },
        );
        if !end_stream {
            self.client_open += 1;
        }
        Ok(())
    }

    /// `side` ended stream `id` (END_STREAM); when the stream is over, when it opened.
    pub(super) fn end(&mut self, id: u32, side: Side) -> Option<Instant> {
        let s = self.open.get_mut(&id)?;
        match side {
            Side::Client if !s.client_ended => {
                s.client_ended = true;
                self.client_open -= 1;
            }
            Side::Client => {}
            Side::Backend => s.backend_ended = true,
        }
        if !(s.client_ended && s.backend_ended) {
            return None;
        }
        let opened = s.opened;
        self.open.remove(&id);
        Some(opened)
    }

    /// Stream `id` was reset; if it was open, when it opened.
    pub(super) fn reset(&mut self, id: u32) -> Option<Instant> {
        let s = self.open.remove(&id)?;
        if !s.client_ended {
            self.client_open -= 1;
        }
        Some(s.opened)
    }

    /// The backend will not process streams above `last` (its GOAWAY), and the client knows it
    /// (it retries them): they leave the table, neither timed nor failed. Whether any did.
    pub(super) fn forget_above(&mut self, last: u32) -> bool {
        let before = self.open.len();
        self.open.retain(|&id, _| id <= last);
        if self.open.len() == before {
            return false;
        }
        self.client_open = self.open.values().filter(|s| !s.client_ended).count();
        true
    }

    /// Empties the table: every open stream's id (ascending) and when it opened.
    pub(super) fn take_all(&mut self) -> Vec<(u32, Instant)> {
        let mut all: Vec<(u32, Instant)> =
            self.open.drain().map(|(id, s)| (id, s.opened)).collect();
        all.sort_unstable_by_key(|&(id, _)| id);
        self.client_open = 0;
        all
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_stream_is_over_once_both_sides_ended_it_and_not_before() {
        let mut t = Streams::new(10);
        let t0 = Instant::now();
        t.open(1, false, t0).unwrap();
        assert_eq!(t.client_open(), 1);
        assert_eq!(t.end(1, Side::Backend), None, "the client may still send");
        assert_eq!(t.len(), 1);
        assert_eq!(
            t.end(1, Side::Client),
            Some(t0),
            "over: its opening time to record"
        );
        assert_eq!((t.len(), t.client_open()), (0, 0));
        assert_eq!(
            t.end(1, Side::Client),
            None,
            "an unknown stream is no stream"
        );
        // Client first, then the backend; a repeated END_STREAM counts once.
        t.open(3, false, t0).unwrap();
        assert_eq!(t.end(3, Side::Client), None);
        assert_eq!(t.end(3, Side::Client), None);
        assert_eq!(t.client_open(), 0, "counted down once");
        assert_eq!(t.end(3, Side::Backend), Some(t0));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn client_open_counts_the_streams_the_client_may_still_send_on() {
        let mut t = Streams::new(10);
        let now = Instant::now();
        t.open(1, true, now).unwrap();
        t.open(3, false, now).unwrap();
        t.open(5, false, now).unwrap();
        assert_eq!(
            (t.len(), t.client_open()),
            (3, 2),
            "1 ended with its HEADERS"
        );
        assert_eq!(t.reset(3), Some(now));
        assert_eq!((t.len(), t.client_open()), (2, 1));
        assert_eq!(t.reset(1), Some(now));
        assert_eq!(
            (t.len(), t.client_open()),
            (1, 1),
            "1 was not counted as open"
        );
        assert_eq!(t.reset(1), None);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_backend_goaway_forgets_the_streams_above_it_and_recounts() {
        let mut t = Streams::new(10);
        let now = Instant::now();
        for id in [1, 3, 5, 7] {
            t.open(id, id == 5, now).unwrap();
        }
        assert!(t.forget_above(3));
        assert_eq!((t.len(), t.client_open()), (2, 2));
        assert!(!t.forget_above(3), "nothing above it any more");
        assert_eq!(t.highest_client(), 7, "the highest id stays");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_table_is_bounded_and_the_highest_id_only_rises() {
        let mut t = Streams::new(2);
        let now = Instant::now();
        t.open(1, false, now).unwrap();
        t.open(3, false, now).unwrap();
        assert_eq!(t.open(5, false, now), Err(Full));
        assert_eq!(t.len(), 2);
        assert_eq!(
            t.highest_client(),
            5,
            "the refused id still counts as opened"
        );
        assert!(!t.is_new_client_stream(3) && !t.is_new_client_stream(4));
        assert!(t.is_new_client_stream(7));
        t.skip(9);
        t.skip(7);
        assert_eq!(t.highest_client(), 9);
        tokio::time::advance(Duration::from_secs(1)).await;
        let all = t.take_all();
        assert_eq!(all.iter().map(|&(id, _)| id).collect::<Vec<_>>(), [1, 3]);
        assert_eq!((t.len(), t.client_open()), (0, 0));
    }
}
