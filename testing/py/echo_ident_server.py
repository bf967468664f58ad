"""`echo_ident_server.py NAME HOST PORT`: on every TCP connection (one thread each), sends
`NAME\\n`, then echoes everything it reads until the client shuts down its side. Tells a
client which server it reached and lets it move a known number of bytes. An IPv6 HOST (`::`)
answers both families."""
import sys
import threading

import peerlib


def serve(c, name):
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


def main():
    name, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    s = peerlib.listen(host, port)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c, name), daemon=True).start()


if __name__ == "__main__":
    main()
