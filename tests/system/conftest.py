"""Fixtures of the system tests."""

from __future__ import annotations

import contextlib
import subprocess

import pytest
from private import PrivateServer


@pytest.fixture
def private_server(server, tmp_path):
    srv = PrivateServer(server.bindir, tmp_path / "private")
    try:
        yield srv
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            srv.stop("immediate")
