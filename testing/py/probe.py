"""`probe.py HOST PORT COUNT`: opens COUNT TCP connections one after another and prints one
line per connection: `<reply> <getpeername ip>:<port>`, or `ERR <reason>`."""
import socket
import sys


def main():
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


if __name__ == "__main__":
    main()
