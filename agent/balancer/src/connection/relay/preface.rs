//! A new client connection's first bytes, read before anything is spent on it: connection mode
//! places a client, connects its backend and allocates the relay's two buffers only once the
//! client has sent its connection preface and its first SETTINGS frame. A client that connects
//! and stays silent (or sends part of a preface) then holds a few dozen bytes and no backend
//! connection until the handshake timeout closes it.
//!
//! Why the SETTINGS frame too, not just the 24 preface bytes: the preface is the magic
//! *followed by* a SETTINGS frame that is not an ACK (RFC 9113 section 3.4), and a client sends both without
//! waiting for the server, so waiting for both cannot stall a conforming client; the relay's
//! handshake timeout has always meant "preface and SETTINGS"; and a client that stops after
//! the magic would otherwise still get a backend connection and both buffers for 24 bytes.
//!
//! Bounded: nothing reaches the client before its backend is connected, so it has not seen
//! the server's SETTINGS and may not send a frame above the default maximum frame size
//! (16,384 bytes); at most 24 + 9 + 16,384 bytes are held, a typical client's ~70. Exactly the
//! preface and the SETTINGS frame are read (the magic checked as it arrives): what the client
//! sent after them stays in the socket for the relay.

use std::time::Duration;

use skewless_frame::{
    DEFAULT_MAX_FRAME_SIZE, FrameError, HEADER_LEN, Head, Kind, PREFACE, Settings,
};
use tokio::io::{AsyncRead, AsyncReadExt as _};

use super::{ProtocolError, RelayError};

/// The preface and its SETTINGS frame, before the frame's payload.
const HELLO: usize = PREFACE.len() + HEADER_LEN;

/// A client's connection preface and first SETTINGS frame as read (and checked) by
/// [`read_preface`]; [`super::relay_after`] relays them to the backend first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preface {
    bytes: Vec<u8>,
}

impl Preface {
    /// The bytes read, as they came: the preface, then the SETTINGS frame.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// Reads a new client connection's preface and first SETTINGS frame within `timeout`.
/// `Ok(None)`: the client closed the connection before it sent both.
///
/// # Errors
/// `ClientProtocol(NoPreface)` when both did not come within `timeout`; `ClientProtocol` with a
/// frame error when the client is not speaking HTTP/2 (the magic differs, or the first frame is
/// not a valid SETTINGS frame of at most 16,384 bytes); `ClientIo` when reading fails.
pub async fn read_preface(
    client: &mut (impl AsyncRead + Unpin),
    timeout: Duration,
) -> Result<Option<Preface>, RelayError> {
    let no_preface = RelayError::ClientProtocol(ProtocolError::NoPreface(timeout));
    tokio::time::timeout(timeout, read(client))
        .await
        .unwrap_or(Err(no_preface))
}

fn malformed(e: FrameError) -> RelayError {
    RelayError::ClientProtocol(ProtocolError::Frame(e))
}

async fn read(client: &mut (impl AsyncRead + Unpin)) -> Result<Option<Preface>, RelayError> {
    let mut bytes = vec![0u8; HELLO];
    let mut filled = 0;
    while filled < HELLO {
        let n = client
            .read(&mut bytes[filled..])
            .await
            .map_err(RelayError::ClientIo)?;
        if n == 0 {
            return Ok(None);
        }
        // The magic is checked as it arrives: an HTTP/1.1 request shorter than `HELLO` is
        // refused at once, not at the timeout.
        let magic = filled.min(PREFACE.len())..(filled + n).min(PREFACE.len());
        if bytes[magic.clone()] != PREFACE[magic] {
            return Err(malformed(FrameError::BadPreface));
        }
        filled += n;
    }
    let header: [u8; HEADER_LEN] = bytes[PREFACE.len()..]
        .try_into()
        .map_err(|_| malformed(FrameError::BadPreface))?;
    let head = Head::decode(&header);
    if head.kind != Kind::Settings || head.is_ack() {
        // The preface is the magic followed by the client's SETTINGS frame (RFC 9113 section
        // 3.4): an ACK acknowledges the server's and is no preface.
        return Err(malformed(FrameError::BadPreface));
    }
    if head.len > DEFAULT_MAX_FRAME_SIZE {
        return Err(malformed(FrameError::TooLarge {
            kind: head.kind,
            len: head.len,
            max: DEFAULT_MAX_FRAME_SIZE,
        }));
    }
    bytes.resize(HELLO + head.len as usize, 0);
    match client.read_exact(&mut bytes[HELLO..]).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(RelayError::ClientIo(e)),
    }
    Settings::decode(&head, &bytes[HELLO..]).map_err(malformed)?;
    Ok(Some(Preface { bytes }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt as _;

    fn hello(settings: &[skewless_frame::Setting]) -> Vec<u8> {
        let mut v = PREFACE.to_vec();
        Settings::encode(false, settings, &mut v);
        v
    }

    async fn read_sent(sent: &[u8], close: bool) -> Result<Option<Preface>, RelayError> {
        let (mut client, mut ours) = tokio::io::duplex(1 << 16);
        client.write_all(sent).await.expect("write");
        if close {
            drop(client);
            read_preface(&mut ours, Duration::from_secs(10)).await
        } else {
            let r = read_preface(&mut ours, Duration::from_secs(10)).await;
            drop(client);
            r
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn exactly_the_preface_and_first_settings_are_read_the_rest_stays_unread() {
        let setting = skewless_frame::Setting {
            id: skewless_frame::SettingId::INITIAL_WINDOW_SIZE,
            value: 1 << 20,
        };
        let first = hello(&[setting]);
        let mut sent = first.clone();
        sent.extend_from_slice(b"after");
        let (mut client, mut ours) = tokio::io::duplex(1 << 16);
        client.write_all(&sent).await.expect("write");
        let p = read_preface(&mut ours, Duration::from_secs(10))
            .await
            .expect("a preface")
            .expect("not closed");
        assert_eq!(p.bytes(), &first[..]);
        let mut rest = [0u8; 5];
        ours.read_exact(&mut rest).await.expect("the rest");
        assert_eq!(
            &rest, b"after",
            "what follows the SETTINGS is left for the relay"
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn what_is_not_an_http2_preface_is_refused_without_waiting() {
        for (sent, what) in [
            (
                b"GET / HTTP/1.1\r\n\r\n".to_vec(),
                "HTTP/1.1 shorter than a preface",
            ),
            (b"\x16\x03\x01\x02\x00\x01".to_vec(), "a TLS ClientHello"),
            (
                {
                    let mut v = PREFACE.to_vec();
                    v.extend(Head::new(Kind::Ping, 0, 0, 8).encode());
                    v
                },
                "a PING as the first frame",
            ),
            (
                {
                    let mut v = PREFACE.to_vec();
                    v.extend(Head::new(Kind::Settings, 0x1, 0, 0).encode());
                    v
                },
                "a SETTINGS ACK as the first frame",
            ),
            (
                {
                    let mut v = PREFACE.to_vec();
                    v.extend(Head::new(Kind::Settings, 0, 0, DEFAULT_MAX_FRAME_SIZE + 6).encode());
                    v
                },
                "a SETTINGS frame above the default maximum frame size",
            ),
            (
                {
                    let mut v = PREFACE.to_vec();
                    v.extend(Head::new(Kind::Settings, 0, 0, 5).encode());
                    v.extend([0; 5]);
                    v
                },
                "a SETTINGS frame of 5 bytes",
            ),
        ] {
            let t0 = tokio::time::Instant::now();
            let r = read_sent(&sent, false).await;
            assert!(
                matches!(r, Err(RelayError::ClientProtocol(ProtocolError::Frame(_)))),
                "{what}: {r:?}"
            );
            assert_eq!(t0.elapsed(), Duration::ZERO, "{what}: refused at once");
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_client_that_stops_before_its_settings_meets_the_timeout_or_closes() {
        let full = hello(&[]);
        for sent in [
            &b""[..],
            &PREFACE[..12],
            &PREFACE[..],
            &full[..full.len() - 1],
        ] {
            let t0 = tokio::time::Instant::now();
            let r = read_sent(sent, false).await;
            assert!(
                matches!(
                    r,
                    Err(RelayError::ClientProtocol(ProtocolError::NoPreface(_)))
                ),
                "{} bytes: {r:?}",
                sent.len()
            );
            assert_eq!(t0.elapsed(), Duration::from_secs(10));
            let r = read_sent(sent, true).await;
            assert!(
                matches!(r, Ok(None)),
                "{} bytes then FIN: {r:?}",
                sent.len()
            );
        }
    }
}
