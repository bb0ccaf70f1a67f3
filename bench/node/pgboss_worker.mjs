// pg-boss for bench/peers.py: a no-op handler on the queue bench_peers.
//
//   node pgboss_worker.mjs setup URL          start(): the pgboss schema; createQueue(bench_peers)
//   node pgboss_worker.mjs enqueue URL N      N jobs in one insert() call (one INSERT statement)
//   node pgboss_worker.mjs work URL [OPTIONS] start() and work(), until SIGTERM
//
// URL is a postgresql:// connection string. `enqueue` prints "enqueued N" once the jobs are committed
// (the bench's clock starts there). `work` prints "ready" once its work() loop runs. pg-boss's
// constructor options are its defaults (pool of 10, supervise, schedule, migrate); OPTIONS set
// work()'s options of the same names:
//
//   --batch-size N (pg-boss: 1)   --polling-interval-seconds S (pg-boss: 2, at least 0.5)
//
// pg-boss has no LISTEN: each work() loop fetches a batch, runs the handler on it, and then waits
// out the rest of the interval whether it found jobs or not, so one loop does at most batchSize jobs
// a poll.
import { parseArgs } from "node:util";

import PgBoss from "pg-boss";

const QUEUE = "bench_peers";

async function open(connectionString) {
  const boss = new PgBoss({ connectionString });
  boss.on("error", (err) => console.error(`[pg-boss error] ${err?.stack ?? err}`));
  await boss.start();
  return boss;
}

async function setup(connectionString) {
  const boss = await open(connectionString);
  await boss.createQueue(QUEUE);
  await boss.stop({ graceful: false, wait: true });
}

async function enqueue(connectionString, jobs) {
  // No maintenance, cron nor migration in this short-lived process: those are the workers' job.
  const boss = new PgBoss({ connectionString, supervise: false, schedule: false, migrate: false });
  boss.on("error", (err) => console.error(`[pg-boss error] ${err?.stack ?? err}`));
  await boss.start();
  try {
    await boss.insert(Array.from({ length: jobs }, () => ({ name: QUEUE, data: {} })));
    console.log(`enqueued ${jobs}`);
  } finally {
    await boss.stop({ graceful: false });
  }
}

async function work(connectionString, options) {
  const boss = await open(connectionString);
  await boss.work(QUEUE, options, async () => {});
  let stopping = false;
  for (const signal of ["SIGTERM", "SIGINT"]) {
    process.on(signal, () => {
      if (stopping) return;
      stopping = true;
      boss.stop({ graceful: true, timeout: 5000 }).then(
        () => process.exit(0),
        (err) => {
          console.error(err);
          process.exit(1);
        },
      );
    });
  }
  console.log("ready");
}

function positive(text, what, integer) {
  const value = Number(text);
  if (!(value > 0) || (integer && !Number.isInteger(value))) {
    const kind = integer ? "integer" : "number";
    throw new Error(`${what} must be a positive ${kind}, got ${JSON.stringify(text)}`);
  }
  return value;
}

function workOptions(args) {
  const { values } = parseArgs({
    args,
    strict: true,
    options: { "batch-size": { type: "string" }, "polling-interval-seconds": { type: "string" } },
  });
  const options = {};
  if (values["batch-size"] !== undefined) {
    options.batchSize = positive(values["batch-size"], "--batch-size", true);
  }
  if (values["polling-interval-seconds"] !== undefined) {
    const seconds = values["polling-interval-seconds"];
    options.pollingIntervalSeconds = positive(seconds, "--polling-interval-seconds", false);
  }
  return options;
}

const [command, url, ...rest] = process.argv.slice(2);
const commands = {
  setup: async () => setup(url),
  enqueue: async () => enqueue(url, positive(rest[0], "N", true)),
  work: async () => work(url, workOptions(rest)),
};
if (!commands[command] || !url) {
  console.error("usage: node pgboss_worker.mjs setup|enqueue|work URL [N | OPTIONS]");
  process.exit(2);
}
commands[command]().catch((err) => {
  console.error(err);
  process.exit(1);
});
