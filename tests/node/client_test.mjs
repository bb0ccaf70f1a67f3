// pglockkit from Node.js, with no Python involved: proof that any client can use it.
//
//   cd tests/node && npm ci                      # the one dependency: `pg`, pinned by package-lock.json
//   PGLOCKKIT_DSN=postgresql://user@host:5432/db node tests/node/client_test.mjs
//
// The database needs pglockkit installed (`pglockkit install`, or `psql -f sql/pglockkit.sql`).
// The script registers namespaces ns-*, billing and graphs, and uses the queue `node-client` and
// leases `node-client:*`: run it against a scratch database (tests/test_node_client.py gives it
// a fresh one on each test server).
//
// It checks:
//   1. lock keys computed locally in JavaScript (the formula below, BigInt + node:crypto) against
//      every row of tests/vectors/lock_keys.json, and against SELECT pglockkit.lock_key(...);
//   2. a transaction lock shows up in pg_locks under the classid/objid computed from the local key;
//   3. the job queue: enqueue_job, claim_job, complete_job, and a stale token refused after the
//      job was given back and after its lease expired and another worker reclaimed it;
//   4. leases: acquire_lease, check_fence passing with the live token and raising SQLSTATE PK001
//      with a stale one (rolling back the write it guarded).
// Each check prints "ok N - ..."; the last line is "all checks passed". Any failure prints
// "not ok N - ..." and exits 1.

import assert from 'node:assert/strict';
import { createHash, randomUUID } from 'node:crypto';
import { readFileSync } from 'node:fs';
import pg from 'pg';

// ---------------------------------------------------------------------------------------------
// Lock keys: the pglockkit contract, in JavaScript.
//   text resource:    key = (ns_id << 48) | (1 << 47) | h47(resource)
//                     h47 = first 6 bytes of sha256(UTF-8 bytes of resource), big-endian, >> 1
//   integer resource: key = (ns_id << 48) | id        with 0 <= id < 2^47, else error
//   derived ns id:    first 2 bytes of sha256(UTF-8 name), big-endian, mod 32767, plus 1
// Keys exceed 2^53: use BigInt, never Number.
// ---------------------------------------------------------------------------------------------

const TEXT_FLAG = 1n << 47n;
const INT_RESOURCE_LIMIT = 1n << 47n;

function sha256(text) {
  // Buffer.from(text, 'utf8') encodes the UTF-16 string as UTF-8 (surrogate pairs become one
  // 4-byte sequence): hash the bytes, not the characters.
  return createHash('sha256').update(Buffer.from(text, 'utf8')).digest();
}

export function namespaceId(name) {
  return (sha256(name).readUInt16BE(0) % 32767) + 1;
}

export function lockKey(nsId, resource) {
  if (!Number.isInteger(nsId) || nsId < 1 || nsId > 32767) {
    throw new RangeError(`namespace id ${nsId} is out of range (1..32767)`);
  }
  const high = BigInt(nsId) << 48n;
  if (typeof resource === 'string') {
    if (resource.includes('\0')) throw new RangeError('a resource cannot contain NUL');
    const h47 = BigInt('0x' + sha256(resource).subarray(0, 6).toString('hex')) >> 1n;
    return high | TEXT_FLAG | h47;
  }
  if (typeof resource !== 'bigint') throw new TypeError('resource must be a string or a BigInt');
  if (resource < 0n || resource >= INT_RESOURCE_LIMIT) {
    throw new RangeError(`integer resource ${resource} is out of range (0 <= id < 2^47)`);
  }
  return high | resource;
}

// ---------------------------------------------------------------------------------------------

const dsn = process.env.PGLOCKKIT_DSN;
if (!dsn) {
  console.error('set PGLOCKKIT_DSN to a postgresql:// URL of a database with pglockkit installed');
  process.exit(2);
}
const vectorsFile = new URL('../vectors/lock_keys.json', import.meta.url);
const vectors = JSON.parse(readFileSync(vectorsFile, 'utf8')).vectors;
const resourceOf = (row) => (row.resource_type === 'text' ? row.resource : BigInt(row.resource));
const label = (row) => `${row.namespace}/${JSON.stringify(row.resource).slice(0, 40)} (${row.note})`;

const connect = async () => {
  const client = new pg.Client({ connectionString: dsn, statement_timeout: 10000, connectionTimeoutMillis: 10000 });
  await client.connect();
  return client;
};
const one = async (client, sql, params = []) => (await client.query(sql, params)).rows[0];
const sqlstateOf = async (promise) => {
  try {
    await promise;
  } catch (err) {
    return err.code;
  }
  return null;
};
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

let n = 0;
async function check(name, fn) {
  n += 1;
  try {
    const detail = await fn();
    console.log(`ok ${n} - ${name}${detail ? `: ${detail}` : ''}`);
  } catch (err) {
    console.log(`not ok ${n} - ${name}`);
    console.log(String(err.stack || err).replace(/^/gm, '#   '));
    process.exit(1);
  }
}

const db = await connect();
const other = await connect(); // a second session: another worker, another pod

await check('local JavaScript keys match every vector in the file', () => {
  const failures = [];
  for (const row of vectors) {
    if (row.derived_id && namespaceId(row.namespace) !== row.namespace_id) {
      failures.push(`namespaceId(${row.namespace}) = ${namespaceId(row.namespace)}, file ${row.namespace_id}`);
    }
    let got;
    try {
      got = lockKey(row.namespace_id, resourceOf(row)).toString();
    } catch (err) {
      if (!(err instanceof RangeError)) throw err;
      got = '22003';
    }
    const want = row.key ?? row.error;
    if (got !== want) failures.push(`${label(row)}: javascript ${got}, file ${want}`);
  }
  assert.deepEqual(failures, []);
  const keys = vectors.filter((r) => r.key).length;
  return `${keys} keys, ${vectors.length - keys} out-of-range integers refused`;
});

await check('the server computes the same keys (SELECT pglockkit.lock_key)', async () => {
  const namespaces = new Map(vectors.map((r) => [r.namespace, r]));
  for (const [name, row] of namespaces) {
    const { id } = await one(db, 'SELECT pglockkit.register_namespace($1, $2) AS id', [
      name,
      row.derived_id ? null : row.namespace_id,
    ]);
    assert.equal(id, row.namespace_id, `register_namespace(${name})`);
  }
  const failures = [];
  for (const row of vectors) {
    const cast = row.resource_type === 'text' ? 'text' : 'bigint';
    let got;
    try {
      got = (await one(db, `SELECT pglockkit.lock_key($1, $2::${cast}) AS key`, [row.namespace, row.resource])).key;
    } catch (err) {
      got = err.code;
    }
    if (got !== (row.key ?? row.error)) failures.push(`${label(row)}: server ${got}, file ${row.key ?? row.error}`);
  }
  // A resource no file holds: the local formula, not a lookup, must agree with the server.
  const fresh = `node:${randomUUID()}:\u00e9\u{1f512}`;
  const { key } = await one(db, "SELECT pglockkit.lock_key('billing', $1::text) AS key", [fresh]);
  if (key !== lockKey(42, fresh).toString()) failures.push(`fresh resource ${fresh}: server ${key}`);
  assert.deepEqual(failures, []);
  return `${vectors.length} vectors and a fresh resource`;
});

await check('a transaction lock appears in pg_locks under the locally computed key', async () => {
  const key = lockKey(namespaceId('graphs'), 'restock_plan');
  await db.query('BEGIN');
  try {
    const taken = await one(db, "SELECT pglockkit.xact_lock('graphs', 'restock_plan', '1s') AS key");
    assert.equal(BigInt(taken.key), key);
    const lock = await one(
      db,
      `SELECT classid::text, objid::text, objsubid FROM pg_locks
        WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted`,
    );
    assert.deepEqual(lock, { classid: (key >> 32n).toString(), objid: (key & 0xffffffffn).toString(), objsubid: 1 });
    // Another session cannot take it meanwhile.
    assert.equal((await one(other, "SELECT pglockkit.try_xact_lock('graphs', 'restock_plan') AS ok")).ok, false);
  } finally {
    await db.query('COMMIT');
  }
  assert.equal((await one(other, "SELECT pglockkit.try_xact_lock('graphs', 'restock_plan') AS ok")).ok, true);
  return `key ${key} = classid ${key >> 32n}, objid ${key & 0xffffffffn}`;
});

await check('job queue: enqueue_job, claim_job, complete_job', async () => {
  const payload = { to: 'ana@example.com', n: 1 };
  const { id } = await one(db, "SELECT pglockkit.enqueue_job('node-client', $1::jsonb) AS id", [JSON.stringify(payload)]);
  const claimed = (await db.query("SELECT * FROM pglockkit.claim_job('node-client', 'node-worker-1', '30 seconds')"))
    .rows;
  assert.equal(claimed.length, 1);
  const job = claimed[0];
  assert.equal(job.id, id);
  assert.deepEqual(job.payload, payload);
  assert.equal(job.attempt, 1);
  assert.match(job.token, /^-?\d+$/);
  // Running: another worker gets nothing (SKIP LOCKED, and the job is no longer queued).
  const none = await other.query("SELECT * FROM pglockkit.claim_job('node-client', 'node-worker-2')");
  assert.equal(none.rows.length, 0);
  assert.equal((await one(db, 'SELECT pglockkit.complete_job($1, $2) AS ok', [id, job.token])).ok, true);
  assert.equal((await one(db, 'SELECT pglockkit.complete_job($1, $2) AS ok', [id, job.token])).ok, false);
  const stats = await one(db, "SELECT ready, running, done FROM pglockkit.queue_stats WHERE queue = 'node-client'");
  assert.deepEqual(stats, { ready: '0', running: '0', done: '1' });
  return `job ${id} done with token ${job.token}`;
});

await check('job queue: a stale token is refused (job given back, then lease expired)', async () => {
  const { id } = await one(db, "SELECT pglockkit.enqueue_job('node-client', '{\"n\": 2}') AS id");
  const first = await one(db, "SELECT id, token FROM pglockkit.claim_job('node-client', 'node-worker-1')");
  assert.equal(first.id, id);
  assert.equal((await one(db, 'SELECT pglockkit.release_job($1, $2) AS ok', [id, first.token])).ok, true);
  // Claimed again by another worker, with a new token; the first one is now stale.
  const second = await one(
    other,
    "SELECT id, token, attempt FROM pglockkit.claim_job('node-client', 'node-worker-2', '100 milliseconds')",
  );
  assert.equal(second.id, id);
  assert.notEqual(second.token, first.token);
  assert.equal((await one(db, 'SELECT pglockkit.complete_job($1, $2) AS ok', [id, first.token])).ok, false);
  // worker-2 stalls past its lease: worker-1 reclaims the job, and worker-2's token goes stale.
  await sleep(250);
  const third = await one(db, "SELECT id, token, attempt FROM pglockkit.claim_job('node-client', 'node-worker-1')");
  assert.equal(third.id, id);
  assert.equal(third.attempt, second.attempt + 1);
  assert.notEqual(third.token, second.token);
  assert.equal((await one(other, 'SELECT pglockkit.complete_job($1, $2) AS ok', [id, second.token])).ok, false);
  assert.equal((await one(db, 'SELECT pglockkit.complete_job($1, $2) AS ok', [id, third.token])).ok, true);
  const stats = await one(db, "SELECT running, done FROM pglockkit.queue_stats WHERE queue = 'node-client'");
  assert.deepEqual(stats, { running: '0', done: '2' });
  return `tokens ${first.token}, ${second.token} refused; ${third.token} completed`;
});

await check('leases: acquire_lease, check_fence with the live token, PK001 with a stale one', async () => {
  const name = 'node-client:nightly-refresh';
  const t1 = (await one(db, "SELECT pglockkit.acquire_lease($1, 'node-a', '30 seconds') AS t", [name])).t;
  assert.notEqual(t1, null);
  assert.equal((await one(other, "SELECT pglockkit.acquire_lease($1, 'node-b', '30 seconds') AS t", [name])).t, null);

  await db.query('CREATE TEMP TABLE report (token bigint)');
  await db.query('BEGIN');
  await db.query('SELECT pglockkit.check_fence($1, $2)', [name, t1]); // the live token passes
  await db.query('INSERT INTO report VALUES ($1)', [t1]);
  await db.query('COMMIT');

  assert.equal((await one(db, "SELECT pglockkit.release_lease($1, 'node-a', $2) AS ok", [name, t1])).ok, true);
  const t2 = (await one(other, "SELECT pglockkit.acquire_lease($1, 'node-b', '30 seconds') AS t", [name])).t;
  assert.ok(BigInt(t2) > BigInt(t1)); // a larger token (drawn from one sequence for all leases)

  // node-a wakes up and writes with its old token: fenced in SQL, its write rolled back.
  await db.query('BEGIN');
  await db.query('INSERT INTO report VALUES ($1)', [t1]);
  const code = await sqlstateOf(db.query('SELECT pglockkit.check_fence($1, $2)', [name, t1]));
  await db.query('ROLLBACK');
  assert.equal(code, 'PK001');
  assert.equal((await one(db, 'SELECT count(*)::int AS n FROM report')).n, 1);

  await other.query('BEGIN');
  await other.query('SELECT pglockkit.check_fence($1, $2)', [name, t2]);
  await other.query('COMMIT');
  return `token ${t1} fenced with PK001 after ${t2} was issued`;
});

await db.end();
await other.end();
console.log('all checks passed');
