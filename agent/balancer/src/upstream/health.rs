//! Active health checking with `grpc.health.v1.Health/Watch` over the endpoint's own
//! connection, with gRFC A17 semantics: an endpoint is usable while its latest status is
//! SERVING; UNIMPLEMENTED means the server does not do health checks and counts as healthy
//! (the watch stops); any other end of the watch makes the endpoint unusable until a new watch
//! (after a backoff) reports SERVING again. Status changes apply as soon as the update arrives.
//!
//! The two messages involved are encoded and decoded by hand (one field each) rather than
//! pulling protobuf code generation into the balancer. The responses a backend sends are read
//! by [`StatusReader`], which holds at most one capped message (fuzzed: `fuzz/`,
//! target `health`).
//!
//! The watch reports through a callback and knows nothing of who listens: request mode's pool
//! and connection mode's backends both use it.

use std::time::Duration;

use bytes::{Buf as _, BufMut as _, Bytes, BytesMut};
use h2::client::SendRequest;
use http::{HeaderValue, Request, header};
use skewless_frame::grpc::{MessageDecoder, MessageError, PREFIX_LEN};

use crate::grpc;

const SERVING: u64 = 1;
/// Largest `HealthCheckResponse` accepted. It is a few bytes: a server declaring more is broken
/// or hostile, and the watch ends instead of buffering what the 5-byte prefix can declare
/// (4 GiB).
pub const MAX_RESPONSE: u32 = 64 * 1024;
const MESSAGES: MessageDecoder = MessageDecoder::new(MAX_RESPONSE);
const UNIMPLEMENTED: u32 = 12;

/// What ended one watch.
enum Ended {
    /// The server has no health service: healthy for the life of the connection.
    Unimplemented,
    /// The watch failed or ended; retry after a backoff.
    Failed,
}

/// Watches `service` on the endpoint's connection for as long as the connection lives (the
/// caller aborts this task when the connection ends), calling `report` with every status:
/// `true` for SERVING (or no health service at all), `false` for anything else.
pub(crate) async fn watch(
    mut report: impl FnMut(bool),
    sender: SendRequest<Bytes>,
    authority: String,
    service: String,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match watch_once(&mut report, &sender, &authority, &service).await {
            Ended::Unimplemented => {
                tracing::debug!("no health service, treating the endpoint as serving");
                report(true);
                return;
            }
            Ended::Failed => {
                report(false);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// The active health check of an endpoint over a connection of the balancer's own, for a data
/// path without an h2 connection of its own to the endpoint (connection mode relays bytes;
/// request mode on the frame codec has its own HTTP/2): connects, watches (see [`watch`]), and reconnects when that
/// connection ends, until `connect_timeout` (read before every connect) says its owner is
/// gone. A connection the endpoint closes gracefully (its own max connection age) is replaced
/// without a report: only the watch's answers, and a watch that fails on a live connection,
/// change the endpoint's state.
pub(crate) async fn watch_on_own_connection(
    connect_timeout: impl Fn() -> Option<Duration>,
    report: impl FnMut(bool) + Clone,
    addr: std::net::SocketAddr,
    service: String,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some(timeout) = connect_timeout() else {
            return;
        };
        // The default TCP backstop; the connect itself ends with a PING the server answers.
        match crate::upstream::connect(
            addr,
            timeout,
            &crate::upstream::liveness::LivenessConfig::default(),
        )
        .await
        {
            Ok(crate::upstream::Connected {
                sender,
                mut ended,
                go_away,
                ..
            }) => {
                let started = tokio::time::Instant::now();
                let watch = watch(report.clone(), sender, addr.to_string(), service.clone());
                tokio::pin!(watch);
                tokio::select! {
                    // Only when the server has no health service: it serves for good.
                    () = &mut watch => { let _ = (&mut ended).await; }
                    _ = &mut ended => {}
                    () = go_away.notified() => tracing::debug!("health connection got GOAWAY, replacing it"),
                }
                // Replaced at once, unless connections keep dying young.
                if started.elapsed() >= Duration::from_millis(100) {
                    backoff = Duration::from_millis(100);
                    continue;
                }
            }
            Err(error) => {
                tracing::debug!(%error, backoff_ms = backoff.as_millis(), "health connection failed");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

async fn watch_once(
    report: &mut impl FnMut(bool),
    sender: &SendRequest<Bytes>,
    authority: &str,
    service: &str,
) -> Ended {
    let Ok(mut req) =
        Request::post(format!("http://{authority}/grpc.health.v1.Health/Watch")).body(())
    else {
        return Ended::Failed;
    };
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    req.headers_mut()
        .insert(header::TE, HeaderValue::from_static("trailers"));
    let sent = async {
        let mut sender = sender.clone().ready().await?;
        let (resp, mut body) = sender.send_request(req, false)?;
        body.send_data(encode_request(service), true)?;
        resp.await
    };
    let resp = match sent.await {
        Ok(resp) => resp,
        Err(error) => {
            tracing::debug!(%error, "health watch failed");
            return Ended::Failed;
        }
    };
    if grpc::status_of(resp.headers()) == Some(UNIMPLEMENTED) {
        return Ended::Unimplemented;
    }
    let mut body = resp.into_body();
    let mut reader = StatusReader::new();
    while let Some(data) = body.data().await {
        let Ok(data) = data else {
            return Ended::Failed;
        };
        let _ = body.flow_control().release_capacity(data.len());
        let read = reader.push(&data, |status| {
            let serving = status == Some(SERVING);
            tracing::debug!(serving, "health status");
            report(serving);
        });
        if let Err(error) = read {
            tracing::debug!(%error, "bad health message");
            return Ended::Failed;
        }
    }
    if let Ok(Some(trailers)) = body.trailers().await
        && grpc::status_of(&trailers) == Some(UNIMPLEMENTED)
    {
        return Ended::Unimplemented;
    }
    Ended::Failed
}

/// What ends a watch's response stream as unreadable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StatusError {
    /// The message prefix is invalid or declares more than [`MAX_RESPONSE`].
    #[error("invalid health response message")]
    Message(#[source] MessageError),
    /// A compressed message: the watch offers no compression, so it cannot be read.
    #[error("compressed health response, though no compression was offered")]
    Compressed,
}

/// Reads the `HealthCheckResponse` messages of one watch from its DATA frames, in whatever
/// pieces they arrive. It holds at most one incomplete message (under
/// `PREFIX_LEN + MAX_RESPONSE` bytes once a piece is consumed): a longer declared length is an
/// error as soon as its prefix has arrived.
#[derive(Debug, Default)]
pub struct StatusReader {
    buf: BytesMut,
}

impl StatusReader {
    /// A reader at the start of a response stream.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Consumes one piece of the stream, calling `status` with the `status` field of every
    /// message it completes (`None` for a message that is not a valid `HealthCheckResponse`,
    /// which counts as not serving).
    ///
    /// # Errors
    /// An invalid or oversized message prefix, or a compressed message: the stream cannot be
    /// read further.
    pub fn push(
        &mut self,
        data: &[u8],
        mut status: impl FnMut(Option<u64>),
    ) -> Result<(), StatusError> {
        self.buf.extend_from_slice(data);
        while let Some(message) = MESSAGES
            .decode(&mut self.buf)
            .map_err(StatusError::Message)?
        {
            if message.compressed {
                return Err(StatusError::Compressed);
            }
            status(decode_status(&message.data));
        }
        Ok(())
    }

    /// Bytes held for an incomplete message.
    #[must_use]
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }
}

/// Bytes a [`StatusReader`] may hold between pieces.
pub const MAX_BUFFERED: usize = PREFIX_LEN + MAX_RESPONSE as usize;

/// One gRPC frame holding `HealthCheckRequest { service }`.
fn encode_request(service: &str) -> Bytes {
    let mut msg = BytesMut::new();
    if !service.is_empty() {
        msg.put_u8(0x0a); // field 1, length-delimited
        put_varint(&mut msg, service.len() as u64);
        msg.put_slice(service.as_bytes());
    }
    let mut frame = BytesMut::with_capacity(5 + msg.len());
    frame.put_u8(0); // not compressed
    frame.put_u32(u32::try_from(msg.len()).unwrap_or(u32::MAX));
    frame.put_slice(&msg);
    frame.freeze()
}

fn put_varint(buf: &mut BytesMut, mut v: u64) {
    while v >= 0x80 {
        buf.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    buf.put_u8(v as u8);
}

fn get_varint(buf: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.first()?;
        buf.advance(1);
        v |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return Some(v);
        }
    }
    None
}

/// The `status` (field 1) of a `HealthCheckResponse`; absent means UNKNOWN (0).
fn decode_status(mut msg: &[u8]) -> Option<u64> {
    let mut status = 0;
    while !msg.is_empty() {
        let key = get_varint(&mut msg)?;
        match key & 7 {
            0 => {
                let v = get_varint(&mut msg)?;
                if key >> 3 == 1 {
                    status = v;
                }
            }
            1 => msg = msg.get(8..)?,
            2 => {
                let len = usize::try_from(get_varint(&mut msg)?).ok()?;
                msg = msg.get(len..)?;
            }
            5 => msg = msg.get(4..)?,
            _ => return None,
        }
    }
    Some(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_messages_round_trip_through_the_hand_codec() {
        let frame = encode_request("skewless.echo.v1.Echo");
        assert_eq!(&frame[..5], &[0, 0, 0, 0, 23]);
        assert_eq!(frame[5], 0x0a);
        let mut buf = BytesMut::from(&[0u8, 0, 0, 0, 2, 0x08, 0x02, 0, 0][..]);
        let m = MESSAGES
            .decode(&mut buf)
            .expect("valid")
            .expect("complete message");
        assert_eq!(decode_status(&m.data), Some(2), "NOT_SERVING");
        assert_eq!(buf.len(), 2, "the partial next frame stays buffered");
        assert_eq!(decode_status(&[]), Some(0), "an empty message is UNKNOWN");
        assert_eq!(decode_status(&[0x08, 0x01]), Some(SERVING));
    }

    #[test]
    fn the_reader_reports_each_message_across_pieces_and_refuses_compressed_ones() {
        let stream = [0u8, 0, 0, 0, 2, 0x08, 0x01, 0, 0, 0, 0, 2, 0x08, 0x02];
        for split in 0..=stream.len() {
            let mut reader = StatusReader::new();
            let mut seen = Vec::new();
            let (a, b) = stream.split_at(split);
            reader.push(a, |s| seen.push(s)).expect("valid");
            reader.push(b, |s| seen.push(s)).expect("valid");
            assert_eq!(seen, [Some(SERVING), Some(2)], "split at {split}");
            assert_eq!(reader.buffered(), 0);
        }
        let mut reader = StatusReader::new();
        assert_eq!(
            reader.push(&[1, 0, 0, 0, 2, 0x08, 0x01], |_| panic!("not decoded")),
            Err(StatusError::Compressed)
        );
    }

    #[test]
    fn a_health_message_declaring_more_than_the_cap_is_refused_at_once() {
        let mut buf = BytesMut::from(&[0u8, 0xff, 0xff, 0xff, 0xff][..]);
        assert!(
            MESSAGES.decode(&mut buf).is_err(),
            "not awaited: 4 GiB declared"
        );
    }
}
