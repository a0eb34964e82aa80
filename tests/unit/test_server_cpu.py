"""bench.server_cpu: a server's CPU time by process, stubs named by the model they serve; and the two
measures bench.baseline takes from it and from its paired served requests of what streaming costs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from bench.baseline import Timing, response_cpu_ms, streaming_cost
from bench.server_cpu import cpu_by_process

BURN = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\ntime.sleep(60)"


def test_a_stub_s_cpu_time_counts_under_its_model(tmp_path: Path) -> None:
    model_py = tmp_path / "postprocessing" / "1" / "model.py"  # a stub's command line names its model.py
    child = subprocess.Popen([sys.executable, "-c", BURN, str(model_py)])
    try:
        deadline = time.monotonic() + 30
        while (used := cpu_by_process(os.getpid())["postprocessing"]) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert used >= 0.3  # the child's burn (0.5 s; /proc counts it in ticks, and 0.3 read as 0.29), under its model's name
        assert cpu_by_process(os.getpid())["tritonserver"] > 0  # the root process is the server
    finally:
        child.kill()
        child.wait()


def test_response_cost_is_the_streamed_path_s_extra_cpu_over_its_extra_responses() -> None:
    cpu = {
        "triton-stream": Counter({"tritonserver": 1.2, "postprocessing": 1.0, "target_engine": 9.0}),
        "triton": Counter({"tritonserver": 0.2, "postprocessing": 0.1, "target_engine": 8.0}),
    }
    hops = response_cpu_ms(cpu, Counter({"triton-stream": 501, "triton": 1}))
    assert hops == pytest.approx({"tritonserver": 2.0, "postprocessing": 1.8})  # the engine's spin left out
    assert response_cpu_ms(cpu, Counter({"triton-stream": 1, "triton": 1})) == {}


def test_streaming_cost_compares_the_time_after_the_first_token() -> None:
    """A 200 ms prefill, then 1.0 s of decoding streamed against 0.9 s in one response: 1.11x, where the
    whole requests' times would say 1.09x."""
    stream = Timing(tokens=100, ttft_ms=200.0, e2e_s=1.2, decode_ms=10.0, response_ms=50.0, responses=21)
    one = Timing(tokens=100, ttft_ms=float("nan"), e2e_s=1.1, decode_ms=None)
    assert streaming_cost(stream, one) == pytest.approx(1.0 / 0.9)
