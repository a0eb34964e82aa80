"""The replica supervisor's judgement of a ready server (specgate_deploy.health): a dead stub or a model
wedged LOADING is a fault, an operator's unload is not. The restart it leads to is tested end to end in
tests/integration/test_orphans.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

from specgate_deploy.health import STUB, Fault, HealthCheck, ModelState, live_stubs, python_instances

CONFIGS = {
    "llm": 'platform: "ensemble"\n',
    "preprocessing": 'backend: "python"\ninstance_group [ { count: 2 kind: KIND_CPU } ]\n',
    "target_engine": 'backend: "python"\n',
    "trt_target": 'backend: "tensorrtllm"\ninstance_group [ { count: 1 kind: KIND_CPU } ]\n',
    "broken": 'backend: "python"\ngarbage {{{\n',  # Triton's to refuse, not the supervisor's to crash on
}


def _states(**states: str) -> list[ModelState]:
    return [ModelState(name=n, state=s) for n, s in states.items()]


def test_python_models_run_a_stub_per_instance_and_others_none(tmp_path: Path) -> None:
    for name, text in CONFIGS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(f'name: "{name}"\n{text}')
    assert python_instances(tmp_path) == {"preprocessing": 2, "target_engine": 1}


def test_a_ready_model_missing_a_stub_is_a_fault_an_unloaded_one_is_not() -> None:
    check = HealthCheck({"preprocessing": 2, "target_engine": 1})
    ready = _states(llm="READY", preprocessing="READY", target_engine="READY")
    assert check.verdict(ready, Counter(preprocessing=2, target_engine=1), now=0.0) is None
    assert check.verdict(ready, Counter(preprocessing=1, target_engine=1), now=1.0) == Fault(
        model="preprocessing", reason="preprocessing is READY but 1 of its 2 stub processes died")
    assert check.verdict(ready, Counter(preprocessing=2), now=2.0) == Fault(
        model="target_engine", reason="target_engine is READY but 1 of its 1 stub processes died")
    unloaded = _states(llm="UNAVAILABLE", preprocessing="READY", target_engine="UNAVAILABLE")
    assert check.verdict(unloaded, Counter(preprocessing=2), now=3.0) is None


def test_a_model_loading_past_the_timeout_is_a_fault_and_a_finished_load_resets_it() -> None:
    check = HealthCheck({"target_engine": 1}, load_timeout_s=300)
    loading = _states(target_engine="LOADING")
    assert check.verdict(loading, Counter(), now=1000.0) is None
    assert check.verdict(loading, Counter(), now=1300.0) is None
    assert check.verdict(loading, Counter(), now=1301.0) == Fault(
        model="target_engine", reason="target_engine has been LOADING for 301 s", wedged=True)
    assert check.verdict(_states(target_engine="READY"), Counter(target_engine=1), now=1302.0) is None
    assert check.verdict(loading, Counter(), now=1400.0) is None  # a new load counts from its own start


def test_live_stubs_counts_this_servers_children_by_model_and_not_the_dead(tmp_path: Path) -> None:
    """A stand-in stub: python under the stub's name, running `<repository>/<model>/1/model.py` as the
    backend starts one, under a stand-in server that never reaps it (a dead stub stays a zombie): as
    its child, then as its grandchild (under mpirun, as in the TensorRT-LLM pod). Not this test's own
    children: the suite's tritonserver and its stubs are among them."""
    stub = tmp_path / STUB
    stub.symlink_to(sys.executable)
    model = tmp_path / "repo" / "target_engine" / "1" / "model.py"
    model.parent.mkdir(parents=True)
    model.write_text("import time\ntime.sleep(60)\n")
    for argv in ([str(stub), str(model)], ["sh", "-c", f"'{stub}' '{model}'; true"]):
        _count_one_then_none(argv)


def _count_one_then_none(argv: list[str]) -> None:
    server = subprocess.Popen([sys.executable, "-c", f"import subprocess, time; p = subprocess.Popen({argv!r}); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while live_stubs(server.pid)["target_engine"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # until exec has replaced the forked process
        assert live_stubs(server.pid) == Counter(target_engine=1)
        (stub,) = [p for p in psutil.Process(server.pid).children(recursive=True) if p.name() == STUB]
        stub.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while live_stubs(server.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_stubs(server.pid) == Counter()  # dead (a zombie, its parent never waits): not alive
        server.kill()
        server.wait()
        assert live_stubs(server.pid) == Counter()  # a server that is gone has no stubs
    finally:
        for p in psutil.Process(server.pid).children(recursive=True) if server.poll() is None else []:
            p.kill()
        server.kill()
        server.wait()
