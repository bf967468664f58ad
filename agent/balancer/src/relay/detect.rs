//! Recognising clients that fail calls on any GOAWAY (tonic: h2 refuses every request after
//! one, and tonic does not retry them; see docs/connection-mode.md) from the first request's
//! `user-agent`. The first header block of a connection is decoded against an empty HPACK
//! table, so the relay copies the client's first bytes (preface, SETTINGS, the first HEADERS
//! and its CONTINUATIONs, at most `MAX_CAPTURE`) and hands them to an h2 server over an
//! in-memory pipe: h2 does the HPACK decoding, the relay never does.

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

/// Whether a client with this user-agent fails its calls on a GOAWAY.
pub(super) fn fails_on_go_away(user_agent: &[u8]) -> bool {
    FAILS_ON_GOAWAY
        .iter()
        .any(|p| user_agent.starts_with(p.as_bytes()))
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
        let ua = tokio::time::timeout(Duration::from_secs(1), first_user_agent(captured))
            .await
            .ok()
            .flatten();
        let unrotatable = ua
            .as_ref()
            .is_some_and(|ua| fails_on_go_away(ua.as_bytes()));
        tracing::debug!(user_agent = ?ua, unrotatable, "first request decoded");
        shared
            .stats
            .unrotatable
            .store(unrotatable, Ordering::Relaxed);
        shared.stats.user_agent_known.store(true, Ordering::Relaxed);
    });
}
