"""Idle TCP connections held open, the shape of pinned clients between calls.

`hold_conns.py serve HOST PORT`: accepts every connection and keeps it, never reading or
writing. `hold_conns.py connect HOST PORT N READY`: opens N connections to HOST:PORT one after
another, keeps them all, then writes N to the file READY (write-then-rename) and stays until
killed; it exits non-zero if a connect fails. Both raise their soft open-file limit; N must
fit under the hard one (more connections: more processes)."""
import os
import resource
import socket
import sys
import time

import peerlib


def fit_open_files(n):
    """Raises the soft open-file limit to fit n sockets, up to the hard limit; fails if n
    does not fit (run more processes instead)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 64
    if hard != resource.RLIM_INFINITY and want > hard:
        sys.exit("%d connections do not fit the open-file limit %d" % (n, hard))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def serve(host, port):
    # Up to the hard limit: a server holds what its clients open (the benchmark spreads them).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    s = peerlib.listen(host, port, backlog=4096)
    held = []
    while True:
        c, _ = s.accept()
        held.append(c)


def connect(host, port, n, ready):
    fit_open_files(n)
    held = []
    for _ in range(n):
        held.append(socket.create_connection((host, port), timeout=10))
    tmp = ready + ".tmp"
    with open(tmp, "w") as f:
        f.write("%d\n" % len(held))
    os.rename(tmp, ready)
    while True:
        time.sleep(3600)


def main():
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        connect(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])


if __name__ == "__main__":
    main()
