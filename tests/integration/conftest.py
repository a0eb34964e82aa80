"""Fixtures of the integration suite that only some of its files use."""

from __future__ import annotations

import os
import socket

import pytest

from tests.conftest import TEST_OUT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def front(server):
    """The OpenAI-compatible front, started as `make serve` starts it, in front of the session's
    tritonserver; yields (base URL, its log file). TEST_FRONT_PORT= pins its port."""
    from dataclasses import replace

    from specgate_launcher import running_front

    ports = replace(server, front=int(os.environ.get("TEST_FRONT_PORT", 0)) or free_port())
    log = TEST_OUT / "front.log"
    with running_front(ports, log):
        yield f"http://127.0.0.1:{ports.front}", log
