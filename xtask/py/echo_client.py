"""Echo gRPC client (grpcio) for the demo: one channel, N calls, prints a JSON summary.

The channel is grpcio's default, i.e. the pick_first policy that the seeds describe: it
resolves the Service name once and sends every call over one HTTP/2 connection.

Usage: echo_client.py --gen DIR --target HOST:PORT --calls N [--concurrency C]
                      [--duration S] [--log FILE] [--reconnect-backoff-ms MS]
Prints one line: ok=K p50=MS p99=MS pods=pod:count,... errors=CODE:count,...
With --duration the client stops after S seconds (or N calls, whichever comes first). With
--log every call is written as "<start, seconds since the epoch> <OK or status code>".
"""
import argparse
import sys
import threading
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--duration", type=float, default=0.0)
    ap.add_argument("--log")
    ap.add_argument("--reconnect-backoff-ms", type=int, default=0)
    args = ap.parse_args()
    sys.path.insert(0, args.gen)
    import grpc
    from skewless.echo.v1 import echo_pb2, echo_pb2_grpc

    options = []
    if args.reconnect_backoff_ms:
        ms = args.reconnect_backoff_ms
        options = [("grpc.initial_reconnect_backoff_ms", ms), ("grpc.min_reconnect_backoff_ms", ms),
                   ("grpc.max_reconnect_backoff_ms", ms)]
    channel = grpc.insecure_channel(args.target, options=options)
    deadline = time.time() + args.duration if args.duration else None
    log = []
    stub = echo_pb2_grpc.EchoStub(channel)
    lock = threading.Lock()
    pods, errors, latencies = {}, {}, []
    remaining = [args.calls]

    def worker():
        while True:
            with lock:
                if remaining[0] == 0 or (deadline and time.time() >= deadline):
                    return
                remaining[0] -= 1
            started_at = time.time()
            start = time.perf_counter()
            try:
                reply = stub.Echo(echo_pb2.EchoRequest(payload=b"hi"), timeout=args.timeout)
                elapsed = (time.perf_counter() - start) * 1000.0
                with lock:
                    pods[reply.pod] = pods.get(reply.pod, 0) + 1
                    latencies.append(elapsed)
                    log.append("%.6f OK" % started_at)
            except grpc.RpcError as e:
                with lock:
                    key = e.code().name
                    errors[key] = errors.get(key, 0) + 1
                    log.append("%.6f %s" % (started_at, key))

    threads = [threading.Thread(target=worker) for _ in range(max(1, args.concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latencies.sort()
    if args.log:
        with open(args.log, "w") as f:
            f.write("\n".join(log) + "\n")

    def pct(p):
        if not latencies:
            return None
        return round(latencies[min(len(latencies) - 1, int(p * len(latencies)))], 2)

    def fmt(d):
        return ",".join("%s:%d" % kv for kv in sorted(d.items())) or "-"

    p50, p99 = pct(0.50), pct(0.99)
    print("ok=%d p50=%s p99=%s pods=%s errors=%s" % (
        len(latencies), "-" if p50 is None else p50, "-" if p99 is None else p99,
        fmt(pods), fmt(errors)))
    channel.close()


if __name__ == "__main__":
    main()
