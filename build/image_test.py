"""`make image-test`: build the CPU image, run it as the pod runs it, talk to it, stop it.

1. `make image` (layers of an earlier build are reused). The builder's build context is what
   build/build_context.py lists, so the unit test that finds no secret in that listing is about the
   real thing; the image holds no compiler, cmake, git or dev extras.
2. Run it with its ports published on IMAGE_TEST_PORT (48000 HTTP, +1 gRPC, +2 metrics, +9 front), the
   root filesystem read-only with a tmpfs where the pod has an emptyDir, 2 CPUs and 4 GB (the CPU
   overlay's limits).
3. Triton ready and /v1/models answering; a generate and an OpenAI chat request; the front's
   /health/ready at 200 once spec_engine has published its calibration; then a request routed
   speculative.
4. A streamed request in flight, `podman stop` with the pod's own worst-case stop time
   (specgate_deploy.pod.worst_stop_s, asked of the image): readiness drops at once, the request
   completes, and the container exits 0 within the timeout.

Standard library only, as build/image.py.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from build import image  # noqa: E402 (run as a script before the project is installed)
from build.build_context import context_files  # noqa: E402

NAME = "specgate-image-test"
PORT = int(os.environ.get("IMAGE_TEST_PORT", 48000))
PORTS = {"http": PORT, "grpc": PORT + 1, "metrics": PORT + 2, "front": PORT + 9}
CONTAINER_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002, "front": 9000}
LIMITS = ["--cpus", "2", "--memory", "4g"]  # deploy/k8s/overlays/cpu/resources.yaml


def log(msg: str) -> None:
    print(f"[image-test] {msg}", flush=True)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"[image-test] FAILED: {what}")
    log(f"ok: {what}")


def builder_context() -> set[str]:
    """The files the real builder receives: a scratch image of `COPY . /context/`, listed."""
    with tempfile.TemporaryDirectory() as tmp:
        dockerfile = Path(tmp) / "Dockerfile"
        dockerfile.write_text("FROM scratch\nCOPY . /context/\n")
        tag = "localhost/specgate-context:test"
        image.podman("build", "--quiet", "--pull=never", "-f", str(dockerfile), "-t", tag, str(image.ROOT), capture=True)
        container = image.podman("create", tag, "none", capture=True)
        try:
            export = subprocess.run([*image.PODMAN, "export", container], check=True, capture_output=True).stdout
        finally:
            image.podman("rm", container, capture=True)
            image.podman("rmi", tag, capture=True)
    with tarfile.open(fileobj=io.BytesIO(export)) as tar:
        return {m.name.removeprefix("context/") for m in tar.getmembers() if m.name.startswith("context/") and not m.isdir()}


def in_image(tag: str, script: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*image.PODMAN, "run", "--rm", *flags, "--entrypoint", "sh", tag, "-c", script], capture_output=True, text=True)


def http(port: int, path: str, body: dict | None = None, timeout_s: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode() if body is not None else None,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_for(what: str, ok, timeout_s: float, running: bool = True) -> float:  # noqa: ANN001 (a () -> bool)
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if ok():
                took = time.monotonic() - start
                log(f"{what} after {took:.0f} s")
                return took
        except OSError:
            pass
        if running and image.podman("inspect", "--format", "{{.State.Running}}", NAME, capture=True) != "true":
            raise SystemExit(f"[image-test] FAILED: the container ended before {what}")
        time.sleep(1)
    raise SystemExit(f"[image-test] FAILED: {what} not within {timeout_s:.0f} s")


def generate(body: dict) -> dict:
    status, out = http(PORTS["http"], "/v2/models/llm/generate", {"max_tokens": 16, "temperature": 0.0, **body})
    check(status == 200 and out.get("text_output"), f"generate answered 200 with text (route {out.get('route')}, {out.get('gate_reason')})")
    return out


def stream_during_stop(result: dict) -> threading.Thread:
    """A streamed generate that is in flight when the container is told to stop; `result` gets its events."""
    started = threading.Event()

    def run() -> None:
        # a number sequence as raw text: greedy decoding continues it to max_tokens, several seconds
        body = {"text_input": ", ".join(map(str, range(1, 40))) + ",", "apply_chat_template": False, "max_tokens": 1024, "temperature": 0.0,
                "stream": True}
        req = urllib.request.Request(f"http://127.0.0.1:{PORTS['http']}/v2/models/llm/generate_stream", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        events = result["events"] = []  # filled as they arrive
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                for line in r:
                    if line.startswith(b"data: "):
                        events.append(json.loads(line[6:]))
                        started.set()
        except OSError as e:
            result["error"] = repr(e)
        started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    started.wait(120)
    return t


def main() -> None:
    start = time.monotonic()
    tag = image.IMAGE
    build_s = image.build(tag)
    listed, sent = context_files(image.ROOT), builder_context()
    check(listed == sent, f"the builder's context is build_context.py's listing ({len(sent)} files)" + (
        "" if listed == sent else f": only listed {sorted(listed - sent)[:10]}, only sent {sorted(sent - listed)[:10]}"))
    tools = in_image(tag, "for t in gcc cc g++ cmake git make; do command -v $t && exit 1; done; "
                          "for m in pytest locust matplotlib; do .venv/bin/python -c \"import $m\" 2>/dev/null && echo $m && exit 1; done; "
                          "test -z \"$(find /app -name .cache -o -name '*.whl' | head -n1)\"")
    check(tools.returncode == 0, f"no compiler, cmake, git, dev extras, pip cache or wheel in the image {tools.stdout.strip()}")
    threads = in_image(tag, ".venv/bin/python -c 'from specgate.machine import machine; print(machine().cores)'", "--cpus", "1")
    check(threads.stdout.strip() == "1",
          f"under a 1-CPU limit the engines take 1 thread (machine().cores: {threads.stdout.strip() or threads.stderr[-300:]})")
    stop_s = int(float(in_image(tag, ".venv/bin/python -c 'from specgate_deploy.pod import worst_stop_s; import os; "
                                     "print(worst_stop_s(int(os.environ[\"DRAIN_S\"])))'")
                       .stdout.strip())) + 5
    # as the pod's emptyDirs: writable by the server's user (U), executable (the Python backend's stub)
    tmpfs = [a for d in [*image.writable_dirs(), "/tmp"] for a in ("--tmpfs", f"{d}:rw,exec,U")]
    published = [a for k in PORTS for a in ("-p", f"{PORTS[k]}:{CONTAINER_PORTS[k]}")]
    image.podman("rm", "--force", "--ignore", NAME, capture=True)
    # the HEALTHCHECK is run once below, not by a timer (podman's timers need systemd)
    image.podman("run", "--detach", "--name", NAME, "--read-only", *tmpfs, "--shm-size", "1g", *LIMITS, *published,
                 "--health-interval", "disable", "--stop-timeout", str(stop_s), tag, capture=True)
    try:
        ready_s = wait_for("Triton ready", lambda: http(PORTS["http"], "/v2/health/ready", timeout_s=2)[0] == 200, 300)
        wait_for("the front answering /v1/models", lambda: http(PORTS["front"], "/v1/models", timeout_s=2)[0] == 200, 120)
        generate({"text_input": "What is the capital of France?"})
        status, chat = http(PORTS["front"], "/v1/chat/completions",
                            {"model": "llm", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16})
        check(status == 200 and chat["choices"][0]["message"]["content"],
              f"an OpenAI chat completion (route {chat.get('specgate', {}).get('route')})")
        calibrated_s = wait_for("/health/ready (calibration published)",
                                lambda: http(PORTS["front"], "/health/ready", timeout_s=3)[0] == 200, 300)
        health = subprocess.run([*image.PODMAN, "healthcheck", "run", NAME], capture_output=True, text=True)
        check(health.returncode == 0, f"the image's HEALTHCHECK passes ({health.stdout.strip() or health.stderr.strip()})")
        spec = generate({"text_input": "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
                         "x-speculative-decoding": "prod"})
        check(spec["route"] == "speculative", f"after calibration a prod request routes speculative (reason {spec['gate_reason']})")
        memory = subprocess.run([*image.PODMAN, "stats", "--no-stream", "--format", "{{.MemUsage}}", NAME],
                                capture_output=True, text=True).stdout.strip()
        result: dict = {}
        streaming = stream_during_stop(result)
        check(bool(result.get("events")) and streaming.is_alive(),
              f"a streamed request in flight ({len(result.get('events', []))} events, {result.get('error', 'no error')})")
        t0 = time.monotonic()
        stopper = threading.Thread(target=lambda: image.podman("stop", "--time", str(stop_s), NAME, capture=True))
        stopper.start()
        wait_for("readiness gone after the stop signal", lambda: http(PORTS["front"], "/health/ready", timeout_s=2)[0] != 200, 10,
                 running=False)
        stopper.join()
        stopped_s = time.monotonic() - t0
        streaming.join(30)
        events = result.get("events", [])
        check("error" not in result and events and not any("error" in e for e in events),
              f"the in-flight stream completed while draining ({len(events)} events)")
        code = int(image.podman("inspect", "--format", "{{.State.ExitCode}}", NAME, capture=True))
        check(code == 0 and stopped_s < stop_s, f"exited {code} after {stopped_s:.0f} s, within the stop timeout {stop_s} s")
    except BaseException:
        print(image.podman("logs", "--tail", "80", NAME, capture=True), flush=True)
        raise
    finally:
        image.podman("rm", "--force", "--ignore", NAME, capture=True)
    log(f"passed in {time.monotonic() - start:.0f} s (build {build_s:.0f} s; ready {ready_s:.0f} s; calibrated {calibrated_s:.0f} s more; "
        f"memory {memory}; stop {stopped_s:.0f} s)")


if __name__ == "__main__":
    main()
