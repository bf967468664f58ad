"""pick_first gRPC clients (grpcio) for the rotation-convergence benchmark.

Opens CHANNELS channels to TARGET, each grpcio's default pick_first channel with its own
subchannel pool, so each is exactly one HTTP/2 connection that stays on one backend until the
server sends it away (GOAWAY); grpcio then reconnects to TARGET by itself, as a real client
does. CONCURRENCY threads per channel call Echo back to back for DURATION seconds. Every
reply names its pod; the calls are tallied per pod in buckets of BUCKET_MS by the time each
call ended, so the benchmark can see when the spread changed.

Usage: rotation_client.py --gen DIR --target HOST:PORT --channels N --concurrency C
                          --duration S [--bucket-ms MS] [--timeout S]
Prints one JSON object: {"start": <epoch s of bucket 0>, "bucket_ms": MS, "buckets":
[{pod: calls}, ...], "errors": {CODE: calls}, "moves": <times a channel's pod changed>,
"channels": N}. A call that fails is counted under its status code, never retried here.
"""
import argparse
import json
import sys
import threading
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--channels", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--duration", type=float, required=True)
    ap.add_argument("--bucket-ms", type=int, default=250)
    ap.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args()
    sys.path.insert(0, args.gen)
    import grpc
    from skewless.echo.v1 import echo_pb2, echo_pb2_grpc

    # A local subchannel pool per channel: without it grpcio shares one connection between
    # every channel of the process to the same target.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(args.target, options=options) for _ in range(args.channels)]
    for ch in channels:
        grpc.channel_ready_future(ch).result(timeout=10)
    start = time.time()
    deadline = start + args.duration
    nbuckets = int(args.duration * 1000 / args.bucket_ms) + 1
    lock = threading.Lock()
    buckets = [dict() for _ in range(nbuckets)]
    errors = {}
    last_pod = [None] * args.channels
    moves = [0]

    def worker(i):
        stub = echo_pb2_grpc.EchoStub(channels[i])
        while time.time() < deadline:
            try:
                reply = stub.Echo(echo_pb2.EchoRequest(payload=b"hi"), timeout=args.timeout)
                b = int((time.time() - start) * 1000 / args.bucket_ms)
                with lock:
                    if b < nbuckets:
                        buckets[b][reply.pod] = buckets[b].get(reply.pod, 0) + 1
                    if last_pod[i] is not None and last_pod[i] != reply.pod:
                        moves[0] += 1
                    last_pod[i] = reply.pod
            except grpc.RpcError as e:
                with lock:
                    key = e.code().name
                    errors[key] = errors.get(key, 0) + 1

    threads = [
        threading.Thread(target=worker, args=(i,))
        for i in range(args.channels)
        for _ in range(max(1, args.concurrency))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ch in channels:
        ch.close()
    print(json.dumps({"start": start, "bucket_ms": args.bucket_ms, "buckets": buckets,
                      "errors": errors, "moves": moves[0], "channels": args.channels}))


if __name__ == "__main__":
    main()
