"""`tcp_check.py HOST PORT`: exits 0 if a TCP connection to HOST:PORT opens within 0.5 s."""
import socket
import sys


def main():
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5)
    s.close()


if __name__ == "__main__":
    main()
