"""`raw_peer.py HOST PORT KIND`: a broken client. Connects, sends one kind of bad input, then
reads until the server closes (at most 15 s) and prints one line:
`<fin|reset|open> <seconds until closed> <bytes received>`.

KIND: `http1` (an HTTP/1.1 request instead of HTTP/2), `bad-frame` (the HTTP/2 preface, then
a SETTINGS frame whose length is not a multiple of 6), `oversized` (the preface, then a frame
header declaring 16 MiB - 1 of DATA on stream 1 before SETTINGS), `garbage` (64 random bytes).
"""
import os
import socket
import sys
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind, flags, stream, payload, length=None):
    n = len(payload) if length is None else length
    return n.to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def main():
    host, port, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    data = {
        "http1": b"GET / HTTP/1.1\r\nHost: echo\r\n\r\n",
        "bad-frame": PREFACE + frame(0x4, 0, 0, b"\x00" * 7),
        "oversized": PREFACE + frame(0x0, 0, 1, b"", length=(1 << 24) - 1),
        "garbage": os.urandom(64),
    }[kind]
    s = socket.create_connection((host, port), timeout=15)
    start = time.monotonic()
    s.sendall(data)
    received, how = 0, "open"
    try:
        while time.monotonic() - start < 15:
            chunk = s.recv(65536)
            if not chunk:
                how = "fin"
                break
            received += len(chunk)
    except ConnectionResetError:
        how = "reset"
    except socket.timeout:
        how = "open"
    print("%s %.3f %d" % (how, time.monotonic() - start, received))


if __name__ == "__main__":
    main()
