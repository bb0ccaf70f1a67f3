// pg-boss for bench/peers.py: a no-op handler on the queue bench_peers.
//
//   node pgboss_worker.mjs setup URL                     start(): the pgboss schema; createQueue(bench_peers)
//   node pgboss_worker.mjs enqueue URL N                 N jobs in one insert() call (one INSERT statement)
//   node pgboss_worker.mjs work URL [BATCH [INTERVAL_S]] start() and work(), until SIGTERM
//
// URL is a postgresql:// connection string. `enqueue` prints "enqueued N" once the jobs are committed
// (the bench's clock starts there). `work` prints "ready" once its work() loop runs. pg-boss's
// constructor options are its defaults (pool of 10, supervise, schedule, migrate); work() takes
// batchSize BATCH (pg-boss: 1) and pollingIntervalSeconds INTERVAL_S (pg-boss: 2, at least 0.5).
// pg-boss has no LISTEN: each work() loop fetches a batch, runs the handler on it, and then waits
// out the rest of the interval whether it found jobs or not, so one loop does at most BATCH jobs a
// poll.
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

async function work(connectionString, batchSize, intervalS) {
  const boss = await open(connectionString);
  const options = {};
  if (batchSize !== undefined) options.batchSize = batchSize;
  if (intervalS !== undefined) options.pollingIntervalSeconds = intervalS;
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
    throw new Error(`${what} must be a positive ${integer ? "integer" : "number"}, got ${JSON.stringify(text)}`);
  }
  return value;
}

const [command, url, arg, arg2] = process.argv.slice(2);
const commands = {
  setup: () => setup(url),
  enqueue: () => enqueue(url, positive(arg, "N", true)),
  work: () =>
    work(
      url,
      arg === undefined ? undefined : positive(arg, "BATCH", true),
      arg2 === undefined ? undefined : positive(arg2, "INTERVAL_S", false),
    ),
};
if (!commands[command] || !url) {
  console.error("usage: node pgboss_worker.mjs setup|enqueue|work URL [N | BATCH [INTERVAL_S]]");
  process.exit(2);
}
commands[command]().catch((err) => {
  console.error(err);
  process.exit(1);
});
