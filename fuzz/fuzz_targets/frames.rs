//! Any bytes, read in any pieces: the incremental follower and the whole-buffer parser agree,
//! every payload decoder returns a value or a typed error (never panics), and the gRPC
//! message decoder never waits for more than its cap.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use skewless_frame::grpc::MessageDecoder;
use skewless_frame::{
    Follower, Frames, GoAway, Kind, PREFACE, Ping, RstStream, Settings, WindowUpdate,
};

const MAX: u32 = 1 << 14;

fuzz_target!(|data: &[u8]| {
    let Some((&step, data)) = data.split_first() else {
        return;
    };
    let step = usize::from(step).max(1);

    // The follower, fed in pieces of `step` bytes, sees the frames the whole-buffer parser sees.
    let mut whole = Vec::new();
    let mut frames = Frames::new(data, MAX);
    let mut whole_err = None;
    for f in frames.by_ref() {
        match f {
            Ok((head, payload)) => {
                whole.push(head);
                let _ = match head.kind {
                    Kind::Ping => Ping::decode(&head, payload).map(drop),
                    Kind::GoAway => GoAway::decode(&head, payload).map(drop),
                    Kind::RstStream => RstStream::decode(&head, payload).map(drop),
                    Kind::WindowUpdate => WindowUpdate::decode(&head, payload).map(drop),
                    Kind::Settings => Settings::decode(&head, payload).map(|s| {
                        for setting in s.iter() {
                            std::hint::black_box(setting);
                        }
                    }),
                    _ => Ok(()),
                };
            }
            Err(e) => whole_err = Some(e),
        }
    }
    let mut follower = Follower::new(MAX);
    let mut seen = Vec::new();
    let mut follow_err = None;
    'outer: for mut piece in data.chunks(step) {
        loop {
            match follower.next_head(&mut piece) {
                Ok(Some(h)) => seen.push(h),
                Ok(None) => break,
                Err(e) => {
                    follow_err = Some(e);
                    break 'outer;
                }
            }
        }
    }
    // The follower yields a header as soon as it is complete, the buffer parser only once the
    // payload is in too: the follower may have one more (the incomplete last frame).
    assert!(seen.starts_with(&whole), "the follower agrees with the buffer parser");
    assert!(seen.len() <= whole.len() + 1);
    if whole_err.is_some() {
        assert_eq!(follow_err, whole_err, "both refuse the same oversized frame");
    }

    // A client stream: the preface is checked byte by byte.
    let mut client = Follower::client(MAX);
    let mut input = data;
    let r = client.next_head(&mut input);
    if !data.starts_with(&PREFACE[..data.len().min(PREFACE.len())]) {
        assert!(r.is_err(), "a wrong preface is refused");
    }

    // gRPC messages: never more than the cap is awaited.
    let d = MessageDecoder::new(1024);
    let mut buf = BytesMut::from(data);
    while let Ok(Some(m)) = d.decode(&mut buf) {
        assert!(m.data.len() <= 1024);
    }
});
