"""Echo gRPC server (grpcio) for the demo and tests: every reply names this pod.

Usage: echo_server.py --gen DIR --name POD --port PORT [--delay-ms MS]
                      [--max-connection-age-ms MS] [--max-workers N] [--host ADDR]
DIR holds the stubs generated from proto/skewless/echo/v1/echo.proto. All four methods of the
echo service are served; messages up to 64 MiB are accepted both ways. With
--max-connection-age-ms the server sends each connection grpcio's graceful GOAWAY once it is
that old (a gRPC server's MaxConnectionAge), as a backend rotating its own connections does.
--max-workers: handler threads (default 32); every call in flight, also one waiting out its
--delay-ms, holds one.
"""
import argparse
import sys
import time
from concurrent import futures

MAX_MESSAGE = 64 * 1024 * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay-ms", type=int, default=0)
    ap.add_argument("--max-connection-age-ms", type=int, default=0)
    ap.add_argument("--max-workers", type=int, default=32)
    ap.add_argument("--host", default="0.0.0.0")
    args = ap.parse_args()
    sys.path.insert(0, args.gen)
    import grpc
    from skewless.echo.v1 import echo_pb2, echo_pb2_grpc

    def wait(request):
        delay = args.delay_ms + request.delay_ms
        if delay:
            time.sleep(delay / 1000.0)

    def reply(request):
        payload = request.payload if not request.reply_size else b"x" * request.reply_size
        return echo_pb2.EchoReply(payload=payload, pod=args.name)

    class Echo(echo_pb2_grpc.EchoServicer):
        def Echo(self, request, context):
            wait(request)
            return reply(request)

        def ServerStream(self, request, context):
            wait(request)
            for i in range(request.count):
                if i and request.interval_ms:
                    time.sleep(request.interval_ms / 1000.0)
                if not context.is_active():
                    return
                yield reply(request)

        def ClientStream(self, request_iterator, context):
            payload, last = b"", None
            for request in request_iterator:
                payload += request.payload
                last = request
            if last is not None:
                wait(last)
            return echo_pb2.EchoReply(payload=payload, pod=args.name)

        def Bidi(self, request_iterator, context):
            for request in request_iterator:
                wait(request)
                yield reply(request)

    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
    ]
    if args.max_connection_age_ms:
        options.append(("grpc.max_connection_age_ms", args.max_connection_age_ms))
        # Calls in flight when the age is reached get this long to finish.
        options.append(("grpc.max_connection_age_grace_ms", 30000))
    # Streams hold a worker thread each for their whole life: enough workers for the tests'
    # streams next to their unary load.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.max_workers),
                         options=options)
    echo_pb2_grpc.add_EchoServicer_to_server(Echo(), server)
    server.add_insecure_port("%s:%d" % (args.host, args.port))
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
