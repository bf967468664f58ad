// Echo gRPC client (@grpc/grpc-js) for the real-client tests: the same flags and the same JSON
// result (testing/clients' ClientResult) as testing/py/echo_client.py.
//
// Usage: node echo_client.js --proto DIR --target HOST:PORT [--calls N] [--concurrency C]
//            [--duration S] [--timeout S] [--channels K] [--payload BYTES] [--delay-ms MS]
//            [--large-calls N]
//            [--large-bytes BYTES] [--stream-ms MS] [--bidi-ms MS] [--keepalive-ms MS]
//            [--reconnect-backoff-ms MS]
//
// A grpc-js Client's channel uses pick_first by default: one HTTP/2 connection to the one
// address the target resolves to. With --channels K, K clients, each with its own channel (and
// `grpc.use_local_subchannel_pool`, so each its own connection). Modules come from NODE_PATH
// (`cargo xtask setup` installs them into ~/.cache/skewless/node).
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const STREAM_INTERVAL_MS = 50;
const MAX_MESSAGE = 64 * 1024 * 1024;
const MAX_LISTED_FAILURES = 20;

function parseArgs(argv) {
  const args = {
    proto: null, target: null, calls: 200, concurrency: 4, duration: 0, timeout: 5,
    channels: 1, payload: 2, 'delay-ms': 0, 'large-calls': 0, 'large-bytes': 4 * 1024 * 1024,
    'stream-ms': 0, 'bidi-ms': 0, 'keepalive-ms': 0, 'reconnect-backoff-ms': 0,
  };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, '');
    if (!(key in args) || i + 1 >= argv.length) {
      throw new Error(`unknown or incomplete argument ${argv[i]}`);
    }
    args[key] = (key === 'proto' || key === 'target') ? argv[i + 1] : Number(argv[i + 1]);
  }
  if (!args.proto || !args.target) throw new Error('--proto and --target are required');
  return args;
}

const codeNames = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

class Tally {
  constructor(t0) {
    this.t0 = t0;
    this.ok = 0;
    this.pods = {};
    this.firstSeen = {};
    this.perSecond = [];
    this.failed = {};
    this.failures = [];
    this.latencies = [];
  }

  now() {
    return Number(process.hrtime.bigint() - this.t0) / 1e9;
  }

  success(pod, latencyMs) {
    const now = this.now();
    this.ok += 1;
    this.pods[pod] = (this.pods[pod] || 0) + 1;
    if (!(pod in this.firstSeen)) this.firstSeen[pod] = Math.round(now * 1000) / 1000;
    const sec = Math.floor(now);
    while (this.perSecond.length <= sec) this.perSecond.push({});
    this.perSecond[sec][pod] = (this.perSecond[sec][pod] || 0) + 1;
    this.latencies.push(latencyMs);
  }

  failure(code, message) {
    this.failed[code] = (this.failed[code] || 0) + 1;
    if (this.failures.length < MAX_LISTED_FAILURES) {
      this.failures.push({ at_s: Math.round(this.now() * 1000) / 1000, code, message });
    }
  }

  toJSON() {
    const lat = [...this.latencies].sort((a, b) => a - b);
    const pct = (p) => (lat.length === 0 ? null
      : Math.round(lat[Math.min(lat.length - 1, Math.floor(p * lat.length))] * 1000) / 1000);
    return {
      ok: this.ok,
      pods: this.pods,
      first_seen_s: this.firstSeen,
      per_second: this.perSecond,
      failed: this.failed,
      failures: this.failures,
      p50_ms: pct(0.5),
      p99_ms: pct(0.99),
    };
  }
}

function deadlineIn(seconds) {
  return new Date(Date.now() + seconds * 1000);
}

function statusName(err) {
  return codeNames[err.code] || `UNKNOWN_${err.code}`;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const def = protoLoader.loadSync(path.join(args.proto, 'skewless/echo/v1/echo.proto'), {
    keepCase: true, longs: Number, defaults: true,
  });
  const { Echo } = grpc.loadPackageDefinition(def).skewless.echo.v1;
  const options = {
    'grpc.max_receive_message_length': MAX_MESSAGE,
    'grpc.max_send_message_length': MAX_MESSAGE,
  };
  if (args.channels > 1) options['grpc.use_local_subchannel_pool'] = 1;
  if (args['reconnect-backoff-ms']) {
    options['grpc.initial_reconnect_backoff_ms'] = args['reconnect-backoff-ms'];
    options['grpc.max_reconnect_backoff_ms'] = args['reconnect-backoff-ms'];
  }
  if (args['keepalive-ms']) {
    options['grpc.keepalive_time_ms'] = args['keepalive-ms'];
    options['grpc.keepalive_timeout_ms'] = 20000;
    options['grpc.keepalive_permit_without_calls'] = 1;
  }
  const clients = [];
  for (let i = 0; i < Math.max(1, args.channels); i += 1) {
    clients.push(new Echo(args.target, grpc.credentials.createInsecure(), options));
  }
  const t0 = process.hrtime.bigint();
  const startUnix = Date.now() / 1000;
  const elapsed = () => Number(process.hrtime.bigint() - t0) / 1e9;
  const expired = () => args.duration > 0 && elapsed() >= args.duration;
  const unary = new Tally(t0);
  const large = new Tally(t0);

  const unaryCall = (client, request, timeoutS, tally, check) => new Promise((resolve) => {
    const start = process.hrtime.bigint();
    client.Echo(request, { deadline: deadlineIn(timeoutS) }, (err, reply) => {
      if (err) {
        tally.failure(statusName(err), err.details || '');
      } else if (check && !check(reply)) {
        tally.failure('SHORT_REPLY', `${reply.payload.length} bytes`);
      } else {
        tally.success(reply.pod, Number(process.hrtime.bigint() - start) / 1e6);
      }
      resolve();
    });
  });

  let issued = 0;
  const unaryWorker = async () => {
    const request = { payload: Buffer.alloc(args.payload, 'h'), delay_ms: args['delay-ms'] };
    while (issued < args.calls && !expired()) {
      const client = clients[issued % clients.length];
      issued += 1;
      await unaryCall(client, request, args.timeout, unary);
    }
  };

  const runLarge = async () => {
    const n = args['large-bytes'];
    const request = { payload: Buffer.alloc(n, 'L'), reply_size: n };
    for (let i = 0; i < args['large-calls']; i += 1) {
      if (i > 0 && expired()) break;
      await unaryCall(clients[i % clients.length], request, Math.max(args.timeout, 30), large,
        (reply) => reply.payload.length === n);
    }
  };

  const collect = (call, res, resolve) => {
    call.on('data', (reply) => {
      res.messages += 1;
      res.pods[reply.pod] = (res.pods[reply.pod] || 0) + 1;
    });
    call.on('error', (err) => {
      res.code = statusName(err);
      res.message = err.details || '';
    });
    call.on('status', () => resolve(res));
  };

  const runServerStream = () => new Promise((resolve) => {
    const count = Math.max(1, Math.floor(args['stream-ms'] / STREAM_INTERVAL_MS));
    const res = { expected: count, messages: 0, pods: {}, code: 'OK', message: '' };
    const call = clients[0].ServerStream(
      { payload: Buffer.from('s'), count, interval_ms: STREAM_INTERVAL_MS },
      { deadline: deadlineIn(args['stream-ms'] / 1000 + 30) },
    );
    collect(call, res, resolve);
  });

  // Time-bounded, not count-bounded: a busy client sends fewer messages, never a longer
  // stream. `expected` is what was sent.
  const runBidi = () => new Promise((resolve) => {
    const res = { expected: 0, messages: 0, pods: {}, code: 'OK', message: '' };
    const call = clients[0].Bidi({ deadline: deadlineIn(args['bidi-ms'] / 1000 + 30) });
    collect(call, res, resolve);
    const end = elapsed() + args['bidi-ms'] / 1000;
    const tick = () => {
      res.expected += 1;
      call.write({ payload: Buffer.from('b') });
      if (elapsed() + STREAM_INTERVAL_MS / 1000 >= end) {
        call.end();
        return;
      }
      setTimeout(tick, STREAM_INTERVAL_MS);
    };
    tick();
  });

  const work = [];
  for (let i = 0; i < Math.max(1, args.concurrency); i += 1) work.push(unaryWorker());
  if (args['large-calls']) work.push(runLarge());
  const serverStream = args['stream-ms'] ? runServerStream() : Promise.resolve(null);
  const bidi = args['bidi-ms'] ? runBidi() : Promise.resolve(null);
  await Promise.all(work);
  const [ss, bd] = await Promise.all([serverStream, bidi]);
  const total = elapsed();
  const version = require('@grpc/grpc-js/package.json').version;
  process.stdout.write(`${JSON.stringify({
    client: 'grpc-js',
    version,
    start_unix_s: startUnix,
    elapsed_s: Math.round(total * 1000) / 1000,
    unary,
    large,
    server_stream: ss,
    bidi: bd,
  })}\n`);
  for (const c of clients) c.close();
}

main().catch((err) => {
  process.stderr.write(`echo_client.js: ${err.stack || err}\n`);
  process.exit(2);
});
