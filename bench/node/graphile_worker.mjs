// graphile-worker for bench/peers.py: a no-op task, with graphile-worker's defaults or the OPTIONS below.
//
//   node graphile_worker.mjs setup URL          runMigrations(): the graphile_worker schema
//   node graphile_worker.mjs enqueue URL N      N jobs in one addJobs() call (one add_jobs statement)
//   node graphile_worker.mjs work URL [OPTIONS] run() with taskList { bench_noop }, until SIGTERM
//
// URL is a postgresql:// connection string. `enqueue` prints "enqueued N" once the jobs are committed
// (the bench's clock starts there), then releases its pool. `work` prints "ready" once the worker pool
// is listening. Worker options are graphile-worker's defaults (concurrency 1, pollInterval 2000 ms,
// pool of 10, prepared statements, no local queue, no batched completion), but for OPTIONS and the
// logger: warnings and errors only, as the bench's Python workers log (graphile-worker's default
// logger writes a line per job at info). OPTIONS set the preset's worker options of the same names:
//
//   --concurrency N (concurrentJobs; the CLI's --jobs)   --max-pool-size N
//   --local-queue-size N (localQueue.size)               --complete-job-batch-delay MS
//   --fail-job-batch-delay MS
import { parseArgs } from "node:util";

import graphileWorker from "graphile-worker";

const { Logger, makeWorkerUtils, run, runMigrations } = graphileWorker;
const TASK = "bench_noop";

const logger = new Logger(() => (level, message) => {
  if (level === "error" || level === "warning") {
    console.error(`[graphile-worker ${level}] ${message}`);
  }
});

async function setup(connectionString) {
  await runMigrations({ connectionString, logger });
}

async function enqueue(connectionString, jobs) {
  const utils = await makeWorkerUtils({ connectionString, logger });
  try {
    const specs = Array.from({ length: jobs }, () => ({ identifier: TASK, payload: {} }));
    const added = await utils.addJobs(specs);
    console.log(`enqueued ${added.length}`);
  } finally {
    await utils.release();
  }
}

async function work(connectionString, settings) {
  const worker = {};
  if (settings.concurrency !== undefined) worker.concurrentJobs = settings.concurrency;
  if (settings.maxPoolSize !== undefined) worker.maxPoolSize = settings.maxPoolSize;
  if (settings.localQueueSize !== undefined) worker.localQueue = { size: settings.localQueueSize };
  if (settings.completeJobBatchDelay !== undefined) {
    worker.completeJobBatchDelay = settings.completeJobBatchDelay;
  }
  if (settings.failJobBatchDelay !== undefined) worker.failJobBatchDelay = settings.failJobBatchDelay;
  const options = {
    connectionString,
    logger,
    noHandleSignals: true, // handled below: stop, then exit 0 (its own handler re-raises the signal)
    parsedCronItems: [],
    preset: { worker },
    taskList: { [TASK]: async () => {} },
  };
  const runner = await run(options);
  let stopping = false;
  for (const signal of ["SIGTERM", "SIGINT"]) {
    process.on(signal, () => {
      if (stopping) return;
      stopping = true;
      runner.stop().then(
        () => process.exit(0),
        (err) => {
          console.error(err);
          process.exit(1);
        },
      );
    });
  }
  console.log("ready");
  await runner.promise;
}

function integer(text, what, least) {
  const value = Number(text);
  if (!Number.isInteger(value) || value < least) {
    throw new Error(`${what} must be an integer >= ${least}, got ${JSON.stringify(text)}`);
  }
  return value;
}

function workSettings(args) {
  const { values } = parseArgs({
    args,
    strict: true,
    options: {
      concurrency: { type: "string" },
      "max-pool-size": { type: "string" },
      "local-queue-size": { type: "string" },
      "complete-job-batch-delay": { type: "string" },
      "fail-job-batch-delay": { type: "string" },
    },
  });
  const read = (name, least) =>
    values[name] === undefined ? undefined : integer(values[name], `--${name}`, least);
  return {
    concurrency: read("concurrency", 1),
    maxPoolSize: read("max-pool-size", 2),
    localQueueSize: read("local-queue-size", 1),
    completeJobBatchDelay: read("complete-job-batch-delay", 0),
    failJobBatchDelay: read("fail-job-batch-delay", 0),
  };
}

const [command, url, ...rest] = process.argv.slice(2);
const commands = {
  setup: async () => setup(url),
  enqueue: async () => enqueue(url, integer(rest[0], "N", 1)),
  work: async () => work(url, workSettings(rest)),
};
if (!commands[command] || !url) {
  console.error("usage: node graphile_worker.mjs setup|enqueue|work URL [N | OPTIONS]");
  process.exit(2);
}
commands[command]().catch((err) => {
  console.error(err);
  process.exit(1);
});
