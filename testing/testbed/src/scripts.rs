//! The small socket peers run inside pods: real programs in `testing/py/`, sharing
//! `testing/py/peerlib.py` (the listener, address formatting, exact reads). Python is used
//! because it is on every machine and starts in milliseconds; each script is a real socket
//! peer, not a mock.
//!
//! Each constant is the script's absolute path in this checkout; run it as
//! `["python3", scripts::PROBE, args...]` in a [`crate::Place`]. The docs of each script's
//! arguments and output are at the top of its file.

macro_rules! script {
    ($file:literal) => {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../py/", $file)
    };
}

/// `IDENT_SERVER NAME HOST PORT [PORT...]`: sends `NAME\n` on every connection and closes.
pub const IDENT_SERVER: &str = script!("ident_server.py");
/// `PROBE HOST PORT COUNT`: COUNT connects, one line each: `<reply> <getpeername>`.
pub const PROBE: &str = script!("probe.py");
/// `UDP_PEER HOST PORT`: getpeername of a connected UDP socket.
pub const UDP_PEER: &str = script!("udp_peer.py");
/// `STEP_CONNECT HOST PORT`: one connect per stdin line, answering `ok` or `ERR ...`.
pub const STEP_CONNECT: &str = script!("step_connect.py");
/// `ECHO_IDENT_SERVER NAME HOST PORT`: sends `NAME\n`, then echoes until the client's FIN.
pub const ECHO_IDENT_SERVER: &str = script!("echo_ident_server.py");
/// `ECHO_TALK HOST PORT COUNT BYTES`: COUNT echo conversations of about BYTES each.
pub const ECHO_TALK: &str = script!("echo_talk.py");
/// `ECHO_STREAM HOST PORT SECONDS CHUNK`: one long-lived echo connection.
pub const ECHO_STREAM: &str = script!("echo_stream.py");
/// `STREAM_SERVER NAME HOST PORT`: a download-only peer (16 KiB every 20 ms).
pub const STREAM_SERVER: &str = script!("stream_server.py");
/// `DOWNLOAD HOST PORT SECONDS`: one download from a [`STREAM_SERVER`].
pub const DOWNLOAD: &str = script!("download.py");
/// `TCP_CHECK HOST PORT`: exits 0 if a connection opens within 0.5 s.
pub const TCP_CHECK: &str = script!("tcp_check.py");
/// `HTTP_GET URL`: prints the body of a GET.
pub const HTTP_GET: &str = script!("http_get.py");
/// `BROWSER URL OUT_JSON [--no-js] [--wait-refresh] [--screenshot PNG]`: loads URL in
/// headless Chromium (DevTools protocol on a pipe) and writes the page's `data-field` figures,
/// every request it made, console and log errors; optionally a screenshot.
pub const BROWSER: &str = script!("browser.py");
/// `RAW_PEER HOST PORT KIND`: a broken client (`http1`, `bad-frame`, `oversized`, `garbage`);
/// prints how and when the server closed: `<fin|reset|open> <seconds> <bytes received>`.
pub const RAW_PEER: &str = script!("raw_peer.py");
/// `HOLD_CONNS serve HOST PORT` keeps every accepted connection open, idle;
/// `HOLD_CONNS connect HOST PORT N READY` opens N connections, keeps them, then writes N to the
/// file READY.
pub const HOLD_CONNS: &str = script!("hold_conns.py");

#[cfg(test)]
mod tests {
    #[test]
    fn every_script_exists_next_to_the_shared_helper() {
        for path in [
            super::IDENT_SERVER,
            super::PROBE,
            super::UDP_PEER,
            super::STEP_CONNECT,
            super::ECHO_IDENT_SERVER,
            super::ECHO_TALK,
            super::ECHO_STREAM,
            super::STREAM_SERVER,
            super::DOWNLOAD,
            super::TCP_CHECK,
            super::HTTP_GET,
            super::RAW_PEER,
            super::HOLD_CONNS,
            super::BROWSER,
        ] {
            let path = std::path::Path::new(path);
            assert!(path.is_file(), "{} must exist", path.display());
            assert!(
                path.with_file_name("peerlib.py").is_file(),
                "the helper module must sit next to {}",
                path.display()
            );
        }
    }

    #[test]
    fn every_script_parses() {
        let dir = std::path::Path::new(super::PROBE).parent().unwrap();
        let scripts: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "py"))
            .collect();
        assert!(scripts.len() > 10, "the scripts are in {}", dir.display());
        // Parse only: nothing is written into the tree.
        let out = std::process::Command::new("python3")
            .args([
                "-c",
                "import ast, sys\nfor p in sys.argv[1:]: ast.parse(open(p).read(), p)",
            ])
            .args(&scripts)
            .output()
            .expect("python3 runs");
        assert!(
            out.status.success(),
            "every script must be valid Python: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
