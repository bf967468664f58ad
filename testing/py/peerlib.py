"""Shared pieces of the small socket peers that run inside testbed pods.

Each peer in this directory is a real socket program (never a mock), started as
`python3 testing/py/<peer>.py ARGS...` in a pod's or node's namespace; Python starts in
milliseconds and is on every machine. Python puts this directory first on `sys.path`, so
`import peerlib` finds this file.
"""
import socket


def listen(host, port, backlog=1024):
    """A TCP listener on host:port with SO_REUSEADDR. An IPv6 host (one with a `:`) gets an
    IPv6 socket with IPV6_V6ONLY off, so `::` answers both families."""
    if ":" in host:
        s = socket.socket(socket.AF_INET6)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    else:
        s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(backlog)
    return s


def addr(a):
    """`ip:port`, or `[ip]:port` for an IPv6 address (from getsockname/getpeername)."""
    return ("[%s]:%d" if ":" in a[0] else "%s:%d") % (a[0], a[1])


def read_name(s):
    """Reads the server's `NAME\\n` line byte by byte (nothing after it is consumed). Returns
    the raw line, newline included, or raises OSError if the connection ends first."""
    name = b""
    while not name.endswith(b"\n"):
        chunk = s.recv(1)
        if not chunk:
            raise OSError("no name")
        name += chunk
    return name


def read_exact(s, k):
    """Reads exactly k bytes (discarding them); returns k or raises OSError on early EOF."""
    got = 0
    while got < k:
        chunk = s.recv(min(65536, k - got))
        if not chunk:
            raise OSError("early EOF")
        got += len(chunk)
    return got
