"""`udp_peer.py HOST PORT`: connects a UDP socket (IPv6 if HOST has a `:`) and prints what
getpeername reports as `ip:port`. No datagram is sent."""
import socket
import sys


def main():
    host, port = sys.argv[1], int(sys.argv[2])
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((host, port))
    peer = s.getpeername()
    print("%s:%d" % (peer[0], peer[1]))


if __name__ == "__main__":
    main()
