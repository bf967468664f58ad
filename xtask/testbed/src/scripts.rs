//! Small Python programs run inside pods. Python is used because it is on every machine and
//! starts in milliseconds; each script is a real socket peer, not a mock.

/// `python3 -c IDENT_SERVER NAME HOST PORT [PORT...]`: on every TCP connection, sends
/// `NAME\n` and closes. Tells a client which server it actually reached. An IPv6 HOST (one
/// with a `:`) gets an IPv6 socket with `IPV6_V6ONLY` off, so `::` answers both families.
pub const IDENT_SERVER: &str = r#"
import socket, sys, threading
name, host, ports = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3:]]
def serve(port):
    if ":" in host:
        s = socket.socket(socket.AF_INET6)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    else:
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

/// `python3 -c UDP_PEER HOST PORT`: connects a UDP socket (IPv6 if HOST has a `:`) and prints
/// what getpeername reports as `ip:port`. No datagram is sent.
pub const UDP_PEER: &str = r#"
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
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

/// `python3 -c ECHO_IDENT_SERVER NAME HOST PORT`: on every TCP connection (one thread each),
/// sends `NAME\n`, then echoes everything it reads until the client shuts down its side.
/// Tells a client which server it reached and lets it move a known number of bytes. An IPv6
/// HOST (`::`) gets an IPv6 socket with `IPV6_V6ONLY` off, so it answers both families.
pub const ECHO_IDENT_SERVER: &str = r#"
import socket, sys, threading
name, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def serve(c):
    try:
        c.sendall((name + "\n").encode())
        while True:
            data = c.recv(65536)
            if not data:
                break
            c.sendall(data)
    except OSError:
        pass
    finally:
        c.close()
if ":" in host:
    s = socket.socket(socket.AF_INET6)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
else:
    s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port))
s.listen(1024)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// `python3 -c ECHO_TALK HOST PORT COUNT BYTES`: opens COUNT connections one after another
/// to an [`ECHO_IDENT_SERVER`]; on each reads the name line, sends about BYTES bytes (varied
/// per connection) in 4 KiB chunks reading each echo back, shuts down its side, reads to EOF
/// and closes. Prints one line per connection: `<name> <local ip>:<port> <sent> <received>`
/// (received includes the name line; an IPv6 local address is printed as `[ip]:port`), or
/// `ERR <reason>`.
pub const ECHO_TALK: &str = r#"
import socket, sys
def addr(a):
    return ("[%s]:%d" if ":" in a[0] else "%s:%d") % (a[0], a[1])
host, port, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def read_exact(s, k):
    got = 0
    while got < k:
        chunk = s.recv(min(65536, k - got))
        if not chunk:
            raise OSError("early EOF")
        got += len(chunk)
    return got
out = []
for i in range(n):
    try:
        s = socket.create_connection((host, port), timeout=5)
        local = s.getsockname()
        name = b""
        while not name.endswith(b"\n"):
            chunk = s.recv(1)
            if not chunk:
                raise OSError("no name")
            name += chunk
        received = len(name)
        total = size + (i * 7919) % size
        sent = 0
        while sent < total:
            k = min(4096, total - sent)
            s.sendall(b"x" * k)
            sent += k
            received += read_exact(s, k)
        s.shutdown(socket.SHUT_WR)
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            received += len(chunk)
        s.close()
        out.append("%s %s %d %d" % (name.decode().strip(), addr(local), sent, received))
    except OSError as e:
        out.append("ERR %s" % e)
print("\n".join(out))
"#;

/// `python3 -c ECHO_STREAM HOST PORT SECONDS CHUNK`: one long-lived connection to an
/// [`ECHO_IDENT_SERVER`], like a pinned gRPC channel: prints `<name> <local ip>:<port>` as
/// soon as it is connected, then sends CHUNK bytes and reads the echo every 10 ms for SECONDS,
/// then prints `<sent> <received>` and closes. An IPv6 local address is printed as `[ip]:port`.
pub const ECHO_STREAM: &str = r#"
import socket, sys, time
def addr(a):
    return ("[%s]:%d" if ":" in a[0] else "%s:%d") % (a[0], a[1])
host, port, secs, size = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
s = socket.create_connection((host, port), timeout=5)
local = s.getsockname()
name = b""
while not name.endswith(b"\n"):
    chunk = s.recv(1)
    if not chunk:
        sys.exit("no name")
    name += chunk
print("%s %s" % (name.decode().strip(), addr(local)), flush=True)
sent, received = 0, len(name)
end = time.monotonic() + secs
while time.monotonic() < end:
    s.sendall(b"x" * size)
    sent += size
    got = 0
    while got < size:
        chunk = s.recv(size - got)
        if not chunk:
            sys.exit("early EOF")
        got += len(chunk)
    received += got
    time.sleep(0.01)
s.close()
print("%d %d" % (sent, received), flush=True)
"#;

/// `python3 -c STREAM_SERVER NAME HOST PORT`: on every TCP connection (one thread each), sends
/// `NAME\n`, reads one line `SECONDS\n`, then sends 16 KiB every 20 ms for that long (at
/// most 30 s) and closes: a server-streaming peer whose client only downloads.
pub const STREAM_SERVER: &str = r#"
import socket, sys, threading, time
name, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def serve(c):
    try:
        c.sendall((name + "\n").encode())
        line = b""
        while not line.endswith(b"\n"):
            chunk = c.recv(64)
            if not chunk:
                return
            line += chunk
        end = time.monotonic() + min(float(line), 30.0)
        block = b"y" * 16384
        while time.monotonic() < end:
            c.sendall(block)
            time.sleep(0.02)
    except (OSError, ValueError):
        pass
    finally:
        c.close()
if ":" in host:
    s = socket.socket(socket.AF_INET6)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
else:
    s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port))
s.listen(64)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// `python3 -c DOWNLOAD HOST PORT SECONDS`: one connection to a [`STREAM_SERVER`]: prints
/// `<name> <local ip>:<port>` once connected, sends the one request line, then only receives
/// until EOF and prints the bytes received (name line included).
pub const DOWNLOAD: &str = r#"
import socket, sys
host, port, secs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = socket.create_connection((host, port), timeout=10)
local = s.getsockname()
name = b""
while not name.endswith(b"\n"):
    chunk = s.recv(1)
    if not chunk:
        sys.exit("no name")
    name += chunk
fmt = "[%s]:%d" if ":" in local[0] else "%s:%d"
print("%s %s" % (name.decode().strip(), fmt % (local[0], local[1])), flush=True)
s.sendall(("%s\n" % secs).encode())
received = len(name)
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    received += len(chunk)
s.close()
print(received, flush=True)
"#;
