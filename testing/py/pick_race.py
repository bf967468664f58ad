"""grpc-core's pick race at a GOAWAY, in isolation: one grpcio channel (pick_first) whose
threads each start unary calls back to back, every request --bytes long, against a server that
rotates its connections at a 1 s max age (the servers of max_age_baseline.py: `skewless`, the
relay of connection mode, or `grpcio`, grpc-core's own max age).

Usage: pick_race.py --gen DIR --server KIND[,KIND...] --bytes N[,N...] [--threads T]
           [--duration S] [--runs R] [--echo BIN] [--proxy BIN]

A call whose request is larger than grpc-core's per-call retry buffer (256 KiB) is committed
when it starts and never retried transparently; a smaller one is. grpc-core cancels a call
that reaches the transport after the transport read any GOAWAY (UNAVAILABLE "GOAWAY
received", not sent on the wire), and the subchannel keeps handing new calls to that
transport until its OnDisconnect ran on another thread. So the failures of the large calls
count the picks that fell into that window, whatever the server sent; the small calls show
that the same picks are retried when the call is not committed. Each (KIND, N) pair runs R
times, interleaved. Prints one line per run: calls, failures with their first error, the
load average. Every process it starts is ended by PID; each run is bounded in time.
"""
import argparse
import os
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import max_age_baseline  # noqa: E402  (same directory: its servers and process handling)

MAX_MESSAGE = 64 * 1024 * 1024


def run_client(args, port, size):
    import grpc
    from skewless.echo.v1 import echo_pb2, echo_pb2_grpc

    channel = grpc.insecure_channel("127.0.0.1:%d" % port, options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 100)])
    stub = echo_pb2_grpc.EchoStub(channel)
    request = echo_pb2.EchoRequest(payload=b"P" * size, reply_size=1)
    lock = threading.Lock()
    tally = {"ok": 0, "failed": {}, "first": []}
    end = time.monotonic() + args.duration

    def loop():
        while time.monotonic() < end:
            start = time.perf_counter()
            try:
                stub.Echo(request, timeout=10)
                with lock:
                    tally["ok"] += 1
            except grpc.RpcError as e:
                key = "%s %s" % (e.code().name, (e.details() or "")[:90])
                with lock:
                    tally["failed"][key] = tally["failed"].get(key, 0) + 1
                    if len(tally["first"]) < 3:
                        tally["first"].append("%s (after %.1f ms)" % (
                            key, (time.perf_counter() - start) * 1000.0))

    threads = [threading.Thread(target=loop) for _ in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    channel.close()
    return tally


def one_run(args, kind, size):
    port = max_age_baseline.free_port()
    procs = []
    load = os.getloadavg()[0]
    try:
        for argv, listen in max_age_baseline.server_argvs(args, kind, port):
            procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            max_age_baseline.wait_listening(listen, procs[-1])
        tally = run_client(args, port, size)
    finally:
        for proc in reversed(procs):
            max_age_baseline.stop(proc)
    return tally, (load, os.getloadavg()[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--bytes", required=True)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--max-age-ms", type=int, default=1000)
    root = max_age_baseline.ROOT
    ap.add_argument("--echo", default=os.path.join(root, "target/debug/skewless-echo"))
    ap.add_argument("--proxy", default=os.path.join(root, "target/debug/skewless-proxy"))
    ap.add_argument("--proto", default=os.path.join(root, "proto"))
    args = ap.parse_args()
    if args.duration <= 0 or args.duration > 600:
        raise SystemExit("--duration must be in (0, 600] seconds")
    sys.path.insert(0, args.gen)
    kinds = args.server.split(",")
    sizes = [int(b) for b in args.bytes.split(",")]
    totals = {}
    for n in range(args.runs):
        for kind in kinds:
            for size in sizes:
                tally, (l0, l1) = one_run(args, kind, size)
                failed = sum(tally["failed"].values())
                t = totals.setdefault((kind, size), [0, 0])
                t[0] += tally["ok"] + failed
                t[1] += failed
                print("run %d %s %d bytes x %d threads: %d calls, %d failed %s; load %.1f -> %.1f"
                      % (n, kind, size, args.threads, tally["ok"] + failed, failed,
                         tally["first"], l0, l1), flush=True)
    for (kind, size), (calls, failed) in totals.items():
        print("total %s %d bytes: %d of %d calls failed" % (kind, size, failed, calls))


if __name__ == "__main__":
    main()
