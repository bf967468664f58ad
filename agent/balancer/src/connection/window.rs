//! A sliding window of counts: one slot per controller tick, the oldest dropped as a new one
//! starts. Fixed size, so its memory is bounded whatever the traffic.

/// Counts of the last `len` ticks.
#[derive(Debug, Clone)]
pub(crate) struct Window {
    slots: Box<[u64]>,
    /// Index of the newest slot.
    head: usize,
    /// Slots filled so far (up to the length).
    filled: usize,
}

impl Window {
    /// A window of `len` ticks (at least one).
    pub(crate) fn new(len: usize) -> Self {
        Self {
            slots: vec![0; len.max(1)].into_boxed_slice(),
            head: 0,
            filled: 0,
        }
    }

    /// Starts a new tick's slot with `count`, dropping the oldest once the window is full.
    pub(crate) fn push(&mut self, count: u64) {
        self.head = (self.head + 1) % self.slots.len();
        self.slots[self.head] = count;
        self.filled = (self.filled + 1).min(self.slots.len());
    }

    /// Sum over the window.
    pub(crate) fn sum(&self) -> u64 {
        self.slots.iter().sum()
    }

    /// Ticks the window covers so far (less than its length while it fills up).
    pub(crate) fn filled(&self) -> usize {
        self.filled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_forgets_the_oldest_tick() {
        let mut w = Window::new(3);
        assert_eq!((w.sum(), w.filled()), (0, 0));
        for n in [1, 2, 3] {
            w.push(n);
        }
        assert_eq!((w.sum(), w.filled()), (6, 3));
        w.push(10);
        assert_eq!(w.sum(), 15, "the first tick's 1 is gone");
        assert_eq!(w.filled(), 3);
    }
}
