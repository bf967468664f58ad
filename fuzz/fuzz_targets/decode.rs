//! Any bytes as a datagram from the conntrack socket: `decode` returns the messages or a typed
//! error, never panics, never reads past the datagram, and every entry it returns is one TCP
//! tuple pair of a single address family.
#![no_main]

use libfuzzer_sys::fuzz_target;
use skewless_conntrack::{Reply, decode};

fuzz_target!(|data: &[u8]| {
    let Ok(replies) = decode(data) else { return };
    // A message is at least a 16-byte header, so a datagram holds at most len/16 of them.
    assert!(replies.len() <= data.len() / 16, "more messages than headers fit");
    for reply in replies {
        if let Reply::Entry { entry, .. } = reply {
            assert_eq!(
                entry.src.is_ipv6(),
                entry.dst.is_ipv6(),
                "an original tuple mixes families: {entry:?}"
            );
        }
    }
});
