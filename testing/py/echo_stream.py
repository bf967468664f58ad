"""`echo_stream.py HOST PORT SECONDS CHUNK`: one long-lived connection to an
echo_ident_server.py, like a pinned gRPC channel: prints `<name> <local ip>:<port>` as soon as
it is connected, then sends CHUNK bytes and reads the echo every 10 ms for SECONDS, then
prints `<sent> <received>` and closes. An IPv6 local address is printed as `[ip]:port`."""
import socket
import sys
import time

import peerlib


def main():
    host, port, secs, size = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    s = socket.create_connection((host, port), timeout=5)
    local = s.getsockname()
    try:
        name = peerlib.read_name(s)
    except OSError:
        sys.exit("no name")
    print("%s %s" % (name.decode().strip(), peerlib.addr(local)), flush=True)
    sent, received = 0, len(name)
    end = time.monotonic() + secs
    while time.monotonic() < end:
        s.sendall(b"x" * size)
        sent += size
        try:
            received += peerlib.read_exact(s, size)
        except OSError:
            sys.exit("early EOF")
        time.sleep(0.01)
    s.close()
    print("%d %d" % (sent, received), flush=True)


if __name__ == "__main__":
    main()
