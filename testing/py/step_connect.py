"""`step_connect.py HOST PORT`: one TCP connect per line read on stdin, answering `ok` or
`ERR <reason>` on stdout after each. Lets a benchmark read kernel counters between single
connects."""
import socket
import sys


def main():
    host, port = sys.argv[1], int(sys.argv[2])
    for _ in sys.stdin:
        try:
            s = socket.create_connection((host, port), timeout=2)
            s.close()
            sys.stdout.write("ok\n")
        except OSError as e:
            sys.stdout.write("ERR %s\n" % e)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
