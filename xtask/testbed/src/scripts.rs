//! Small Python programs run inside pods. Python is used because it is on every machine and
//! starts in milliseconds; each script is a real socket peer, not a mock.

/// `python3 -c IDENT_SERVER NAME HOST PORT [PORT...]`: on every TCP connection, sends
/// `NAME\n` and closes. Tells a client which server it actually reached.
pub const IDENT_SERVER: &str = r#"
import socket, sys, threading
name, host, ports = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3:]]
def serve(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    while True:
        c, _ = s.accept()
        try:
            c.sendall((name + "\n").encode())
        except OSError:
            pass
        finally:
            c.close()
threads = [threading.Thread(target=serve, args=(p,), daemon=True) for p in ports]
for t in threads: t.start()
for t in threads: t.join()
"#;

/// `python3 -c PROBE HOST PORT COUNT`: opens COUNT TCP connections one after another and
/// prints one line per connection: `<reply> <getpeername ip>:<port>`, or `ERR <reason>`.
pub const PROBE: &str = r#"
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = []
for _ in range(n):
    try:
        s = socket.create_connection((host, port), timeout=2)
        peer = s.getpeername()
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(64)
            if not chunk:
                break
            data += chunk
        s.close()
        out.append("%s %s:%d" % (data.decode().strip() or "EMPTY", peer[0], peer[1]))
    except OSError as e:
        out.append("ERR %s" % e)
print("\n".join(out))
"#;

/// `python3 -c UDP_PEER HOST PORT`: connects a UDP socket and prints what getpeername reports
/// as `ip:port`. No datagram is sent.
pub const UDP_PEER: &str = r#"
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((host, port))
peer = s.getpeername()
print("%s:%d" % (peer[0], peer[1]))
"#;

/// `python3 -c STEP_CONNECT HOST PORT`: one TCP connect per line read on stdin, answering
/// `ok` or `ERR <reason>` on stdout after each. Lets a benchmark read kernel counters between
/// single connects.
pub const STEP_CONNECT: &str = r#"
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
for _ in sys.stdin:
    try:
        s = socket.create_connection((host, port), timeout=2)
        s.close()
        sys.stdout.write("ok\n")
    except OSError as e:
        sys.stdout.write("ERR %s\n" % e)
    sys.stdout.flush()
"#;
