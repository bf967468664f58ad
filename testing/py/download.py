"""`download.py HOST PORT SECONDS`: one connection to a stream_server.py: prints
`<name> <local ip>:<port>` once connected, sends the one request line, then only receives
until EOF and prints the bytes received (name line included)."""
import socket
import sys

import peerlib


def main():
    host, port, secs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    s = socket.create_connection((host, port), timeout=10)
    local = s.getsockname()
    try:
        name = peerlib.read_name(s)
    except OSError:
        sys.exit("no name")
    print("%s %s" % (name.decode().strip(), peerlib.addr(local)), flush=True)
    s.sendall(("%s\n" % secs).encode())
    received = len(name)
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        received += len(chunk)
    s.close()
    print(received, flush=True)


if __name__ == "__main__":
    main()
