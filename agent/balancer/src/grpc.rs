//! The few gRPC-over-HTTP/2 details the balancer must speak itself: `grpc-timeout` and locally
//! generated statuses (PROTOCOL-HTTP2.md in grpc/grpc).

use std::time::Duration;

use http::{HeaderMap, HeaderValue, Response, header};

/// gRPC status codes the balancer generates or inspects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Code {
    /// The call was cancelled.
    Cancelled = 1,
    /// The deadline expired.
    DeadlineExceeded = 4,
    /// Internal error.
    Internal = 13,
    /// The service is unavailable; safe for clients to retry.
    Unavailable = 14,
}

/// The `grpc-timeout` header.
pub const GRPC_TIMEOUT: &str = "grpc-timeout";

/// Parses a `grpc-timeout` value: at most 8 ASCII digits and a unit (H, M, S, m, u, n).
/// Returns `None` for a malformed value, which is then ignored (no deadline), as gRPC servers do.
#[must_use]
pub fn parse_timeout(value: &HeaderValue) -> Option<Duration> {
    parse_timeout_bytes(value.as_bytes())
}

/// [`parse_timeout`] of a value's bytes (a header list decoded without `http`'s types).
#[must_use]
pub fn parse_timeout_bytes(value: &[u8]) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    if !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    // At most 8 digits: no overflow.
    let n = digits
        .iter()
        .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
    Some(match unit {
        b"H" => Duration::from_secs(n.checked_mul(3600)?),
        b"M" => Duration::from_secs(n.checked_mul(60)?),
        b"S" => Duration::from_secs(n),
        b"m" => Duration::from_millis(n),
        b"u" => Duration::from_micros(n),
        b"n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Encodes a remaining budget as a `grpc-timeout` value, in the finest unit that fits the
/// 8 digits the spec allows (rounding up so the upstream never sees a shorter budget than is
/// left, except for the sub-unit remainder of hours).
#[must_use]
pub fn encode_timeout(remaining: Duration) -> HeaderValue {
    const MAX: u128 = 99_999_999;
    let nanos = remaining.as_nanos();
    let units: [(u128, char); 6] = [
        (1, 'n'),
        (1_000, 'u'),
        (1_000_000, 'm'),
        (1_000_000_000, 'S'),
        (60_000_000_000, 'M'),
        (3_600_000_000_000, 'H'),
    ];
    for (per, unit) in units {
        let n = nanos.div_ceil(per);
        if n <= MAX {
            return HeaderValue::from_str(&format!("{n}{unit}"))
                .unwrap_or_else(|_| HeaderValue::from_static("99999999H"));
        }
    }
    HeaderValue::from_static("99999999H")
}

/// True when the message is gRPC (`application/grpc` or `application/grpc+proto` etc.).
#[must_use]
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/grpc"))
}

/// The `grpc-status` of a trailers (or trailers-only headers) map, if any.
#[must_use]
pub fn status_of(headers: &HeaderMap) -> Option<u32> {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse().ok())
}

/// Headers carrying a gRPC status and message, for trailers or a trailers-only response.
#[must_use]
pub fn status_headers(code: Code, message: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("grpc-status", HeaderValue::from(u16::from(code as u8)));
    if let Ok(v) = HeaderValue::from_str(&percent_encode(message)) {
        headers.insert("grpc-message", v);
    }
    headers
}

/// A trailers-only gRPC response: HTTP 200, the status in the headers, and an empty body whose
/// end of stream goes out with the HEADERS frame.
#[must_use]
pub fn status_response<B: Default>(code: Code, message: &str) -> Response<B> {
    let mut resp = Response::new(B::default());
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.extend(status_headers(code, message));
    resp
}

/// Percent-encodes a `grpc-message` as the spec asks (everything outside printable ASCII and
/// `%` itself).
fn percent_encode(message: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_units_parse() {
        let p = |s: &'static str| parse_timeout(&HeaderValue::from_static(s));
        assert_eq!(p("100m"), Some(Duration::from_millis(100)));
        assert_eq!(p("5S"), Some(Duration::from_secs(5)));
        assert_eq!(p("2M"), Some(Duration::from_secs(120)));
        assert_eq!(p("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(p("7u"), Some(Duration::from_micros(7)));
        assert_eq!(p("9n"), Some(Duration::from_nanos(9)));
    }

    #[test]
    fn malformed_timeouts_are_ignored() {
        for s in ["", "m", "123456789m", "10x", "-1m", "1.5S"] {
            assert_eq!(
                parse_timeout(&HeaderValue::from_str(s).unwrap()),
                None,
                "{s:?} must not parse"
            );
        }
    }

    #[test]
    fn encoded_timeout_round_trips_without_shrinking() {
        for d in [
            Duration::from_nanos(1),
            Duration::from_micros(1500),
            Duration::from_millis(250),
            Duration::from_secs(30),
            Duration::from_secs(86_400 * 30),
        ] {
            let v = encode_timeout(d);
            let back = parse_timeout(&v).expect("encoded timeout parses");
            assert!(back >= d, "{v:?} must not shorten {d:?}");
            assert!(v.len() <= 9, "{v:?} must fit 8 digits and a unit");
        }
    }

    #[test]
    fn status_message_is_percent_encoded() {
        let h = status_headers(Code::Unavailable, "no endpoint 100% ready\n");
        assert_eq!(h["grpc-status"], "14");
        assert_eq!(h["grpc-message"], "no endpoint 100%25 ready%0A");
    }
}
