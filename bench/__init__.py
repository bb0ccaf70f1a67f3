"""Benchmarks for pglockkit. Run one with ``python -m bench.<name>``; see bench/README.md."""
