"""The worker: claim jobs of a queue and run a handler on each, many at once per process.

The route a job takes, from ``pglockkit work`` (``pglockkit.cli``) to its commit:

- ``lane.py``: the settings (checked once) and the sans-IO lane, which decides everything (what
  to claim, when a group commits, what a job's outcome is, in which order outcomes are written)
  and asks its driver for round trips: ``Lane.drain`` yields requests (``Pipeline``,
  ``Handle``, ``Claim``, ``Record``) and gets their replies;
- ``pool_async.py``: the connections a process's jobs share (a job holds one only while it uses
  one), the connection an exactly-once handler gets before it has one, and the feeder that
  batches the lanes' claims and outcomes; ``pool.py``, the threads' pool, is generated from it;
- ``connection_async.py``: the lane connection, which makes the job's savepoint (or BEGIN) at the
  handler's first statement and refuses a handler's ``COMMIT``/``ROLLBACK`` of the worker's
  transaction; ``connection.py``, the threads', is generated from it;
- ``driver_async.py``: ``pglockkit.aio.Worker``, the lanes as asyncio tasks; and ``driver.py``,
  ``pglockkit.Worker``, the lanes as threads, generated from it.

The generated modules are written by ``tools/async_to_sync.py`` (CONTRIBUTING.md, "Sync
modules generated from async ones").
"""

from pglockkit.worker.driver import Worker

__all__ = ["Worker"]
