//! The status page on the admin port (`/ui`): the `/status` document drawn as HTML.
//!
//! Guarantees:
//! - One source: the page is rendered from the same [`Status`] value `/status` serves, and
//!   every figure on it carries the JSON pointer of the number it shows (`data-field`) and
//!   that number unrounded (`data-value`), so a reader (and the browser test) can check it
//!   against `/status` figure by figure.
//! - Readable without JavaScript: the server renders everything; the script only fetches the
//!   same HTML again ([`fragment`]) every two seconds and swaps it in.
//! - No external assets and no inline code or style: the stylesheet, script and icon are
//!   served from the binary beside the page, so [`CONTENT_SECURITY_POLICY`] can forbid
//!   everything else. Bars are SVG shapes (attributes, not inline styles).
//! - Every string from the model (Service and backend names) is escaped.

use std::fmt::Write as _;

use crate::{
    collector::state_label,
    json::{ObservedService, ServiceStatus, Status},
};

/// The stylesheet, served at `/ui/style.css`.
pub const STYLE: &str = include_str!("page/style.css");
/// The live-refresh script, served at `/ui/app.js`.
pub const SCRIPT: &str = include_str!("page/app.js");
/// The page's icon, served at `/ui/icon.svg` (browsers ask for one).
pub const ICON: &str = include_str!("page/icon.svg");

/// The page's policy: its own origin's stylesheet, script, icon and fetches, nothing else
/// (no inline script or style, no frames, no forms, no plugins).
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// How often the script refreshes the figures, in milliseconds (the page says so).
pub const REFRESH_MS: u32 = 2000;

/// The whole page for `status`.
#[must_use]
pub fn page(status: &Status) -> String {
    let mut out = String::with_capacity(16 * 1024);
    let node = esc(&status.node);
    let _ = write!(
        out,
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>skewless on {node}</title>\n\
         <link rel=\"stylesheet\" href=\"/ui/style.css\">\n\
         <link rel=\"icon\" href=\"/ui/icon.svg\" type=\"image/svg+xml\">\n\
         <script src=\"/ui/app.js\" defer></script>\n\
         <noscript><meta http-equiv=\"refresh\" content=\"10\"></noscript>\n\
         </head>\n<body data-refresh-ms=\"{REFRESH_MS}\">\n<header>\n\
         <h1>skewless on <span {}>{node}</span></h1>\n\
         <p id=\"refresh\">a snapshot: reload to update (with JavaScript it refreshes itself \
         every {} s)</p>\n</header>\n<main id=\"status\">\n",
        attrs("/node", &status.node, ""),
        REFRESH_MS / 1000,
    );
    out.push_str(&fragment(status));
    out.push_str("</main>\n</body>\n</html>\n");
    out
}

/// What `<main>` holds: the part the script swaps in at each refresh (`/ui/fragment`).
#[must_use]
pub fn fragment(status: &Status) -> String {
    let mut out = String::with_capacity(16 * 1024);
    agent(&mut out, status);
    if status.services.is_empty() && status.observed.is_empty() {
        out.push_str("<p class=\"empty\">No opted-in Service on this node.</p>\n");
    }
    for (i, s) in status.services.iter().enumerate() {
        service(&mut out, i, s);
    }
    for (i, o) in status.observed.iter().enumerate() {
        observed(&mut out, i, o);
    }
    out
}

/// How a figure is shown.
#[derive(Clone, Copy)]
enum Unit {
    /// Seconds shown as milliseconds, one decimal.
    Ms,
    /// A ratio shown as a percentage, one decimal.
    Pct,
    /// Per second, one decimal.
    PerSec,
    /// A skew (largest share / fair share), two decimals.
    Skew,
    /// Seconds, two decimals.
    Secs,
    /// Bytes shown in MiB, one decimal.
    Mib,
}

impl Unit {
    fn name(self) -> &'static str {
        match self {
            Self::Ms => "ms",
            Self::Pct => "%",
            Self::PerSec => "/s",
            Self::Skew => "x",
            Self::Secs => "s",
            Self::Mib => "MiB",
        }
    }

    fn show(self, v: f64) -> String {
        match self {
            Self::Ms => format!("{:.1} ms", v * 1e3),
            Self::Pct => format!("{:.1}%", v * 100.0),
            Self::PerSec => format!("{v:.1}/s"),
            Self::Skew => format!("{v:.2}x"),
            Self::Secs => format!("{v:.2} s"),
            Self::Mib => format!("{:.1} MiB", v / (1024.0 * 1024.0)),
        }
    }
}

/// The `data-` attributes of a figure: its pointer into `/status`, its value, its unit.
fn attrs(field: &str, value: &str, unit: &str) -> String {
    format!(
        "data-field=\"{}\" data-value=\"{}\" data-unit=\"{unit}\"",
        esc(field),
        esc(value)
    )
}

/// A number from `/status` at `field`, shown in `unit` (`-` when absent).
fn num(field: &str, value: Option<f64>, unit: Unit) -> String {
    match value {
        Some(v) => format!(
            "<span class=\"n\" {}>{}</span>",
            attrs(field, &v.to_string(), unit.name()),
            unit.show(v)
        ),
        None => "<span class=\"n none\">-</span>".to_owned(),
    }
}

/// A count from `/status` at `field`.
fn count(field: &str, value: u64) -> String {
    format!(
        "<span class=\"n\" {}>{value}</span>",
        attrs(field, &value.to_string(), "")
    )
}

/// A string from `/status` at `field`, with a CSS class.
fn word(field: &str, value: &str, class: &str) -> String {
    format!(
        "<span class=\"{class}\" {}>{}</span>",
        attrs(field, value, ""),
        esc(value)
    )
}

/// A horizontal bar of `share` (0..=1) with the fair share marked.
fn bar(share: Option<f64>, fair: Option<f64>) -> String {
    let w = share.unwrap_or(0.0).clamp(0.0, 1.0) * 100.0;
    let mut svg = format!(
        "<svg class=\"bar\" viewBox=\"0 0 100 10\" preserveAspectRatio=\"none\" role=\"img\">\
         <rect class=\"track\" width=\"100\" height=\"10\"/>\
         <rect class=\"fill\" width=\"{w:.2}\" height=\"10\"/>"
    );
    if let Some(f) = fair {
        let x = f.clamp(0.0, 1.0) * 100.0;
        let _ = write!(
            svg,
            "<line class=\"fair\" x1=\"{x:.2}\" x2=\"{x:.2}\" y1=\"0\" y2=\"10\"/>"
        );
    }
    svg.push_str("</svg>");
    svg
}

fn agent(out: &mut String, s: &Status) {
    let a = &s.agent;
    out.push_str("<section class=\"agent\">\n<h2>Agent</h2>\n<div class=\"tiles\">\n");
    let tile = |out: &mut String, label: &str, value: String, class: &str| {
        let _ = writeln!(
            out,
            "<div class=\"tile {class}\"><div class=\"label\">{label}</div><div class=\"value\">{value}</div></div>"
        );
    };
    tile(out, "version", word("/agent/version", &a.version, "w"), "");
    tile(
        out,
        "model",
        if a.model_ready {
            "<span class=\"ok\" data-field=\"/agent/model_ready\" data-value=\"true\" data-unit=\"\">ready</span>".to_owned()
        } else {
            "<span class=\"bad\" data-field=\"/agent/model_ready\" data-value=\"false\" data-unit=\"\">waiting: nothing redirected</span>".to_owned()
        },
        "",
    );
    tile(
        out,
        "fail-open connects",
        count("/agent/stale_heartbeat", a.stale_heartbeat),
        if a.stale_heartbeat > 0 { "warn" } else { "" },
    );
    tile(
        out,
        "connects seen",
        count("/connect_seen", s.connect_seen),
        "",
    );
    tile(
        out,
        "connects redirected",
        count("/connect_redirected", s.connect_redirected),
        "",
    );
    tile(
        out,
        "refused peers",
        count("/refused_peers", s.refused_peers),
        if s.refused_peers > 0 { "warn" } else { "" },
    );
    if let Some(p) = &a.process {
        tile(
            out,
            "CPU time",
            num(
                "/agent/process/cpu_seconds",
                Some(p.cpu_seconds),
                Unit::Secs,
            ),
            "",
        );
        tile(
            out,
            "resident memory",
            num(
                "/agent/process/resident_memory_bytes",
                Some(p.resident_memory_bytes as f64),
                Unit::Mib,
            ),
            "",
        );
        tile(
            out,
            "threads",
            count("/agent/process/threads", p.threads),
            "",
        );
        tile(
            out,
            "open files",
            format!(
                "{} of {}",
                count("/agent/process/open_fds", p.open_fds),
                count("/agent/process/max_fds", p.max_fds)
            ),
            "",
        );
    }
    out.push_str("</div>\n");
    if !a.workers.is_empty() {
        out.push_str(
            "<table class=\"workers\"><caption>Data-plane workers</caption>\n<thead><tr>\
             <th>worker</th><th>on a CPU</th><th>waiting for a CPU</th><th>stalls</th></tr></thead>\n<tbody>\n",
        );
        for (i, w) in a.workers.iter().enumerate() {
            let base = format!("/agent/workers/{i}");
            let _ = writeln!(
                out,
                "<tr{}><td>{i}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                if w.stalls > 0 { " class=\"warn\"" } else { "" },
                num(
                    &format!("{base}/busy_seconds"),
                    Some(w.busy_seconds),
                    Unit::Secs
                ),
                num(
                    &format!("{base}/cpu_wait_seconds"),
                    Some(w.cpu_wait_seconds),
                    Unit::Secs
                ),
                count(&format!("{base}/stalls"), w.stalls),
            );
        }
        out.push_str("</tbody></table>\n");
    }
    if !a.maps.is_empty() {
        out.push_str(
            "<table class=\"maps\"><caption>eBPF maps</caption>\n<thead><tr>\
             <th>map</th><th>entries</th><th>capacity</th><th>full</th></tr></thead>\n<tbody>\n",
        );
        for (i, m) in a.maps.iter().enumerate() {
            let base = format!("/agent/maps/{i}");
            let fill = (m.capacity > 0).then(|| m.entries as f64 / m.capacity as f64);
            let _ = writeln!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                word(&format!("{base}/map"), &m.map, "w"),
                count(&format!("{base}/entries"), m.entries),
                count(&format!("{base}/capacity"), m.capacity),
                bar(fill, None),
            );
        }
        out.push_str("</tbody></table>\n");
    }
    out.push_str("</section>\n");
}

/// Where a backend state sorts: serving ones first, then the ones that take no calls.
fn state_rank(state: &str) -> u8 {
    match state_label(state) {
        "active" => 0,
        "degraded" => 1,
        "connecting" => 2,
        "not_serving" => 3,
        "ejected" => 4,
        _ => 5,
    }
}

fn service(out: &mut String, i: usize, s: &ServiceStatus) {
    let base = format!("/services/{i}");
    let fair = (s.ready_endpoints > 0).then(|| 1.0 / s.ready_endpoints as f64);
    let _ = write!(
        out,
        "<section class=\"svc\">\n<h2>{} {} <span class=\"vip\">{} &#8594; {}</span></h2>\n",
        word(&format!("{base}/service"), &s.service, "name"),
        word(&format!("{base}/mode"), &s.mode, "mode"),
        word(&format!("{base}/vip"), &s.vip, "w"),
        word(&format!("{base}/listener"), &s.listener, "w"),
    );
    let recent = s.recent;
    let _ = write!(
        out,
        "<dl class=\"summary\">\
         <div><dt>skew</dt><dd>{}</dd></div>\
         <div><dt>calls</dt><dd>{}</dd></div>\
         <div><dt>success</dt><dd>{}</dd></div>\
         <div><dt>p50</dt><dd>{}</dd></div>\
         <div><dt>p99</dt><dd>{}</dd></div>\
         <div><dt>ready backends</dt><dd>{}</dd></div>\
         <div><dt>client connections</dt><dd>{}</dd></div>",
        num(
            &format!("{base}/balancer_skew"),
            s.balancer_skew,
            Unit::Skew
        ),
        num(
            &format!("{base}/recent/calls_per_sec"),
            recent.map(|r| r.calls_per_sec),
            Unit::PerSec
        ),
        num(
            &format!("{base}/recent/success"),
            recent.and_then(|r| r.success),
            Unit::Pct
        ),
        num(
            &format!("{base}/recent/p50"),
            recent.and_then(|r| r.p50),
            Unit::Ms
        ),
        num(
            &format!("{base}/recent/p99"),
            recent.and_then(|r| r.p99),
            Unit::Ms
        ),
        count(&format!("{base}/ready_endpoints"), s.ready_endpoints as u64),
        count(&format!("{base}/client_connections"), s.client_connections),
    );
    if let Some(c) = &s.connection {
        let _ = write!(
            out,
            "<div><dt>rotation</dt><dd>{}</dd></div>\
             <div><dt>rotations, last minute</dt><dd>{}</dd></div>\
             <div><dt>unrotatable</dt><dd>{}</dd></div>",
            word(
                &format!("{base}/connection/state"),
                &c.state,
                &format!(
                    "rot rot-{}",
                    crate::collector::rotation_state_label(&c.state)
                )
            ),
            count(
                &format!("{base}/connection/rotations_last_minute"),
                c.rotations_last_minute as u64
            ),
            count(
                &format!("{base}/connection/unrotatable_connections"),
                c.unrotatable_connections as u64
            ),
        );
    }
    out.push_str("</dl>\n");
    if recent.is_some() {
        let _ = writeln!(
            out,
            "<p class=\"note\">Rates, shares and percentiles: the last {} s.</p>",
            recent.map_or(0.0, |r| r.seconds).round()
        );
    }
    if !s.rotations.is_empty() {
        out.push_str("<p class=\"rotations\">GOAWAYs sent, by reason: ");
        for (j, rot) in s.rotations.iter().enumerate() {
            let _ = write!(
                out,
                "<span class=\"reason\">{} {}</span> ",
                word(&format!("{base}/rotations/{j}/reason"), &rot.reason, "w"),
                count(&format!("{base}/rotations/{j}/count"), rot.count)
            );
        }
        out.push_str("</p>\n");
    }
    out.push_str(
        "<table class=\"backends\">\n<thead><tr><th>backend</th><th>address</th><th>state</th>\
         <th class=\"barcol\">share against the fair share</th><th>share</th><th>calls</th>\
         <th>p99</th><th>in flight</th><th>connections</th><th>requests</th><th>failures</th>\
         </tr></thead>\n<tbody>\n",
    );
    let mut order: Vec<usize> = (0..s.endpoints.len()).collect();
    order.sort_by_key(|&j| (state_rank(&s.endpoints[j].state), j));
    for j in order {
        let e = &s.endpoints[j];
        let row = format!("{base}/endpoints/{j}");
        let _ = writeln!(
            out,
            "<tr class=\"st-{}\"><td>{}</td><td>{}</td><td>{}</td><td class=\"barcol\">{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            state_label(&e.state),
            word(&format!("{row}/name"), &e.name, "w"),
            word(&format!("{row}/addr"), &e.addr, "w"),
            word(
                &format!("{row}/state"),
                &e.state,
                &format!("state st-{}", state_label(&e.state))
            ),
            bar(e.recent_share, fair),
            num(&format!("{row}/recent_share"), e.recent_share, Unit::Pct),
            num(
                &format!("{row}/recent_per_sec"),
                e.recent_per_sec,
                Unit::PerSec
            ),
            num(&format!("{row}/recent_p99"), e.recent_p99, Unit::Ms),
            count(&format!("{row}/in_flight"), e.in_flight),
            count(
                &format!("{row}/upstream_connections"),
                e.upstream_connections
            ),
            count(&format!("{row}/requests"), e.requests),
            count(&format!("{row}/failures"), e.failures),
        );
    }
    out.push_str("</tbody></table>\n</section>\n");
}

fn observed(out: &mut String, i: usize, o: &ObservedService) {
    let base = format!("/observed/{i}");
    let fair = (o.ready_backends > 0).then(|| 1.0 / o.ready_backends as f64);
    let _ = write!(
        out,
        "<section class=\"svc observed\">\n<h2>{} {} <span class=\"vip\">{}</span></h2>\n\
         <dl class=\"summary\">\
         <div><dt>skew</dt><dd>{}</dd></div>\
         <div><dt>backends receiving</dt><dd>{} of {}</dd></div>\
         <div><dt>largest share</dt><dd>{}</dd></div></dl>\n\
         <p class=\"note\">Not balanced: where this node's pod connections are pinned.</p>\n",
        word(&format!("{base}/service"), &o.service, "name"),
        word(&format!("{base}/mode"), &o.mode, "mode"),
        word(&format!("{base}/vip"), &o.vip, "w"),
        num(&format!("{base}/skew"), Some(o.skew), Unit::Skew),
        count(
            &format!("{base}/backends_receiving"),
            o.backends_receiving as u64
        ),
        count(&format!("{base}/ready_backends"), o.ready_backends as u64),
        num(
            &format!("{base}/largest_share"),
            Some(o.largest_share),
            Unit::Pct
        ),
    );
    out.push_str(
        "<table class=\"backends\">\n<thead><tr><th>backend</th>\
         <th class=\"barcol\">share against the fair share</th><th>share</th>\
         <th>open connections</th></tr></thead>\n<tbody>\n",
    );
    for (j, b) in o.backends.iter().enumerate() {
        let row = format!("{base}/backends/{j}");
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td class=\"barcol\">{}</td><td>{}</td><td>{}</td></tr>",
            word(&format!("{row}/backend"), &b.backend, "w"),
            bar(Some(b.share), fair),
            num(&format!("{row}/share"), Some(b.share), Unit::Pct),
            count(
                &format!("{row}/open_connections"),
                b.open_connections as u64
            ),
        );
    }
    out.push_str("</tbody></table>\n</section>\n");
}

/// HTML-escapes text and attribute values.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::{EndpointStatus, RecentCalls};

    fn status() -> Status {
        Status {
            node: "node-<1>".into(),
            redirects: Vec::new(),
            connect_seen: 12,
            connect_redirected: 7,
            refused_peers: 0,
            unserved: Vec::new(),
            services: vec![ServiceStatus {
                service: "default/echo".into(),
                mode: "request".into(),
                vip: "10.0.0.1:80".into(),
                listener: "169.254.77.1:4000".into(),
                ready_endpoints: 2,
                balancer_skew: Some(1.25),
                recent: Some(RecentCalls {
                    seconds: 40.0,
                    calls_per_sec: 12.5,
                    success: Some(0.99),
                    p50: Some(0.0012),
                    p99: None,
                }),
                endpoints: vec![
                    EndpointStatus {
                        name: "echo-\"x\"".into(),
                        state: "Ejected".into(),
                        requests: 3,
                        ..EndpointStatus::default()
                    },
                    EndpointStatus {
                        name: "echo-1".into(),
                        state: "Active".into(),
                        requests: 500,
                        recent_share: Some(0.625),
                        ..EndpointStatus::default()
                    },
                ],
                ..ServiceStatus::default()
            }],
            observed: Vec::new(),
            agent: crate::json::AgentStatus::default(),
        }
    }

    #[test]
    fn every_figure_carries_its_status_pointer_and_exact_value() {
        let html = page(&status());
        for figure in [
            r#"data-field="/services/0/balancer_skew" data-value="1.25" data-unit="x">1.25x<"#,
            r#"data-field="/services/0/recent/calls_per_sec" data-value="12.5" data-unit="/s">12.5/s<"#,
            r#"data-field="/services/0/recent/p50" data-value="0.0012" data-unit="ms">1.2 ms<"#,
            r#"data-field="/services/0/recent/success" data-value="0.99" data-unit="%">99.0%<"#,
            r#"data-field="/services/0/endpoints/1/recent_share" data-value="0.625" data-unit="%">62.5%<"#,
            r#"data-field="/services/0/endpoints/1/requests" data-value="500" data-unit="">500<"#,
            r#"data-field="/connect_seen" data-value="12" data-unit="">12<"#,
        ] {
            assert!(html.contains(figure), "{figure} in {html}");
        }
        assert!(
            !html.contains("/services/0/recent/p99\""),
            "an absent figure has no pointer: {html}"
        );
    }

    #[test]
    fn names_are_escaped_and_serving_backends_come_first() {
        let html = page(&status());
        assert!(
            html.contains("skewless on <span data-field=\"/node\" data-value=\"node-&lt;1&gt;\"")
        );
        assert!(html.contains("echo-&quot;x&quot;"), "{html}");
        assert!(!html.contains("echo-\"x\""), "{html}");
        let active = html.find("/services/0/endpoints/1/name").unwrap();
        let ejected = html.find("/services/0/endpoints/0/name").unwrap();
        assert!(active < ejected, "the active backend's row first");
    }

    #[test]
    fn nothing_inline_that_the_policy_forbids() {
        let html = page(&status());
        assert!(!html.contains("style="), "no inline styles");
        assert!(!html.contains("<style"), "no style element");
        assert!(!html.contains("<script>"), "no inline script");
        let handler = html.match_indices(" on").any(|(i, _)| {
            let rest = &html[i + 3..];
            let word = rest.find(|c: char| !c.is_ascii_lowercase()).unwrap_or(0);
            word > 0 && rest[word..].starts_with('=')
        });
        assert!(!handler, "no event handler attributes");
        for url in ["http://", "https://", "//"] {
            assert!(
                !html.contains(&format!("=\"{url}")),
                "no external {url} reference"
            );
        }
        assert!(!STYLE.contains("url("), "the stylesheet loads nothing");
        assert!(
            !SCRIPT.contains("http:") && !SCRIPT.contains("https:"),
            "the script fetches its own origin only"
        );
    }
}
