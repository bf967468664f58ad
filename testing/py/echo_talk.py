"""`echo_talk.py HOST PORT COUNT BYTES`: opens COUNT connections one after another to an
echo_ident_server.py; on each reads the name line, sends about BYTES bytes (varied per
connection) in 4 KiB chunks reading each echo back, shuts down its side, reads to EOF and
closes. Prints one line per connection: `<name> <local ip>:<port> <sent> <received>`
(received includes the name line; an IPv6 local address is printed as `[ip]:port`), or
`ERR <reason>`."""
import socket
import sys

import peerlib


def main():
    host, port, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    out = []
    for i in range(n):
        try:
            s = socket.create_connection((host, port), timeout=5)
            local = s.getsockname()
            name = peerlib.read_name(s)
            received = len(name)
            total = size + (i * 7919) % size
            sent = 0
            while sent < total:
                k = min(4096, total - sent)
                s.sendall(b"x" * k)
                sent += k
                received += peerlib.read_exact(s, k)
            s.shutdown(socket.SHUT_WR)
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                received += len(chunk)
            s.close()
            out.append("%s %s %d %d" % (name.decode().strip(), peerlib.addr(local), sent, received))
        except OSError as e:
            out.append("ERR %s" % e)
    print("\n".join(out))


if __name__ == "__main__":
    main()
