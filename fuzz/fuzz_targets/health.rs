//! Any bytes as the response stream of a `grpc.health.v1.Health/Watch`, read in any pieces:
//! the reader reports the same statuses and the same verdict however the stream is cut (a
//! backend's DATA frames may split messages anywhere), never panics, and never holds more than
//! one capped message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use skewless_balancer::health::{MAX_BUFFERED, StatusReader};

/// Statuses reported, and whether the stream was refused, reading `data` in `step`-byte pieces.
fn read(data: &[u8], step: usize) -> (Vec<Option<u64>>, bool) {
    let mut reader = StatusReader::new();
    let mut seen = Vec::new();
    for piece in data.chunks(step) {
        if reader.push(piece, |s| seen.push(s)).is_err() {
            return (seen, true);
        }
        assert!(
            reader.buffered() < MAX_BUFFERED,
            "{} bytes held between pieces",
            reader.buffered()
        );
    }
    (seen, false)
}

fuzz_target!(|data: &[u8]| {
    let Some((&step, data)) = data.split_first() else {
        return;
    };
    let whole = read(data, data.len().max(1));
    let pieces = read(data, usize::from(step).max(1));
    assert_eq!(whole, pieces, "pieces of {step} bytes");
});
