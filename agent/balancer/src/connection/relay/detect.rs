//! Recognising clients that fail calls on any GOAWAY (tonic: h2 refuses every request after
//! one, and tonic does not retry them; see docs/connection-mode.md), and clients that write
//! their requests lazily (grpc-js on nghttp2), from the first request's `user-agent`. The
//! first header block of a connection is decoded against an empty HPACK table, so the relay
//! copies the client's first bytes (preface, SETTINGS, the first HEADERS and its
//! CONTINUATIONs, at most `MAX_CAPTURE`) and hands them to an h2 server over an in-memory
//! pipe: h2 does the HPACK decoding, the relay never does.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::AsyncWriteExt as _;

use super::Shared;

/// Bytes of the client's stream kept for the check; a first header block beyond it is not
/// decoded (the connection counts as rotatable).
pub(super) const MAX_CAPTURE: usize = 16 * 1024;

/// User-agent prefixes of clients that fail calls on a graceful GOAWAY.
const FAILS_ON_GOAWAY: &[&str] = &["tonic/"];

/// User-agent products of clients built on nghttp2 (Node's http2), which refuses every
/// request whose HEADERS it has not written yet once any GOAWAY arrived: their rotations start
/// with a quiesce (see `conn::Phase::Quiescing`). grpc-js puts an application's own user-agent
/// (`grpc.primary_user_agent`) first, so any product of the header counts.
const NGHTTP2_CLIENTS: &[&str] = &["grpc-node-js/"];

/// Whether a client with this user-agent fails its calls on a GOAWAY.
pub(super) fn fails_on_go_away(user_agent: &[u8]) -> bool {
    FAILS_ON_GOAWAY
        .iter()
        .any(|p| user_agent.starts_with(p.as_bytes()))
}

/// Whether a client with this user-agent writes its requests' HEADERS lazily (nghttp2).
pub(super) fn writes_requests_lazily(user_agent: &[u8]) -> bool {
    user_agent.split(u8::is_ascii_whitespace).any(|product| {
        NGHTTP2_CLIENTS
            .iter()
            .any(|p| product.starts_with(p.as_bytes()))
    })
}

/// Decodes the first request of `captured` (the start of a client's stream) with h2.
async fn first_user_agent(captured: Vec<u8>) -> Option<http::HeaderValue> {
    let (mut ours, theirs) = tokio::io::duplex(captured.len() + 4096);
    ours.write_all(&captured).await.ok()?;
    let mut conn = h2::server::handshake(theirs).await.ok()?;
    let (req, _respond) = conn.accept().await?.ok()?;
    req.headers().get(http::header::USER_AGENT).cloned()
}

/// Runs the check on its own task and records the verdict in the connection's stats.
pub(super) fn spawn(captured: Vec<u8>, shared: Arc<Shared>) {
    tokio::spawn(async move {
        let Ok(ua) = tokio::time::timeout(Duration::from_secs(1), first_user_agent(captured)).await
        else {
            // Not decoded in time (a busy worker): the verdict stays unknown.
            tracing::debug!("first request not decoded within 1 s");
            return;
        };
        let unrotatable = ua
            .as_ref()
            .is_some_and(|ua| fails_on_go_away(ua.as_bytes()));
        let lazy = ua
            .as_ref()
            .is_some_and(|ua| writes_requests_lazily(ua.as_bytes()));
        tracing::debug!(user_agent = ?ua, unrotatable, lazy, "first request decoded");
        shared
            .stats
            .unrotatable
            .store(unrotatable, Ordering::Relaxed);
        shared.stats.lazy_requests.store(lazy, Ordering::Relaxed);
        shared.stats.user_agent_known.store(true, Ordering::Relaxed);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_js_is_recognised_by_any_product_of_its_user_agent_and_others_are_not() {
        for ua in ["grpc-node-js/1.14.7", "my-app/2.0 grpc-node-js/1.14.7"] {
            assert!(writes_requests_lazily(ua.as_bytes()), "{ua}");
        }
        for ua in [
            "grpc-python/1.76.0 grpc-c/51.0.0 (linux; chttp2)",
            "tonic/0.14.2",
            "grpc-go/1.70.0",
            "",
        ] {
            assert!(!writes_requests_lazily(ua.as_bytes()), "{ua}");
        }
    }
}
