//! The `skewless status` text, from the `/status` document.

use std::fmt::Write as _;

use crate::json::Status;

/// The human-readable form of `/status`.
#[must_use]
pub fn status_text(s: &Status) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_status(&mut out, s);
    out
}

fn write_status(out: &mut String, s: &Status) -> std::fmt::Result {
    writeln!(
        out,
        "node {}: {} connect()s seen, {} redirected",
        s.node, s.connect_seen, s.connect_redirected
    )?;
    writeln!(out, "{:<24} {:<24}", "REDIRECT", "TO")?;
    for r in &s.redirects {
        writeln!(out, "{:<24} {:<24}", r.service, r.target)?;
    }
    for o in &s.observed {
        let unresolved = if o.unresolved > 0 {
            format!(", {} unresolved", o.unresolved)
        } else {
            String::new()
        };
        writeln!(
            out,
            "\nservice {} ({}) {}: {} ready, {} receiving traffic from this node's pods, largest share {:.2}, skew {:.2}{unresolved}",
            o.service,
            o.mode,
            o.vip,
            o.ready_backends,
            o.backends_receiving,
            o.largest_share,
            o.skew,
        )?;
        writeln!(
            out,
            "  {:<22} {:>6} {:>7} {:>12} {:>12}",
            "BACKEND", "CONNS", "SHARE", "SENT B/s", "RECV B/s"
        )?;
        for b in &o.backends {
            writeln!(
                out,
                "  {:<22} {:>6} {:>7.3} {:>12.0} {:>12.0}",
                b.backend, b.open_connections, b.share, b.sent_per_sec, b.received_per_sec
            )?;
        }
    }
    for svc in &s.services {
        let receiving = svc.endpoints.iter().filter(|e| e.requests > 0).count();
        let largest = svc.endpoints.iter().map(|e| e.share).fold(0.0, f64::max);
        writeln!(
            out,
            "\nservice {} ({}) {} -> {}: {} ready, {} receiving traffic, largest share {:.2}",
            svc.service, svc.mode, svc.vip, svc.listener, svc.ready_endpoints, receiving, largest
        )?;
        writeln!(
            out,
            "  {:<12} {:<22} {:<10} {:>9} {:>8} {:>7} {:>10}",
            "BACKEND", "ADDRESS", "STATE", "REQUESTS", "FAILED", "SHARE", "EWMA ms"
        )?;
        for e in &svc.endpoints {
            let latency = e
                .latency_ms
                .map_or_else(|| "-".to_owned(), |l| format!("{l:.1}"));
            writeln!(
                out,
                "  {:<12} {:<22} {:<10} {:>9} {:>8} {:>7.3} {:>10}",
                e.name, e.addr, e.state, e.requests, e.failures, e.share, latency
            )?;
        }
    }
    Ok(())
}
