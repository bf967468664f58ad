"""`stream_server.py NAME HOST PORT`: on every TCP connection (one thread each), sends
`NAME\\n`, reads one line `SECONDS\\n`, then sends 16 KiB every 20 ms for that long (at most
30 s) and closes: a server-streaming peer whose client only downloads."""
import sys
import threading
import time

import peerlib


def serve(c, name):
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


def main():
    name, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    s = peerlib.listen(host, port, backlog=64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c, name), daemon=True).start()


if __name__ == "__main__":
    main()
