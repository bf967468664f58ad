"""Echo gRPC client (grpcio) for the demo and the real-client tests.

The channel is grpcio's default, i.e. the pick_first policy that the seeds describe: it
resolves the Service name once and sends every call over one HTTP/2 connection. With
--channels K it opens K channels, each its own connection (local subchannel pools).

Usage: echo_client.py --gen DIR --target HOST:PORT [--calls N] [--concurrency C]
           [--duration S] [--timeout S] [--channels K] [--payload BYTES] [--delay-ms MS]
           [--large-calls N] [--large-bytes BYTES] [--stream-ms MS] [--bidi-ms MS]
           [--keepalive-ms MS] [--reconnect-backoff-ms MS] [--log FILE] [--json]

Unary calls: C in flight until N are done or S seconds have passed (whichever comes first).
--delay-ms: the server waits that long in each of them (a bounded rate at C in flight).
--large-calls: that many more unary calls of --large-bytes each way (default 4 MiB), one at a
time, next to the others. --stream-ms: one server-streaming call held open that long (a reply
every 50 ms). --bidi-ms: one bidi stream that long (a message every 50 ms, each answered; then
the client half-closes, and every message sent must have been answered).
--keepalive-ms: the client's own keepalive PINGs at that interval.

Output: with --json one JSON object (the ClientResult of testing/clients, the same for the
grpcio, grpc-js and tonic clients); otherwise one summary line,
ok=K p50=MS p99=MS pods=pod:count,... errors=CODE:count,... (the demo's format). With --log
every unary call is written as "<start, seconds since the epoch> <OK or status code>".
"""
import argparse
import json
import sys
import threading
import time

STREAM_INTERVAL_MS = 50
MAX_MESSAGE = 64 * 1024 * 1024
MAX_LISTED_FAILURES = 20


class Tally:
    """What a kind of call produced: the ClientResult's CallTally."""

    def __init__(self, t0):
        self.t0 = t0
        self.lock = threading.Lock()
        self.ok = 0
        self.pods = {}
        self.first_seen = {}
        self.per_second = []
        self.failed = {}
        self.failures = []
        self.latencies = []

    def success(self, pod, latency_ms):
        now = time.monotonic() - self.t0
        with self.lock:
            self.ok += 1
            self.pods[pod] = self.pods.get(pod, 0) + 1
            self.first_seen.setdefault(pod, round(now, 3))
            sec = int(now)
            while len(self.per_second) <= sec:
                self.per_second.append({})
            self.per_second[sec][pod] = self.per_second[sec].get(pod, 0) + 1
            self.latencies.append(latency_ms)

    def failure(self, code, message):
        now = time.monotonic() - self.t0
        with self.lock:
            self.failed[code] = self.failed.get(code, 0) + 1
            if len(self.failures) < MAX_LISTED_FAILURES:
                self.failures.append({"at_s": round(now, 3), "code": code, "message": message})

    def to_json(self):
        lat = sorted(self.latencies)

        def pct(p):
            if not lat:
                return None
            return round(lat[min(len(lat) - 1, int(p * len(lat)))], 3)

        return {
            "ok": self.ok,
            "pods": self.pods,
            "first_seen_s": self.first_seen,
            "per_second": self.per_second,
            "failed": self.failed,
            "failures": self.failures,
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
        }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--duration", type=float, default=0.0)
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--payload", type=int, default=2)
    ap.add_argument("--delay-ms", type=int, default=0)
    ap.add_argument("--large-calls", type=int, default=0)
    ap.add_argument("--large-bytes", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--stream-ms", type=int, default=0)
    ap.add_argument("--bidi-ms", type=int, default=0)
    ap.add_argument("--keepalive-ms", type=int, default=0)
    ap.add_argument("--log")
    ap.add_argument("--reconnect-backoff-ms", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, args.gen)
    import grpc
    from skewless.echo.v1 import echo_pb2, echo_pb2_grpc

    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
    ]
    if args.channels > 1:
        # Without it, channels to one target share subchannels, i.e. one connection.
        options.append(("grpc.use_local_subchannel_pool", 1))
    if args.reconnect_backoff_ms:
        ms = args.reconnect_backoff_ms
        options += [("grpc.initial_reconnect_backoff_ms", ms), ("grpc.min_reconnect_backoff_ms", ms),
                    ("grpc.max_reconnect_backoff_ms", ms)]
    if args.keepalive_ms:
        options += [("grpc.keepalive_time_ms", args.keepalive_ms),
                    ("grpc.keepalive_timeout_ms", 20000),
                    ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.max_pings_without_data", 0)]
    channels = [grpc.insecure_channel(args.target, options=options)
                for _ in range(max(1, args.channels))]
    stubs = [echo_pb2_grpc.EchoStub(c) for c in channels]
    t0, start_unix = time.monotonic(), time.time()
    deadline = t0 + args.duration if args.duration else None
    unary, large = Tally(t0), Tally(t0)
    log = []

    def expired():
        return deadline is not None and time.monotonic() >= deadline

    # Unary load: C calls in flight as futures, so hundreds in flight need no thread each.
    slots = threading.Semaphore(max(1, args.concurrency))
    issued = [0]
    done = threading.Event()
    outstanding = [0]
    olock = threading.Lock()

    def finished_one():
        with olock:
            outstanding[0] -= 1
            if outstanding[0] == 0 and issued[0] == -1:
                done.set()
        slots.release()

    def issue_unary():
        request = echo_pb2.EchoRequest(payload=b"h" * args.payload, delay_ms=args.delay_ms)
        i = 0
        while i < args.calls and not expired():
            slots.acquire()
            if expired():
                slots.release()
                break
            stub = stubs[i % len(stubs)]
            started_at, start = time.time(), time.perf_counter()
            with olock:
                outstanding[0] += 1
            fut = stub.Echo.future(request, timeout=args.timeout)

            def cb(f, started_at=started_at, start=start):
                try:
                    reply = f.result()
                    unary.success(reply.pod, (time.perf_counter() - start) * 1000.0)
                    if args.log:
                        log.append("%.6f OK" % started_at)
                except grpc.RpcError as e:
                    unary.failure(e.code().name, e.details() or "")
                    if args.log:
                        log.append("%.6f %s" % (started_at, e.code().name))
                finally:
                    finished_one()

            fut.add_done_callback(cb)
            i += 1
        with olock:
            issued[0] = -1
            if outstanding[0] == 0:
                done.set()

    def run_large():
        request = echo_pb2.EchoRequest(payload=b"L" * args.large_bytes,
                                       reply_size=args.large_bytes)
        for i in range(args.large_calls):
            if expired() and i > 0:
                break
            start = time.perf_counter()
            try:
                reply = stubs[i % len(stubs)].Echo(request, timeout=max(args.timeout, 30.0))
                if len(reply.payload) != args.large_bytes:
                    large.failure("SHORT_REPLY", "%d bytes" % len(reply.payload))
                else:
                    large.success(reply.pod, (time.perf_counter() - start) * 1000.0)
            except grpc.RpcError as e:
                # How long it ran tells where it failed: at once (never sent) or mid-call.
                large.failure(e.code().name, "%s (after %.1f ms)" % (
                    e.details() or "", (time.perf_counter() - start) * 1000.0))

    streams = {}

    def run_server_stream():
        count = max(1, args.stream_ms // STREAM_INTERVAL_MS)
        request = echo_pb2.EchoRequest(payload=b"s", count=count, interval_ms=STREAM_INTERVAL_MS)
        res = {"expected": count, "messages": 0, "pods": {}, "code": "OK", "message": ""}
        try:
            for reply in stubs[0].ServerStream(request, timeout=args.stream_ms / 1000.0 + 30.0):
                res["messages"] += 1
                res["pods"][reply.pod] = res["pods"].get(reply.pod, 0) + 1
        except grpc.RpcError as e:
            res["code"], res["message"] = e.code().name, e.details() or ""
        streams["server_stream"] = res

    def run_bidi():
        # Time-bounded, not count-bounded: a busy client sends fewer messages, never a
        # longer stream. `expected` is what was sent.
        res = {"expected": 0, "messages": 0, "pods": {}, "code": "OK", "message": ""}

        def requests():
            end = time.monotonic() + args.bidi_ms / 1000.0
            while True:
                res["expected"] += 1
                yield echo_pb2.EchoRequest(payload=b"b")
                time.sleep(STREAM_INTERVAL_MS / 1000.0)
                if time.monotonic() >= end:
                    return

        try:
            for reply in stubs[0].Bidi(requests(), timeout=args.bidi_ms / 1000.0 + 30.0):
                res["messages"] += 1
                res["pods"][reply.pod] = res["pods"].get(reply.pod, 0) + 1
        except grpc.RpcError as e:
            res["code"], res["message"] = e.code().name, e.details() or ""
        streams["bidi"] = res

    workers = [threading.Thread(target=issue_unary)]
    if args.large_calls:
        workers.append(threading.Thread(target=run_large))
    if args.stream_ms:
        workers.append(threading.Thread(target=run_server_stream))
    if args.bidi_ms:
        workers.append(threading.Thread(target=run_bidi))
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    done.wait()
    elapsed = time.monotonic() - t0
    if args.log:
        with open(args.log, "w") as f:
            f.write("\n".join(log) + "\n")
    if args.json:
        print(json.dumps({
            "client": "grpcio",
            "version": grpc.__version__,
            "start_unix_s": start_unix,
            "elapsed_s": round(elapsed, 3),
            "unary": unary.to_json(),
            "large": large.to_json(),
            "server_stream": streams.get("server_stream"),
            "bidi": streams.get("bidi"),
        }))
    else:
        u = unary.to_json()

        def fmt(d):
            return ",".join("%s:%d" % kv for kv in sorted(d.items())) or "-"

        p50, p99 = u["p50_ms"], u["p99_ms"]
        print("ok=%d p50=%s p99=%s pods=%s errors=%s" % (
            u["ok"], "-" if p50 is None else p50, "-" if p99 is None else p99,
            fmt(u["pods"]), fmt(u["failed"])))
    for c in channels:
        c.close()


if __name__ == "__main__":
    main()
