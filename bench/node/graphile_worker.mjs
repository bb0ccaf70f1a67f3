// graphile-worker for bench/peers.py: a no-op task run with graphile-worker's defaults.
//
//   node graphile_worker.mjs setup URL               runMigrations(): the graphile_worker schema
//   node graphile_worker.mjs enqueue URL N           N jobs in one addJobs() call (one add_jobs statement)
//   node graphile_worker.mjs work URL [CONCURRENCY]  run() with taskList { bench_noop }, until SIGTERM
//
// URL is a postgresql:// connection string. `enqueue` prints "enqueued N" once the jobs are committed
// (the bench's clock starts there), then releases its pool. `work` prints "ready" once the worker pool
// is listening. Worker options are graphile-worker's defaults (concurrency 1, pollInterval 2000 ms,
// pool of 10, prepared statements), but for CONCURRENCY and the logger: warnings and errors only, as
// the bench's Python workers log (graphile-worker's default logger writes a line per job at info).
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

async function work(connectionString, concurrency) {
  const options = {
    connectionString,
    logger,
    noHandleSignals: true, // handled below: stop, then exit 0 (its own handler re-raises the signal)
    parsedCronItems: [],
    taskList: { [TASK]: async () => {} },
  };
  if (concurrency !== undefined) {
    options.concurrency = concurrency;
  }
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

function positiveInt(text, what) {
  const value = Number(text);
  if (!Number.isInteger(value) || value < 1) {
    throw new Error(`${what} must be a positive integer, got ${JSON.stringify(text)}`);
  }
  return value;
}

const [command, url, arg] = process.argv.slice(2);
const commands = {
  setup: () => setup(url),
  enqueue: () => enqueue(url, positiveInt(arg, "N")),
  work: () => work(url, arg === undefined ? undefined : positiveInt(arg, "CONCURRENCY")),
};
if (!commands[command] || !url) {
  console.error("usage: node graphile_worker.mjs setup|enqueue|work URL [N|CONCURRENCY]");
  process.exit(2);
}
commands[command]().catch((err) => {
  console.error(err);
  process.exit(1);
});
