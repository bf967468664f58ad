// Echo gRPC server (@grpc/grpc-js) with the same four methods and replies as
// testing/py/echo_server.py and skewless-echo: every reply names this server.
//
// Usage: node echo_server.js --proto DIR --name NAME --port PORT [--max-connection-age-ms MS]
//
// With --max-connection-age-ms each connection gets grpc-js's max-age GOAWAY once it is that
// old (±10% jitter, `grpc.max_connection_age_ms`), with 30 s for its calls to finish
// (`grpc.max_connection_age_grace_ms`): a server rotating its own connections, for the
// max-age baseline (testing/py/max_age_baseline.py). Modules come from NODE_PATH (`cargo xtask
// setup` installs them into ~/.cache/skewless/node). Listens on 127.0.0.1 only.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const MAX_MESSAGE = 64 * 1024 * 1024;

function parseArgs(argv) {
  const args = { proto: null, name: 'echo', port: 0, 'max-connection-age-ms': 0 };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, '');
    if (!(key in args) || i + 1 >= argv.length) {
      throw new Error(`unknown or incomplete argument ${argv[i]}`);
    }
    args[key] = (key === 'proto' || key === 'name') ? argv[i + 1] : Number(argv[i + 1]);
  }
  if (!args.proto || !args.port) throw new Error('--proto and --port are required');
  return args;
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const def = protoLoader.loadSync(path.join(args.proto, 'skewless/echo/v1/echo.proto'), {
    keepCase: true, longs: Number, defaults: true,
  });
  const { Echo } = grpc.loadPackageDefinition(def).skewless.echo.v1;
  const reply = (req) => ({
    payload: req.reply_size ? Buffer.alloc(req.reply_size, 'x') : req.payload,
    pod: args.name,
  });
  const later = (ms, f) => (ms ? setTimeout(f, ms) : f());
  const handlers = {
    Echo: (call, cb) => later(call.request.delay_ms, () => cb(null, reply(call.request))),
    ServerStream: (call) => {
      const req = call.request;
      let sent = 0;
      const next = () => {
        if (sent >= req.count || call.cancelled) {
          call.end();
          return;
        }
        call.write(reply(req));
        sent += 1;
        later(sent < req.count ? req.interval_ms : 0, next);
      };
      later(req.delay_ms, next);
    },
    ClientStream: (call, cb) => {
      const parts = [];
      let last = null;
      call.on('data', (req) => {
        parts.push(req.payload);
        last = req;
      });
      call.on('end', () => later(last ? last.delay_ms : 0,
        () => cb(null, { payload: Buffer.concat(parts), pod: args.name })));
    },
    Bidi: (call) => {
      call.on('data', (req) => later(req.delay_ms, () => call.write(reply(req))));
      call.on('end', () => call.end());
    },
  };
  const options = {
    'grpc.max_receive_message_length': MAX_MESSAGE,
    'grpc.max_send_message_length': MAX_MESSAGE,
  };
  if (args['max-connection-age-ms']) {
    options['grpc.max_connection_age_ms'] = args['max-connection-age-ms'];
    options['grpc.max_connection_age_grace_ms'] = 30000;
  }
  const server = new grpc.Server(options);
  server.addService(Echo.service, handlers);
  server.bindAsync(`127.0.0.1:${args.port}`, grpc.ServerCredentials.createInsecure(), (err) => {
    if (err) {
      process.stderr.write(`bind failed: ${err.message}\n`);
      process.exit(1);
    }
  });
  const stop = () => server.tryShutdown(() => process.exit(0));
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

main();
