"""The max-age baseline: the rotation-stress load of a grpcio client against gRPC servers that
rotate their own connections (max connection age), and against skewless's relay doing the same.

Usage: max_age_baseline.py --gen DIR --server KIND[,KIND...] [--runs N] [--duration S]
           [--max-age-ms MS] [--echo BIN] [--proxy BIN] [--proto DIR] [--client PY]
           [--out DIR] [--tap FRAMELOG]

KIND is the server, all on 127.0.0.1, each rotating every connection at --max-age-ms
(default 1000, ±10% jitter): `grpcio` (grpc-core, `grpc.max_connection_age_ms` with a 30 s
grace; testing/py/echo_server.py), `grpc-js` (the same options; testing/node/echo_server.js),
`tonic` (`skewless-echo --max-connection-age-ms`, tonic's max age over hyper/h2), `skewless`
(`skewless-proxy --mode connection --max-connection-age`, the relay of connection mode, in
front of a `skewless-echo` that never rotates). Several KINDs run interleaved, run by run.
Each run starts the server, runs testing/py/echo_client.py against it with the load of
`connection_mode_rotation_every_second_fails_no_grpcio_call` (agent/skewless/tests: 200 unary
calls in flight, each held 250 ms by the server, 10 s deadlines; up to 1,000 4 MiB calls one
after another; a 5 s server stream and a 5 s bidi stream; for --duration seconds, default
60), and ends the processes it started (by PID) whatever happens; the client is bounded at
--duration + 120 s. Prints one line per run (calls, failures with their first error strings,
load average before and after) and a total per KIND; with --out the client's JSON result of
each run is kept there. With --tap (the `skewless-framelog` binary) the client dials a
frame-logging tap in front of the server, and each run also prints what the server sent on
its rotated connections (GOAWAYs and PINGs in order, from the tap's log, kept in --out): a
wire sequence, not a failure rate (the tap adds a hop and falls behind under load).
Binaries: `cargo build -p skewless-echo -p skewless-bench --bin skewless-echo --bin
skewless-proxy` (debug, as the privileged tests run them).
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port, proc, bound_s=20.0):
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError("the server exited with %s before listening" % proc.returncode)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the server did not listen on %d within %.0f s" % (port, bound_s))


SERVERS = ["grpcio", "grpc-js", "tonic", "skewless"]


def server_argvs(args, server, port):
    """The processes that serve `port`, each as (argv, the port it listens on), the last one
    listening on `port`."""
    age = str(args.max_age_ms)
    if server == "grpcio":
        return [([sys.executable, os.path.join(HERE, "echo_server.py"), "--gen", args.gen,
                  "--name", "grpcio-server", "--port", str(port), "--host", "127.0.0.1",
                  "--max-workers", "256", "--max-connection-age-ms", age], port)]
    if server == "grpc-js":
        return [(["node", os.path.join(ROOT, "testing/node/echo_server.js"), "--proto",
                  args.proto, "--name", "grpc-js-server", "--port", str(port),
                  "--max-connection-age-ms", age], port)]
    if server == "tonic":
        return [([args.echo, "--listen", "127.0.0.1:%d" % port, "--name", "tonic-server",
                  "--max-connection-age-ms", age], port)]
    # skewless: connection mode's relay rotating at the max age (as with the annotation
    # `skewless.io/max-connection-age`), in front of a tonic backend that never rotates.
    backend = free_port()
    return [([args.echo, "--listen", "127.0.0.1:%d" % backend, "--name", "tonic-backend"],
             backend),
            ([args.proxy, "--listen", "127.0.0.1:%d" % port, "--endpoint",
              "tonic-backend=127.0.0.1:%d" % backend, "--threads", "2", "--mode", "connection",
              "--max-connection-age", str(args.max_age_ms / 1000.0)], port)]


def client_argv(args, port):
    # The stress test's load (client_bed::rotation_load and ClientSpec::args).
    return [args.client, os.path.join(HERE, "echo_client.py"), "--json", "--gen", args.gen,
            "--target", "127.0.0.1:%d" % port, "--calls", "10000000", "--concurrency", "200",
            "--duration", str(args.duration), "--timeout", "10", "--channels", "1",
            "--payload", "2", "--delay-ms", "250", "--large-calls", "1000",
            "--large-bytes", str(4 * 1024 * 1024), "--stream-ms", "5000", "--bidi-ms", "5000",
            "--keepalive-ms", "0", "--reconnect-backoff-ms", "0"]


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tap_summary(path):
    """Per rotated connection, the server's GOAWAYs and PINGs in order, and the time from the
    first GOAWAY to the first one below 2^31-1 (the final one); the sequences counted, with
    the gap's median and maximum."""
    conns = {}
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") != "frame" or e["dir"] != "to_client":
                continue
            c = conns.setdefault(e["conn"], [])
            if e["kind"] == "GOAWAY":
                last = e["goaway"][0]
                c.append((e["t_ms"], "GOAWAY(%s)" % ("MAX" if last == 2**31 - 1 else "n")))
            elif e["kind"] == "PING" and not e["ping"][0]:
                c.append((e["t_ms"], "PING"))
    shapes, gaps = {}, []
    for seq in conns.values():
        goaways = [t for t, k in seq if k.startswith("GOAWAY")]
        if not goaways:
            continue
        shape = " ".join(k for _, k in seq)
        shapes[shape] = shapes.get(shape, 0) + 1
        final = [t for t, k in seq if k == "GOAWAY(n)"]
        if final:
            gaps.append(final[0] - goaways[0])
    gaps.sort()
    return {"connections": len(conns), "rotated": sum(shapes.values()), "sequences": shapes,
            "first_to_final_goaway_ms": {
                "median": round(gaps[len(gaps) // 2], 1) if gaps else None,
                "max": round(gaps[-1], 1) if gaps else None}}


def one_run(args, server_kind, n):
    port = free_port()
    env = dict(os.environ)
    env.setdefault("NODE_PATH", os.path.expanduser("~/.cache/skewless/node/node_modules"))
    load_before = os.getloadavg()[0]
    procs, tap, tap_log, target_port = [], None, None, port
    try:
        # Each listens before the next starts (the relay's backend before the relay).
        for argv, listen in server_argvs(args, server_kind, port):
            procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, env=env))
            wait_listening(listen, procs[-1])
        if args.tap:
            target_port = free_port()
            tap_log = os.path.join(args.out or "/tmp", "%s-%02d-tap.jsonl" % (server_kind, n))
            tap = subprocess.Popen([args.tap, "--listen", "127.0.0.1:%d" % target_port,
                                    "--upstream", "127.0.0.1:%d" % port, "--log", tap_log],
                                   stdin=subprocess.DEVNULL)
            wait_listening(target_port, tap)
        out = subprocess.run(client_argv(args, target_port), stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=args.duration + 120)
    finally:
        if tap is not None:
            # Its log is flushed per line; give it time to catch up before it ends.
            time.sleep(5)
            stop(tap)
        for proc in reversed(procs):
            stop(proc)
    load_after = os.getloadavg()[0]
    line = next((l for l in reversed(out.stdout.splitlines()) if l.startswith("{")), None)
    if line is None:
        raise RuntimeError("run %d: the client printed no result: %s" % (n, out.stderr[-2000:]))
    result = json.loads(line)
    if args.out:
        with open(os.path.join(args.out, "%s-%02d.json" % (server_kind, n)), "w") as f:
            f.write(line + "\n")
    args.tap_log = tap_log
    return result, (load_before, load_after)


def stream_ok(s):
    return s is not None and s["code"] == "OK" and s["messages"] > 0 and (
        s["messages"] == s["expected"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen", required=True)
    ap.add_argument("--server", required=True,
                    help="one or more of %s, comma-separated (runs interleaved)" % SERVERS)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-age-ms", type=int, default=1000)
    ap.add_argument("--echo", default=os.path.join(ROOT, "target/debug/skewless-echo"))
    ap.add_argument("--proxy", default=os.path.join(ROOT, "target/debug/skewless-proxy"))
    ap.add_argument("--proto", default=os.path.join(ROOT, "proto"))
    ap.add_argument("--client", default=sys.executable)
    ap.add_argument("--out")
    ap.add_argument("--tap")
    args = ap.parse_args()
    servers = args.server.split(",")
    for s in servers:
        if s not in SERVERS:
            ap.error("unknown server %r (one of %s)" % (s, SERVERS))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    totals = {s: {"unary_ok": 0, "unary_failed": 0, "large_ok": 0, "large_failed": 0,
                  "runs_failing": 0, "streams_failed": 0, "errors": {}, "loads": []}
              for s in servers}
    for n in range(1, args.runs + 1):
        for server in servers:
            total = totals[server]
            r, (l0, l1) = one_run(args, server, n)
            u, g = r["unary"], r["large"]
            uf, gf = sum(u["failed"].values()), sum(g["failed"].values())
            bad_streams = [k for k in ("server_stream", "bidi") if not stream_ok(r[k])]
            total["unary_ok"] += u["ok"]
            total["unary_failed"] += uf
            total["large_ok"] += g["ok"]
            total["large_failed"] += gf
            total["streams_failed"] += len(bad_streams)
            total["runs_failing"] += 1 if (uf or gf or bad_streams) else 0
            total["loads"] += [l0, l1]
            # The listed failures (at most 20 per kind of call and run), by status and text.
            for f in u["failures"] + g["failures"]:
                key = "%s: %s" % (f["code"], f["message"].split(" (after")[0])
                total["errors"][key] = total["errors"].get(key, 0) + 1
            print("%s run %d (grpcio %s): unary %d ok, %d failed; 4 MiB %d ok, %d failed %s; "
                  "streams %s; load %.1f -> %.1f" % (
                      server, n, r["version"], u["ok"], uf, g["ok"], gf,
                      [f["code"] + ": " + f["message"] for f in g["failures"]][:3],
                      "ok" if not bad_streams else "FAILED %s" % [r[k] for k in bad_streams],
                      l0, l1), flush=True)
            if u["failures"]:
                print("  unary failures: %s" % u["failures"][:3], flush=True)
            if args.tap:
                print("  tap: %s" % json.dumps(tap_summary(args.tap_log)), flush=True)
    for server in servers:
        t = totals[server]
        print("%s total over %d runs of %.0f s (max age %d ms): unary %d ok, %d failed; "
              "4 MiB %d ok, %d failed; streams failed %d; runs with a failure %d; load average "
              "%.1f-%.1f; listed errors %s" % (
                  server, args.runs, args.duration, args.max_age_ms, t["unary_ok"],
                  t["unary_failed"], t["large_ok"], t["large_failed"], t["streams_failed"],
                  t["runs_failing"], min(t["loads"]), max(t["loads"]), t["errors"]), flush=True)


if __name__ == "__main__":
    main()
