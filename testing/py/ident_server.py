"""`ident_server.py NAME HOST PORT [PORT...]`: on every TCP connection, sends `NAME\\n` and
closes. Tells a client which server it actually reached. An IPv6 HOST (`::`) answers both
families."""
import sys
import threading

import peerlib


def serve(name, host, port):
    s = peerlib.listen(host, port)
    while True:
        c, _ = s.accept()
        try:
            c.sendall((name + "\n").encode())
        except OSError:
            pass
        finally:
            c.close()


def main():
    name, host, ports = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3:]]
    threads = [threading.Thread(target=serve, args=(name, host, p), daemon=True) for p in ports]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
