//! Configurations of the peers the benchmark runs skewless against: HAProxy (h2 and L4) and
//! nginx, each loading the same echo pods.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;

/// A backend pod: its name (what the echo reply carries) and address.
#[derive(Debug, Clone)]
pub struct Pod {
    /// Pod name.
    pub name: String,
    /// gRPC address.
    pub addr: SocketAddr,
}

/// HAProxy in HTTP/2 cleartext on both sides, `balance leastconn` (per request: HAProxy counts
/// each H2 stream as one connection of the server). With `l4` it is the per-connection
/// baseline instead: `mode tcp`, `balance roundrobin`, every request of a connection pinned.
#[must_use]
pub fn haproxy_config(listen: SocketAddr, pods: &[Pod], threads: usize, l4: bool) -> String {
    let mut c = String::new();
    let _ = writeln!(c, "global");
    let _ = writeln!(c, "    nbthread {threads}");
    let _ = writeln!(c, "    maxconn 4096");
    // The default (100) would cap a 200-stream client connection below the load's in-flight.
    let _ = writeln!(c, "    tune.h2.max-concurrent-streams 1000");
    let _ = writeln!(c, "defaults");
    let _ = writeln!(c, "    mode {}", if l4 { "tcp" } else { "http" });
    let _ = writeln!(c, "    timeout connect 2s");
    let _ = writeln!(c, "    timeout client 60s");
    let _ = writeln!(c, "    timeout server 60s");
    let _ = writeln!(c, "frontend grpc");
    if l4 {
        let _ = writeln!(c, "    bind {listen}");
    } else {
        let _ = writeln!(c, "    bind {listen} proto h2");
    }
    let _ = writeln!(c, "    default_backend echo");
    let _ = writeln!(c, "backend echo");
    let _ = writeln!(
        c,
        "    balance {}",
        if l4 { "roundrobin" } else { "leastconn" }
    );
    for p in pods {
        if l4 {
            let _ = writeln!(c, "    server {} {}", p.name, p.addr);
        } else {
            let _ = writeln!(c, "    server {} {} proto h2", p.name, p.addr);
        }
    }
    c
}

/// nginx with `grpc_pass` to a `least_conn` upstream, an HTTP/2 cleartext listener, upstream
/// keepalive (nginx sends one request per upstream connection at a time, so it needs a pool),
/// and the per-connection request limits raised so a long run is not cut by GOAWAYs. All
/// paths it writes are under `dir`.
#[must_use]
pub fn nginx_config(dir: &Path, listen: SocketAddr, pods: &[Pod], workers: usize) -> String {
    let d = dir.display();
    let mut c = String::new();
    let _ = writeln!(c, "daemon off;");
    let _ = writeln!(c, "worker_processes {workers};");
    let _ = writeln!(c, "pid {d}/nginx.pid;");
    let _ = writeln!(c, "error_log stderr warn;");
    let _ = writeln!(c, "events {{ worker_connections 8192; }}");
    let _ = writeln!(c, "http {{");
    let _ = writeln!(c, "    access_log off;");
    for t in ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"] {
        let _ = writeln!(c, "    {t}_temp_path {d}/{t};");
    }
    let _ = writeln!(c, "    upstream echo {{");
    let _ = writeln!(c, "        least_conn;");
    for p in pods {
        let _ = writeln!(c, "        server {};", p.addr);
    }
    let _ = writeln!(c, "        keepalive 512;");
    let _ = writeln!(c, "        keepalive_requests 100000000;");
    let _ = writeln!(c, "    }}");
    let _ = writeln!(c, "    server {{");
    let _ = writeln!(c, "        listen {listen} http2;");
    let _ = writeln!(c, "        http2_max_concurrent_streams 1000;");
    let _ = writeln!(c, "        keepalive_requests 100000000;");
    let _ = writeln!(c, "        location / {{ grpc_pass grpc://echo; }}");
    let _ = writeln!(c, "    }}");
    let _ = writeln!(c, "}}");
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods() -> Vec<Pod> {
        (0..2)
            .map(|i| Pod {
                name: format!("pod-{i}"),
                addr: format!("127.0.0.1:{}", 9000 + i).parse().unwrap(),
            })
            .collect()
    }

    #[test]
    fn haproxy_h2_leastconn_and_l4_roundrobin() {
        let listen = "127.0.0.1:8000".parse().unwrap();
        let h2 = haproxy_config(listen, &pods(), 2, false);
        assert!(h2.contains("bind 127.0.0.1:8000 proto h2"));
        assert!(h2.contains("balance leastconn"));
        assert!(h2.contains("server pod-1 127.0.0.1:9001 proto h2"));
        assert!(h2.contains("mode http"));
        let l4 = haproxy_config(listen, &pods(), 2, true);
        assert!(l4.contains("mode tcp") && l4.contains("balance roundrobin"));
        assert!(!l4.contains("proto h2"));
    }

    #[test]
    fn nginx_grpc_pass_least_conn() {
        let c = nginx_config(
            Path::new("/tmp/x"),
            "127.0.0.1:8000".parse().unwrap(),
            &pods(),
            2,
        );
        assert!(c.contains("listen 127.0.0.1:8000 http2;"));
        assert!(c.contains("least_conn;"));
        assert!(c.contains("grpc_pass grpc://echo;"));
        assert!(c.contains("server 127.0.0.1:9000;"));
        assert!(c.contains("pid /tmp/x/nginx.pid;"));
    }
}
