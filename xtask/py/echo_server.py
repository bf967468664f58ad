"""Echo gRPC server (grpcio) for the demo and tests: every reply names this pod.

Usage: echo_server.py --gen DIR --name POD --port PORT [--delay-ms MS]
DIR holds the stubs generated from proto/skewless/echo/v1/echo.proto.
"""
import argparse
import sys
import time
from concurrent import futures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay-ms", type=int, default=0)
    args = ap.parse_args()
    sys.path.insert(0, args.gen)
    import grpc
    from skewless.echo.v1 import echo_pb2, echo_pb2_grpc

    class Echo(echo_pb2_grpc.EchoServicer):
        def Echo(self, request, context):
            delay = args.delay_ms + request.delay_ms
            if delay:
                time.sleep(delay / 1000.0)
            payload = request.payload if not request.reply_size else b"x" * request.reply_size
            return echo_pb2.EchoReply(payload=payload, pod=args.name)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    echo_pb2_grpc.add_EchoServicer_to_server(Echo(), server)
    server.add_insecure_port("0.0.0.0:%d" % args.port)
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
