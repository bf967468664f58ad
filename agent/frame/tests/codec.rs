//! The codec against hand-made wire bytes (RFC 9113 examples), and its invariants as
//! properties: encode/decode round trips, and the same frames whatever pieces a stream is read
//! in.

use bytes::BytesMut;
use proptest::prelude::*;
use skewless_frame::grpc::{self, MessageDecoder, MessageError};
use skewless_frame::{
    DEFAULT_MAX_FRAME_SIZE, ErrorCode, Follower, FrameError, Frames, GoAway, HEADER_LEN, Head,
    Kind, MAX_MAX_FRAME_SIZE, PREFACE, Ping, RstStream, Setting, SettingId, Settings, WindowUpdate,
    flags,
};

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = Head::new(Kind::from(kind), flags, stream, payload.len() as u32)
        .encode()
        .to_vec();
    f.extend_from_slice(payload);
    f
}

#[test]
fn header_fields_decode_from_their_wire_positions() {
    let h = Head::decode(&[0x01, 0x02, 0x03, 0x1, 0x25, 0x80, 0, 0, 0x05]);
    assert_eq!(h.len, 0x01_0203);
    assert_eq!(h.kind, Kind::Headers);
    assert!(h.has(flags::END_STREAM) && h.has(flags::END_HEADERS) && h.has(flags::PRIORITY));
    assert!(h.is_end_stream() && h.is_end_headers());
    assert_eq!(h.stream_id, 5, "the reserved bit is not part of the id");
    assert!(h.reserved, "the reserved bit is kept");
    assert_eq!(
        h.encode(),
        [0x01, 0x02, 0x03, 0x1, 0x25, 0x80, 0, 0, 0x05],
        "re-encodes bit for bit"
    );
    assert_eq!(
        Head::decode(&[0, 0, 0, 0xfa, 0, 0, 0, 0, 0]).kind,
        Kind::Unknown(0xfa)
    );
    let ping_ack = Head::decode(&[0, 0, 8, 0x6, 0x1, 0, 0, 0, 0]);
    assert!(
        ping_ack.is_ack() && !ping_ack.is_end_stream(),
        "0x1 is ACK on PING"
    );
}

#[test]
fn control_payloads_decode_and_encode_to_the_same_bytes() {
    let wire = frame(0x7, 0, 0, &[0x80, 0, 0, 3, 0, 0, 0, 0xb, b'h', b'i']);
    let (head, payload) = Frames::new(&wire, DEFAULT_MAX_FRAME_SIZE)
        .next()
        .expect("a frame")
        .expect("valid");
    let g = GoAway::decode(&head, payload).expect("GOAWAY");
    assert_eq!(g.last_stream_id, 3, "reserved bit masked");
    assert_eq!(g.error_code, ErrorCode::ENHANCE_YOUR_CALM);
    assert_eq!(g.debug_data, b"hi");
    assert_eq!(format!("{:?}", g.error_code), "ENHANCE_YOUR_CALM");
    assert_eq!(format!("{:?}", ErrorCode(0x99)), "ErrorCode(0x99)");

    let mut out = BytesMut::new();
    Ping {
        ack: true,
        opaque: *b"skewless",
    }
    .encode(&mut out);
    assert_eq!(&out[..], &frame(0x6, 0x1, 0, b"skewless")[..]);
    out.clear();
    RstStream {
        stream_id: 7,
        error_code: ErrorCode::REFUSED_STREAM,
    }
    .encode(&mut out);
    assert_eq!(&out[..], &frame(0x3, 0, 7, &[0, 0, 0, 7])[..]);
    out.clear();
    WindowUpdate {
        stream_id: 0,
        increment: 65_535,
    }
    .encode(&mut out);
    assert_eq!(&out[..], &frame(0x8, 0, 0, &[0, 0, 0xff, 0xff])[..]);
    out.clear();
    Settings::encode(
        false,
        &[Setting {
            id: SettingId::MAX_FRAME_SIZE,
            value: 1 << 20,
        }],
        &mut out,
    );
    assert_eq!(&out[..], &frame(0x4, 0, 0, &[0, 5, 0, 0x10, 0, 0])[..]);
    let head = Head::decode(out[..HEADER_LEN].try_into().expect("9 bytes"));
    let s = Settings::decode(&head, &out[HEADER_LEN..]).expect("SETTINGS");
    assert_eq!(s.get(SettingId::MAX_FRAME_SIZE), Some(1 << 20));
    assert_eq!(s.get(SettingId::ENABLE_PUSH), None);
}

fn decode_err(kind: u8, fl: u8, stream: u32, payload: &[u8]) -> FrameError {
    let wire = frame(kind, fl, stream, payload);
    let head = Head::decode(wire[..HEADER_LEN].try_into().expect("9 bytes"));
    let p = &wire[HEADER_LEN..];
    match head.kind {
        Kind::Ping => Ping::decode(&head, p).map(drop),
        Kind::GoAway => GoAway::decode(&head, p).map(drop),
        Kind::RstStream => RstStream::decode(&head, p).map(drop),
        Kind::WindowUpdate => WindowUpdate::decode(&head, p).map(drop),
        Kind::Settings => Settings::decode(&head, p).map(drop),
        other => panic!("no payload decoder for {other:?}"),
    }
    .expect_err("the frame breaks RFC 9113")
}

#[test]
fn control_frames_that_break_the_rfc_are_typed_errors() {
    assert_eq!(
        decode_err(0x6, 0, 0, &[0; 7]).code(),
        ErrorCode::FRAME_SIZE_ERROR
    );
    assert_eq!(
        decode_err(0x6, 0, 1, &[0; 8]).code(),
        ErrorCode::PROTOCOL_ERROR
    );
    assert_eq!(
        decode_err(0x7, 0, 0, &[0; 7]).code(),
        ErrorCode::FRAME_SIZE_ERROR
    );
    assert_eq!(
        decode_err(0x7, 0, 3, &[0; 8]).code(),
        ErrorCode::PROTOCOL_ERROR
    );
    assert_eq!(
        decode_err(0x3, 0, 0, &[0; 4]).code(),
        ErrorCode::PROTOCOL_ERROR
    );
    assert_eq!(
        decode_err(0x3, 0, 1, &[0; 5]).code(),
        ErrorCode::FRAME_SIZE_ERROR
    );
    assert_eq!(
        decode_err(0x8, 0, 1, &[0; 4]),
        FrameError::BadIncrement {
            stream_id: 1,
            increment: 0
        }
    );
    assert_eq!(
        decode_err(0x4, 0, 0, &[0; 5]).code(),
        ErrorCode::FRAME_SIZE_ERROR
    );
    assert_eq!(
        decode_err(0x4, 0x1, 0, &[0; 6]).code(),
        ErrorCode::FRAME_SIZE_ERROR
    );
    assert_eq!(
        decode_err(0x4, 0, 0, &[0, 5, 0, 0, 0x3f, 0xff]),
        FrameError::BadSetting {
            id: 5,
            value: 16_383
        },
        "MAX_FRAME_SIZE below 16384"
    );
    assert_eq!(
        decode_err(0x4, 0, 0, &[0, 4, 0x80, 0, 0, 0]).code(),
        ErrorCode::FLOW_CONTROL_ERROR,
        "INITIAL_WINDOW_SIZE above 2^31-1"
    );
    assert_eq!(
        decode_err(0x4, 0, 0, &[0, 2, 0, 0, 0, 2]).code(),
        ErrorCode::PROTOCOL_ERROR
    );
}

#[test]
fn the_follower_checks_the_client_preface_and_frame_sizes() {
    let mut f = Follower::client(DEFAULT_MAX_FRAME_SIZE);
    let mut http1: &[u8] = b"GET / HTTP/1.1\r\n";
    assert_eq!(f.next_head(&mut http1), Err(FrameError::BadPreface));

    let mut f = Follower::client(DEFAULT_MAX_FRAME_SIZE);
    let mut stream = PREFACE.to_vec();
    stream.extend(frame(0x4, 0, 0, &[]));
    let mut input = &stream[..];
    let head = f.next_head(&mut input).expect("valid").expect("a frame");
    assert_eq!(head.kind, Kind::Settings);
    assert!(input.is_empty() && f.at_boundary());

    let big = Head::new(Kind::Data, 0, 1, DEFAULT_MAX_FRAME_SIZE + 1).encode();
    let mut input = &big[..];
    assert_eq!(
        f.next_head(&mut input),
        Err(FrameError::TooLarge {
            kind: Kind::Data,
            len: DEFAULT_MAX_FRAME_SIZE + 1,
            max: DEFAULT_MAX_FRAME_SIZE
        })
    );
    let mut f = Follower::new(MAX_MAX_FRAME_SIZE);
    let mut input = &big[..];
    assert!(f.next_head(&mut input).expect("accepted").is_some());
    assert!(!f.at_boundary(), "its payload is still to come");
}

#[test]
fn payloads_are_skipped_not_parsed() {
    // A DATA frame whose payload looks like a GOAWAY header, then a real GOAWAY.
    let mut stream = frame(0x0, 0, 1, &frame(0x7, 0, 0, &[0; 8]));
    stream.extend(frame(0x7, 0, 0, &[0; 8]));
    let mut f = Follower::new(DEFAULT_MAX_FRAME_SIZE);
    let mut input = &stream[..];
    let mut kinds = Vec::new();
    while let Some(h) = f.next_head(&mut input).expect("valid") {
        kinds.push(h.kind);
    }
    assert_eq!(kinds, [Kind::Data, Kind::GoAway]);
}

#[test]
fn grpc_messages_are_bounded_by_the_declared_length_cap() {
    let d = MessageDecoder::new(16);
    let mut buf = BytesMut::new();
    grpc::encode(false, b"hello", &mut buf).expect("encode");
    grpc::encode(true, b"", &mut buf).expect("encode");
    buf.extend_from_slice(&[0, 0, 0]);
    let m = d.decode(&mut buf).expect("valid").expect("complete");
    assert_eq!((&m.data[..], m.compressed), (&b"hello"[..], false));
    let m = d.decode(&mut buf).expect("valid").expect("complete");
    assert_eq!((&m.data[..], m.compressed), (&b""[..], true));
    assert_eq!(d.decode(&mut buf), Ok(None), "a partial prefix waits");
    assert_eq!(buf.len(), 3, "and stays buffered");

    let mut huge = BytesMut::from(&[0u8, 0xff, 0xff, 0xff, 0xff][..]);
    assert_eq!(
        d.decode(&mut huge),
        Err(MessageError::TooLarge {
            len: u64::from(u32::MAX),
            max: 16
        }),
        "refused as soon as the prefix is in, not after waiting for 4 GiB"
    );
    let mut bad = BytesMut::from(&[2u8, 0, 0, 0, 0][..]);
    assert_eq!(d.decode(&mut bad), Err(MessageError::BadFlag(2)));
}

fn any_head() -> impl Strategy<Value = Head> {
    (
        any::<u32>(),
        any::<u8>(),
        any::<u8>(),
        any::<u32>(),
        any::<bool>(),
    )
        .prop_map(|(len, kind, flags, id, reserved)| Head {
            len: len & 0x00ff_ffff,
            kind: Kind::from(kind),
            flags,
            stream_id: id & 0x7fff_ffff,
            reserved,
        })
}

/// A frame of any type with a payload of up to 300 bytes.
fn any_frame() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<u8>(),
        any::<u8>(),
        any::<u32>(),
        proptest::collection::vec(any::<u8>(), 0..300),
    )
        .prop_map(|(kind, flags, id, payload)| frame(kind, flags, id & 0x7fff_ffff, &payload))
}

proptest! {
    #[test]
    fn any_header_round_trips(h in any_head()) {
        prop_assert_eq!(Head::decode(&h.encode()), h);
    }

    #[test]
    fn any_nine_bytes_round_trip(b in any::<[u8; 9]>()) {
        prop_assert_eq!(Head::decode(&b).encode(), b);
    }

    #[test]
    fn control_payloads_round_trip(
        id in 1u32..=0x7fff_ffff, code in any::<u32>(), opaque in any::<[u8; 8]>(),
        ack in any::<bool>(), inc in 1u32..=0x7fff_ffff,
        debug in proptest::collection::vec(any::<u8>(), 0..64),
        settings in proptest::collection::vec((0u16..0x10, any::<u32>()), 0..8),
    ) {
        let mut buf = BytesMut::new();
        let goaway = GoAway { last_stream_id: id, error_code: ErrorCode(code), debug_data: &debug };
        goaway.encode(&mut buf);
        let ping = Ping { ack, opaque };
        ping.encode(&mut buf);
        let rst = RstStream { stream_id: id, error_code: ErrorCode(code) };
        rst.encode(&mut buf);
        let wu = WindowUpdate { stream_id: id, increment: inc };
        wu.encode(&mut buf);
        let list: Vec<Setting> = settings
            .iter()
            .map(|&(id, value)| Setting { id: SettingId(id), value })
            .collect();
        Settings::encode(false, &list, &mut buf);
        let frames: Vec<_> = Frames::new(&buf, DEFAULT_MAX_FRAME_SIZE)
            .collect::<Result<_, _>>()
            .expect("valid frames");
        prop_assert_eq!(frames.len(), 5);
        prop_assert_eq!(GoAway::decode(&frames[0].0, frames[0].1), Ok(goaway));
        prop_assert_eq!(Ping::decode(&frames[1].0, frames[1].1), Ok(ping));
        prop_assert_eq!(RstStream::decode(&frames[2].0, frames[2].1), Ok(rst));
        prop_assert_eq!(WindowUpdate::decode(&frames[3].0, frames[3].1), Ok(wu));
        match Settings::decode(&frames[4].0, frames[4].1) {
            Ok(s) => prop_assert_eq!(s.iter().collect::<Vec<_>>(), list),
            Err(FrameError::BadSetting { id, value }) => prop_assert!(
                list.contains(&Setting { id: SettingId(id), value }),
                "only an out-of-range value is refused"
            ),
            Err(e) => prop_assert!(false, "unexpected {e}"),
        }
    }

    #[test]
    fn any_chunking_gives_the_same_frames(
        frames in proptest::collection::vec(any_frame(), 0..12),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..20),
    ) {
        let mut stream = PREFACE.to_vec();
        for f in &frames {
            stream.extend_from_slice(f);
        }
        let whole: Vec<Head> = Frames::new(&stream[PREFACE.len()..], MAX_MAX_FRAME_SIZE)
            .map(|f| f.expect("valid").0)
            .collect();
        prop_assert_eq!(whole.len(), frames.len());
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(stream.len() + 1)).collect();
        at.push(0);
        at.push(stream.len());
        at.sort_unstable();
        let mut follower = Follower::client(MAX_MAX_FRAME_SIZE);
        let mut seen = Vec::new();
        for w in at.windows(2) {
            let mut piece = &stream[w[0]..w[1]];
            while let Some(h) = follower.next_head(&mut piece).expect("valid") {
                seen.push(h);
            }
            prop_assert!(piece.is_empty(), "every piece is consumed");
        }
        prop_assert_eq!(seen, whole);
        prop_assert!(follower.at_boundary() || frames.is_empty() && stream.len() < PREFACE.len());
    }

    /// `each_head` is `next_head` called until `None`, state included: on valid streams, on
    /// oversized frames and broken prefaces, read in any pieces, also after an error.
    #[test]
    fn each_head_yields_and_leaves_what_next_head_does(
        frames in proptest::collection::vec(any_frame(), 0..12),
        garbage in proptest::collection::vec(any::<u8>(), 0..40),
        client in any::<bool>(),
        broken_preface in any::<Option<prop::sample::Index>>(),
        max_len in prop_oneof![Just(MAX_MAX_FRAME_SIZE), 0u32..300],
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..20),
    ) {
        let mut stream = if client { PREFACE.to_vec() } else { Vec::new() };
        if let (true, Some(at)) = (client, broken_preface) {
            stream[at.index(PREFACE.len())] ^= 0x20;
        }
        for f in &frames {
            stream.extend_from_slice(f);
        }
        stream.extend_from_slice(&garbage);
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(stream.len() + 1)).collect();
        at.push(0);
        at.push(stream.len());
        at.sort_unstable();
        let start = if client { Follower::client(max_len) } else { Follower::new(max_len) };
        let (mut stepped, mut looped) = (start.clone(), start);
        for w in at.windows(2) {
            let piece = &stream[w[0]..w[1]];
            let mut by_step = Vec::new();
            let mut input = piece;
            loop {
                match stepped.next_head(&mut input) {
                    Ok(Some(h)) => by_step.push(Ok(h)),
                    Ok(None) => break,
                    Err(e) => {
                        by_step.push(Err(e));
                        break;
                    }
                }
            }
            let mut by_loop = Vec::new();
            if let Err(e) = looped.each_head(piece, |h| by_loop.push(Ok(h))) {
                by_loop.push(Err(e));
            }
            prop_assert_eq!(&by_loop, &by_step, "piece {}..{}", w[0], w[1]);
            prop_assert_eq!(&looped, &stepped, "state after piece {}..{}", w[0], w[1]);
        }
    }

    /// `each_head_mut` yields what `each_head` does, and hands over the bytes of every header
    /// that lies whole in its piece: rewriting them (the type, here) rewrites that header.
    #[test]
    fn each_head_mut_yields_each_head_and_the_bytes_of_the_whole_ones(
        frames in proptest::collection::vec(any_frame(), 0..12),
        client in any::<bool>(),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..20),
    ) {
        let mut stream = if client { PREFACE.to_vec() } else { Vec::new() };
        for f in &frames {
            stream.extend_from_slice(f);
        }
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(stream.len() + 1)).collect();
        at.push(0);
        at.push(stream.len());
        at.sort_unstable();
        let start = if client {
            Follower::client(MAX_MAX_FRAME_SIZE)
        } else {
            Follower::new(MAX_MAX_FRAME_SIZE)
        };
        let (mut looped, mut rewriting) = (start.clone(), start.clone());
        let (mut heads, mut expected, mut rewritten) = (Vec::new(), Vec::new(), Vec::new());
        let (mut wrong, mut handed) = (false, 0);
        for w in at.windows(2) {
            looped.each_head(&stream[w[0]..w[1]], |h| heads.push(h)).expect("valid");
            let mut piece = stream[w[0]..w[1]].to_vec();
            let original = piece.clone();
            rewriting
                .each_head_mut(&mut piece, |h, bytes, after| {
                    let mut h = h;
                    // What follows the header in the piece, untouched so far.
                    let at = original.len() - after.len();
                    wrong |= after != &original[at..];
                    if let Some(bytes) = bytes {
                        wrong |= Head::decode(bytes) != h
                            || at < HEADER_LEN
                            || original[at - HEADER_LEN..at] != bytes[..];
                        bytes[3] = 0xfe;
                        h.kind = Kind::Unknown(0xfe);
                        handed += 1;
                    }
                    expected.push(h);
                })
                .expect("valid");
            prop_assert!(!wrong, "the bytes handed over are the header's, then what follows it");
            prop_assert_eq!(&rewriting, &looped, "state after piece {}..{}", w[0], w[1]);
            rewritten.extend(piece);
        }
        prop_assert_eq!(expected.len(), heads.len());
        prop_assert!(
            heads.len() - handed <= cuts.len(),
            "only headers split by a cut are not handed over"
        );
        let mut again = start;
        let mut seen = Vec::new();
        again.each_head(&rewritten, |h| seen.push(h)).expect("valid");
        prop_assert_eq!(seen, expected, "the rewrites landed on their headers");
    }

    #[test]
    fn grpc_messages_round_trip_in_any_pieces(
        msgs in proptest::collection::vec((any::<bool>(), proptest::collection::vec(any::<u8>(), 0..100)), 0..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut wire = BytesMut::new();
        for (c, m) in &msgs {
            grpc::encode(*c, m, &mut wire).expect("encode");
        }
        let d = MessageDecoder::new(100);
        let cut = cut.index(wire.len() + 1);
        let mut buf = BytesMut::from(&wire[..cut]);
        let mut got = Vec::new();
        while let Some(m) = d.decode(&mut buf).expect("valid") {
            got.push((m.compressed, m.data.to_vec()));
        }
        buf.extend_from_slice(&wire[cut..]);
        while let Some(m) = d.decode(&mut buf).expect("valid") {
            got.push((m.compressed, m.data.to_vec()));
        }
        prop_assert_eq!(got, msgs);
        prop_assert!(buf.is_empty());
    }
}
