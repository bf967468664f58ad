//! Privileged: the status page on the admin port, in a real browser (Debian's headless
//! `chromium`, driven by `BROWSER`), against the real agent serving a Service in each mode
//! (request, connection, observe). What a person sees must be what `/status` says: every
//! figure on the page carries the `/status` pointer of its number, and the test reads
//! `/status` right before and right after the browser reads the page. Run with
//! `cargo xtask test` (as root); `SKEWLESS_SCREENSHOTS=DIR` keeps the screenshots.

mod testbed_agent;

use std::{collections::BTreeSet, time::Duration};

use serde_json::Value;
use skewless_testbed::{Place, Testbed, scripts};
use testbed_agent::{ADMIN, TempPath, ThreeModes, status_json};

/// What the browser saw (see `BROWSER`'s doc).
struct Seen {
    fields: Vec<[String; 4]>,
    requests: Vec<String>,
    responses: Vec<Value>,
    console: Vec<String>,
    log: Vec<String>,
    refreshes: u64,
}

/// Loads the page in headless Chromium inside the node (where the admin API listens).
fn browse(tb: &Testbed, extra: &[&str], screenshot: Option<&std::path::Path>) -> Seen {
    let out = TempPath::new(format!("skewless-test-page-{}.json", tb.id()));
    let url = format!("http://{ADMIN}/ui");
    let out_arg = out.display().to_string();
    let shot = screenshot.map(|p| p.display().to_string());
    let mut argv = vec!["python3", scripts::BROWSER, &url, &out_arg];
    argv.extend_from_slice(extra);
    if let Some(shot) = &shot {
        argv.extend(["--screenshot", shot]);
    }
    tb.run(Place::Node(0), &argv)
        .unwrap_or_else(|e| panic!("chromium loads the page (`cargo xtask setup`): {e}"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&*out).unwrap()).unwrap();
    let strings = |k: &str| -> Vec<String> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect()
    };
    Seen {
        fields: v["fields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| std::array::from_fn(|i| f[i].as_str().unwrap_or_default().to_owned()))
            .collect(),
        requests: strings("requests"),
        responses: v["responses"].as_array().unwrap().clone(),
        console: strings("console"),
        log: strings("log"),
        refreshes: v["refreshes"].as_u64().unwrap_or(0),
    }
}

/// The number a figure's text shows, in the unit of its `data-value` (ms to s, % to a
/// ratio, MiB to bytes), and how far rounding may have moved it.
fn shown(text: &str, unit: &str) -> (f64, f64) {
    let digits: String = text
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == '-')
        .collect();
    let n: f64 = digits
        .parse()
        .unwrap_or_else(|_| panic!("a number in {text:?}"));
    let decimals = digits.split_once('.').map_or(0, |(_, d)| d.len());
    let half = 0.5 * 10f64.powi(-(decimals as i32)) + 1e-9;
    let scale = match unit {
        "ms" => 1e-3,
        "%" => 1e-2,
        "MiB" => 1024.0 * 1024.0,
        _ => 1.0,
    };
    (n * scale, half * scale)
}

/// The agent's own cost (its process's and workers' figures) moves with every request,
/// the page's own included (its connection is an open file, serving it takes CPU time): those
/// are checked to be near the two readings, not equal.
fn own_cost(field: &str) -> bool {
    field.starts_with("/agent/process/") || field.starts_with("/agent/workers/")
}

/// Rates over the recent window move with the clock even when nothing happens (the same
/// calls over a longer window).
fn rate(field: &str) -> bool {
    field.ends_with("per_sec") || field.ends_with("/recent/seconds")
}

/// Checks every figure the browser saw against `/status` read before (`before`) and after
/// (`after`) it: each is a figure `/status` has, its text shows its value rounded, and with
/// `exact` a figure that did not change in between must equal it exactly, one that did must
/// be one of the two readings or between them ([`own_cost`] figures: within 10% and 2 of
/// them). Returns the figures that were not compared exactly, and the [`rate`]s outside their
/// two readings: a window rotation between the readings can step a rate either way.
fn check_figures(
    seen: &Seen,
    before: &Value,
    after: &Value,
    exact: bool,
) -> (Vec<String>, Vec<String>) {
    let mut moved = Vec::new();
    let mut outside = Vec::new();
    for [field, value, unit, text] in &seen.fields {
        let (b, a) = (
            before.pointer(field).unwrap_or(&Value::Null),
            after.pointer(field).unwrap_or(&Value::Null),
        );
        // A figure that appears or goes between the readings (a backend's first recent call)
        // is checked against the reading that has it.
        let (b, a) = match (b.is_null(), a.is_null()) {
            (true, true) => {
                panic!("the page shows {field} = {value:?}, which /status does not have")
            }
            (true, false) => (a, a),
            (false, true) => (b, b),
            (false, false) => (b, a),
        };
        if !exact || a != b || own_cost(field) || before.pointer(field) != after.pointer(field) {
            moved.push(field.clone());
        }
        match b {
            Value::String(s) => {
                if a == b {
                    assert_eq!(value, s, "{field}");
                } else {
                    assert!(
                        Some(value.as_str()) == a.as_str() || value == s,
                        "{field}: {value:?} is neither {b} nor {a}"
                    );
                }
                assert_eq!(text, value, "{field}: the text is the value");
            }
            Value::Bool(x) => {
                if a == b {
                    assert_eq!(value, &x.to_string(), "{field}");
                }
            }
            Value::Number(_) => {
                let v: f64 = value.parse().unwrap_or_else(|_| panic!("{field}: {value}"));
                let (lo, hi) = (b.as_f64().unwrap(), a.as_f64().unwrap());
                if !exact {
                    // Live: the window's figures move with the traffic between the readings.
                } else if own_cost(field) {
                    let (lo, hi) = (lo.min(hi), lo.max(hi));
                    assert!(
                        v >= lo * 0.9 - 2.0 && v <= hi * 1.1 + 2.0,
                        "{field}: {v} is far from /status's {lo} .. {hi}"
                    );
                } else if a == b {
                    // serde_json's default float parser may land one ulp off the value the
                    // agent printed; anything more is a different number.
                    assert!(
                        (v - lo).abs() <= 1e-12 * lo.abs().max(1.0),
                        "{field}: the page and /status differ: {v} against {lo}"
                    );
                } else {
                    let ulp = 1e-12 * lo.abs().max(hi.abs()).max(1.0);
                    let between = lo.min(hi) - ulp <= v && v <= lo.max(hi) + ulp;
                    if rate(field) && !between {
                        outside.push(format!("{field}: {v} outside {lo} .. {hi}"));
                    } else {
                        assert!(between, "{field}: {v} is outside /status's {lo} .. {hi}");
                    }
                }
                let (n, slack) = shown(text, unit);
                assert!(
                    (n - v).abs() <= slack,
                    "{field}: the text {text:?} does not show {v} ({unit})"
                );
            }
            other => panic!("{field}: /status has {other}, the page {value:?}"),
        }
    }
    (moved, outside)
}

/// The figures a person needs, which must be on the page when `/status` has them.
fn required(status: &Value) -> Vec<String> {
    let mut need = vec![
        "/node".to_owned(),
        "/connect_seen".to_owned(),
        "/connect_redirected".to_owned(),
        "/agent/version".to_owned(),
        "/agent/model_ready".to_owned(),
        "/agent/stale_heartbeat".to_owned(),
        "/agent/process/cpu_seconds".to_owned(),
        "/agent/process/resident_memory_bytes".to_owned(),
        "/agent/workers/0/busy_seconds".to_owned(),
        "/agent/workers/0/stalls".to_owned(),
    ];
    for (i, s) in status["services"].as_array().unwrap().iter().enumerate() {
        let p = format!("/services/{i}");
        for k in [
            "service",
            "mode",
            "balancer_skew",
            "recent/calls_per_sec",
            "recent/success",
            "recent/p50",
            "recent/p99",
            "connection/state",
            "connection/unrotatable_connections",
        ] {
            let q = format!("{p}/{k}");
            if status.pointer(&q).is_some_and(|v| !v.is_null()) {
                need.push(q);
            }
        }
        for j in 0..s["endpoints"].as_array().unwrap().len() {
            for k in ["name", "state", "requests", "recent_share", "recent_p99"] {
                let q = format!("{p}/endpoints/{j}/{k}");
                if status.pointer(&q).is_some_and(|v| !v.is_null()) {
                    need.push(q);
                }
            }
        }
    }
    for (i, o) in status["observed"].as_array().unwrap().iter().enumerate() {
        let p = format!("/observed/{i}");
        need.extend(["service", "skew", "backends_receiving"].map(|k| format!("{p}/{k}")));
        for j in 0..o["backends"].as_array().unwrap().len() {
            need.push(format!("{p}/backends/{j}/share"));
        }
    }
    need
}

fn assert_clean(seen: &Seen, what: &str) {
    assert!(
        seen.console.is_empty(),
        "{what}: console errors {:?}",
        seen.console
    );
    assert!(seen.log.is_empty(), "{what}: browser log {:?}", seen.log);
    let origin = format!("http://{ADMIN}/");
    let external: Vec<&String> = seen
        .requests
        .iter()
        .filter(|u| !u.starts_with(&origin))
        .collect();
    assert!(
        external.is_empty(),
        "{what}: requests outside the admin port: {external:?}"
    );
    let page = seen
        .responses
        .iter()
        .find(|r| r["url"] == format!("http://{ADMIN}/ui"))
        .unwrap_or_else(|| panic!("{what}: the page's response: {:?}", seen.responses));
    assert_eq!(page["status"], 200, "{what}");
    assert_eq!(
        page["headers"]["content-security-policy"],
        skewless_admin::page::CONTENT_SECURITY_POLICY,
        "{what}: the page's policy"
    );
    for r in &seen.responses {
        assert_eq!(r["status"], 200, "{what}: {r}");
    }
}

#[test]
#[ignore = "privileged: needs root and the real kernel; run with `cargo xtask test`"]
fn the_status_page_in_headless_chromium_shows_what_status_says_in_all_three_modes() {
    let mut three = ThreeModes::start();
    let clients = three.spawn_clients();
    let tb = &mut three.tb;

    // Until the recent window has calls for both balanced Services (the window's first
    // reading is taken 30 s after the start) and the observed one is pinned.
    let start = std::time::Instant::now();
    loop {
        let s = status_json(tb);
        let calls = |svc: &str| {
            s["services"].as_array().is_some_and(|a| {
                a.iter().any(|x| {
                    x["service"] == svc && x["recent"]["calls_per_sec"].as_f64() > Some(0.0)
                })
            })
        };
        let pinned = s["observed"].as_array().is_some_and(|a| {
            a.iter()
                .any(|o| o["service"] == "default/obs" && o["backends_receiving"] == 1)
        });
        if calls("default/echo") && calls("default/conn") && pinned {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "the three Services have recent figures within 90 s: {s}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }

    let keep = std::env::var_os("SKEWLESS_SCREENSHOTS").map(std::path::PathBuf::from);
    let shot = |name: &str| {
        keep.as_ref()
            .map(|d| d.join(name))
            .unwrap_or_else(|| std::env::temp_dir().join(format!("skewless-test-{name}")))
    };

    // Live, with JavaScript: the page refreshes itself from the agent; the figures after a
    // refresh are those of a /status read between the two readings.
    let before = status_json(tb);
    let live_png = shot("status-page.png");
    let live = browse(tb, &["--wait-refresh"], Some(&live_png));
    let after = status_json(tb);
    assert!(live.refreshes >= 1, "the script refreshed the figures");
    assert_clean(&live, "with JavaScript");
    assert!(
        live.requests.iter().any(|u| u.ends_with("/ui/fragment")),
        "the refresh fetched the figures: {:?}",
        live.requests
    );
    check_figures(&live, &before, &after, false);
    let present: BTreeSet<&str> = live.fields.iter().map(|f| f[0].as_str()).collect();
    for need in required(&before) {
        assert!(present.contains(need.as_str()), "the page shows {need}");
    }
    assert!(
        std::fs::metadata(&live_png).is_ok_and(|m| m.len() > 10_000),
        "a screenshot"
    );

    // Frozen traffic, without JavaScript: every figure equals /status exactly.
    for &pid in &clients {
        assert!(tb.signal(pid, "STOP"), "client {pid} stops");
    }
    // Every backend's request and in-flight counts (the window's rates move on with the clock).
    let counts = |s: &Value| -> Vec<(Value, Value)> {
        s["services"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|x| x["endpoints"].as_array().unwrap().iter())
            .map(|e| (e["requests"].clone(), e["in_flight"].clone()))
            .collect()
    };
    let mut quiet = counts(&status_json(tb));
    let start = std::time::Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = counts(&status_json(tb));
        if now == quiet {
            break;
        }
        quiet = now;
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the counters stop"
        );
    }
    let (mut moved, mut outside, mut compared) = (Vec::new(), Vec::new(), 0);
    for _ in 0..5 {
        let before = status_json(tb);
        let still = browse(tb, &["--no-js"], Some(&shot("status-page-no-js.png")));
        let after = status_json(tb);
        assert_eq!(still.refreshes, 0, "no script ran");
        assert_clean(&still, "without JavaScript");
        (moved, outside) = check_figures(&still, &before, &after, true);
        compared = still.fields.len();
        let present: BTreeSet<&str> = still.fields.iter().map(|f| f[0].as_str()).collect();
        for need in required(&before) {
            assert!(
                present.contains(need.as_str()),
                "without JavaScript the page shows {need}"
            );
        }
        // The agent's own cost and the window's rates move between any two readings; every
        // other figure must be exact, and a rate between its readings (a window rotation in
        // between: once more).
        if moved.iter().all(|f| own_cost(f) || rate(f)) && outside.is_empty() {
            break;
        }
    }
    for &pid in &clients {
        tb.signal(pid, "CONT");
    }
    assert!(
        outside.is_empty(),
        "with traffic stopped a window's rate lies between the two readings of /status around \
         the page's (in one of five tries): {outside:?}"
    );
    let unexpected: Vec<&String> = moved.iter().filter(|f| !own_cost(f) && !rate(f)).collect();
    assert!(
        unexpected.is_empty(),
        "with traffic stopped every figure but the agent's own cost and the window's rates \
         equals /status exactly: {unexpected:?}"
    );
    eprintln!(
        "status page: {} figures live; frozen: {compared} figures, {} exact, moving: {moved:?}",
        live.fields.len(),
        compared - moved.len()
    );

    // Bound as /status is: the admin port answers inside the node, and from a pod's network
    // namespace none of the node's addresses reaches it.
    let admin_port = ADMIN.rsplit_once(':').unwrap().1;
    tb.run(
        Place::Node(0),
        &["python3", scripts::TCP_CHECK, "127.0.0.1", admin_port],
    )
    .expect("the admin port answers inside the node");
    let addrs = tb
        .run(Place::Node(0), &["ip", "-4", "-o", "addr", "show"])
        .unwrap();
    let addrs: Vec<String> = String::from_utf8_lossy(&addrs.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .filter_map(|a| a.split('/').next())
        .filter(|a| !a.starts_with("127."))
        .map(str::to_owned)
        .collect();
    assert!(!addrs.is_empty(), "the node has addresses");
    for addr in &addrs {
        let reached = tb
            .run(
                Place::Pod("client"),
                &["python3", scripts::TCP_CHECK, addr, admin_port],
            )
            .is_ok();
        assert!(
            !reached,
            "the status page must not be reachable from a pod at {addr}:{admin_port}"
        );
    }
}
