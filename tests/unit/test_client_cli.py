"""README's client against an address where no server listens: one line naming it and what to run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("protocol, scheme", [("http", "http"), ("grpc", "grpc")])
def test_no_server_is_one_line_naming_the_address_and_the_fix(protocol: str, scheme: str) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python_backend"), str(ROOT)])}
    r = subprocess.run(
        [sys.executable, str(ROOT / "clients" / "generate.py"), "Hello", "--stream", "--protocol", protocol, "--url", f"localhost:{port}"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and r.stdout == ""
    assert len(lines) == 1, r.stderr
    assert f"{scheme}://localhost:{port}" in lines[0] and "make serve" in lines[0]


@pytest.mark.parametrize("field, value", [("max_tokens", 2**32 + 1), ("seed", 2**63), ("num_speculative_tokens", -(2**31) - 1)])
def test_an_integer_its_input_type_cannot_hold_is_refused(field: str, value: int) -> None:
    """Issue 49: numpy 1.x wrapped max_tokens 2**32 + 1 to 1 in the gRPC input; a seed of 2**63 raised."""
    from specgate_client import GenerateParams, grpc_inputs

    with pytest.raises(ValueError, match=f"{field}: {value} does not fit"):
        grpc_inputs("Hi", GenerateParams(**{field: value}), stream=False)
