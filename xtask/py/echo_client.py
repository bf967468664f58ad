"""Echo gRPC client (grpcio) for the demo: one channel, N calls, prints a JSON summary.

The channel is grpcio's default, i.e. the pick_first policy that the seeds describe: it
resolves the Service name once and sends every call over one HTTP/2 connection.

Usage: echo_client.py --gen DIR --target HOST:PORT --calls N [--concurrency C]
Prints one line: ok=K p50=MS p99=MS pods=pod:count,... errors=CODE:count,...
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
    args = ap.parse_args()
    sys.path.insert(0, args.gen)
    import grpc
    from skewless.echo.v1 import echo_pb2, echo_pb2_grpc

    channel = grpc.insecure_channel(args.target)
    stub = echo_pb2_grpc.EchoStub(channel)
    lock = threading.Lock()
    pods, errors, latencies = {}, {}, []
    remaining = [args.calls]

    def worker():
        while True:
            with lock:
                if remaining[0] == 0:
                    return
                remaining[0] -= 1
            start = time.perf_counter()
            try:
                reply = stub.Echo(echo_pb2.EchoRequest(payload=b"hi"), timeout=args.timeout)
                elapsed = (time.perf_counter() - start) * 1000.0
                with lock:
                    pods[reply.pod] = pods.get(reply.pod, 0) + 1
                    latencies.append(elapsed)
            except grpc.RpcError as e:
                with lock:
                    key = e.code().name
                    errors[key] = errors.get(key, 0) + 1

    threads = [threading.Thread(target=worker) for _ in range(max(1, args.concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latencies.sort()

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
