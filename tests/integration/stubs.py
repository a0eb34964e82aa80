"""The Python-backend stub processes of the test server (not those of any other server on the machine)."""

from __future__ import annotations

import subprocess

from tests.conftest import TEST_OUT


def stub_pids(model: str) -> set[int]:
    """PIDs of the stubs serving `model` from the test server's repository."""
    pattern = f"triton_python_backend_stub {TEST_OUT / 'model_repository' / model}/"
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}
