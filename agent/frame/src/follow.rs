//! Following frame boundaries: incrementally over a byte stream read in arbitrary pieces
//! ([`Follower`]), or over a complete buffer ([`Frames`]).

use crate::error::FrameError;
use crate::head::Head;
use crate::{HEADER_LEN, PREFACE};

/// Follows the frame boundaries of one direction of an HTTP/2 connection, fed in whatever
/// pieces it is read in: it yields each frame header and skips the payload (which the caller
/// forwards or ignores). Constant memory: one partial header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Follower {
    /// Bytes of the client preface still expected (0 once it has been seen, or when the
    /// stream is a server's, which starts with a frame).
    preface_left: u8,
    header: [u8; HEADER_LEN],
    have: u8,
    /// Payload bytes of the current frame still to skip.
    skip: u32,
    max_len: u32,
}

impl Follower {
    /// For a stream that starts with a frame (a server's side of a connection). Frames longer
    /// than `max_len` are errors.
    #[must_use]
    pub fn new(max_len: u32) -> Self {
        Self {
            preface_left: 0,
            header: [0; HEADER_LEN],
            have: 0,
            skip: 0,
            max_len,
        }
    }

    /// For a client's side of a connection: the preface first, then frames.
    #[must_use]
    pub fn client(max_len: u32) -> Self {
        Self {
            preface_left: PREFACE.len() as u8,
            ..Self::new(max_len)
        }
    }

    /// Changes the largest frame accepted from now on (the receiver's SETTINGS_MAX_FRAME_SIZE).
    pub fn set_max_len(&mut self, max_len: u32) {
        self.max_len = max_len;
    }

    /// Whether the follower is at a frame boundary (no partial header, no payload to skip).
    #[must_use]
    pub fn at_boundary(&self) -> bool {
        self.preface_left == 0 && self.have == 0 && self.skip == 0
    }

    /// Consumes `input` up to and including the next complete frame header and returns it;
    /// its payload is skipped as the following input arrives. `None` when `input` ran out
    /// first (what it held is remembered).
    ///
    /// # Errors
    /// The client preface does not match, or a frame is longer than the maximum. The follower
    /// is unusable afterwards (the connection is broken).
    pub fn next_head(&mut self, input: &mut &[u8]) -> Result<Option<Head>, FrameError> {
        while self.preface_left > 0 {
            let Some((&b, rest)) = input.split_first() else {
                return Ok(None);
            };
            let at = PREFACE.len() - usize::from(self.preface_left);
            if b != PREFACE[at] {
                return Err(FrameError::BadPreface);
            }
            *input = rest;
            self.preface_left -= 1;
        }
        if self.skip > 0 {
            let n = (self.skip as usize).min(input.len());
            *input = &input[n..];
            // n <= skip, which is a u32.
            self.skip -= n as u32;
            if self.skip > 0 {
                return Ok(None);
            }
        }
        let head = if let (0, Some((whole, rest))) = (self.have, input.split_first_chunk()) {
            // The usual case: the whole header is in this input; decode it where it lies.
            *input = rest;
            Head::decode(whole)
        } else {
            let have = usize::from(self.have);
            let n = (HEADER_LEN - have).min(input.len());
            self.header[have..have + n].copy_from_slice(&input[..n]);
            *input = &input[n..];
            self.have += n as u8;
            if usize::from(self.have) < HEADER_LEN {
                return Ok(None);
            }
            self.have = 0;
            Head::decode(&self.header)
        };
        if head.len > self.max_len {
            return Err(FrameError::TooLarge {
                kind: head.kind,
                len: head.len,
                max: self.max_len,
            });
        }
        self.skip = head.len;
        Ok(Some(head))
    }

    /// Consumes all of `input`, calling `f` with each frame header it completes, in order:
    /// what calling [`Follower::next_head`] until it returns `None` yields, in a tighter loop
    /// for followers that see every byte of a connection (request mode's socket taps, on
    /// every read). Between frames the state lives in locals, and a header that lies whole in
    /// `input` is decoded where it lies; only the preface and a header split across reads take
    /// [`Follower::next_head`]'s path.
    ///
    /// # Errors
    /// As [`Follower::next_head`], which leaves the follower in the same state; the headers
    /// before the error have been passed to `f`.
    pub fn each_head(
        &mut self,
        mut input: &[u8],
        mut f: impl FnMut(Head),
    ) -> Result<(), FrameError> {
        // The preface, a partial header, or a payload to skip: one step of the general path.
        while self.preface_left > 0 || self.have > 0 {
            match self.next_head(&mut input)? {
                Some(head) => f(head),
                None => return Ok(()),
            }
        }
        let mut skip = self.skip as usize;
        loop {
            if skip >= input.len() {
                // The payload goes on in the next input. `skip - len` <= `self.skip` or a
                // frame length, both u32.
                self.skip = (skip - input.len()) as u32;
                return Ok(());
            }
            input = &input[skip..];
            let Some((whole, rest)) = input.split_first_chunk() else {
                // A header split across inputs: the rest of it comes next.
                self.skip = 0;
                self.header[..input.len()].copy_from_slice(input);
                // Shorter than a header.
                self.have = input.len() as u8;
                return Ok(());
            };
            let head = Head::decode(whole);
            if head.len > self.max_len {
                self.skip = 0;
                return Err(FrameError::TooLarge {
                    kind: head.kind,
                    len: head.len,
                    max: self.max_len,
                });
            }
            input = rest;
            skip = head.len as usize;
            f(head);
        }
    }
}

impl Follower {
    /// The first bytes of a frame header split across inputs, as far as they have come: empty
    /// at a frame boundary, in the preface or in a payload.
    #[must_use]
    pub fn partial_header(&self) -> &[u8] {
        &self.header[..usize::from(self.have)]
    }

    /// Forgets the partial header, whose bytes are to be fed again (a reader that holds them
    /// back until the header is whole).
    pub fn unread_partial_header(&mut self) {
        self.have = 0;
    }

    /// As [`Follower::each_head`], also handing `f` the header's nine bytes when they lie whole
    /// in `input`, to rewrite before `input` goes on (`None` for a header begun in an earlier
    /// input), and what follows the header in `input` (where its payload starts). Steps with
    /// [`Follower::next_head`]: for a follower that rewrites now and then, not for every read
    /// of a busy connection.
    ///
    /// # Errors
    /// As [`Follower::next_head`].
    pub fn each_head_mut(
        &mut self,
        input: &mut [u8],
        mut f: impl FnMut(Head, Option<&mut [u8; HEADER_LEN]>, &[u8]),
    ) -> Result<(), FrameError> {
        let mut at = 0;
        loop {
            let split = self.have > 0;
            let mut rest = &input[at..];
            let Some(head) = self.next_head(&mut rest)? else {
                return Ok(());
            };
            let end = input.len() - rest.len();
            at = end;
            let (before, after) = input.split_at_mut(end);
            let whole = (!split && end >= HEADER_LEN)
                .then(|| before[end - HEADER_LEN..].first_chunk_mut())
                .flatten();
            f(head, whole, after);
        }
    }
}

/// The complete frames at the front of a buffer, each with its payload; stops at the first
/// incomplete one ([`Frames::rest`]) or at the first error.
#[derive(Debug, Clone)]
pub struct Frames<'a> {
    rest: &'a [u8],
    max_len: u32,
    failed: bool,
}

impl<'a> Frames<'a> {
    /// Frames in `buf` (which starts at a frame boundary) of at most `max_len` bytes each.
    #[must_use]
    pub fn new(buf: &'a [u8], max_len: u32) -> Self {
        Self {
            rest: buf,
            max_len,
            failed: false,
        }
    }

    /// What follows the frames yielded so far.
    #[must_use]
    pub fn rest(&self) -> &'a [u8] {
        self.rest
    }
}

impl<'a> Iterator for Frames<'a> {
    type Item = Result<(Head, &'a [u8]), FrameError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        let header: &[u8; HEADER_LEN] = self.rest.get(..HEADER_LEN)?.try_into().ok()?;
        let head = Head::decode(header);
        if head.len > self.max_len {
            self.failed = true;
            return Some(Err(FrameError::TooLarge {
                kind: head.kind,
                len: head.len,
                max: self.max_len,
            }));
        }
        let payload = self.rest.get(HEADER_LEN..head.frame_len())?;
        self.rest = &self.rest[head.frame_len()..];
        Some(Ok((head, payload)))
    }
}
