"""Start a real `tritonserver` on the rendered model repository (`make serve`, test fixtures), and the
OpenAI-compatible front (`specgate_front`) next to it.

Finds `tritonserver` on PATH (the NGC image) or else the binary bundled in `nvidia-pytriton`, lays out
a backend directory with the Python backend and the stub for the running Python, and forwards the
gate's headers (`x-...`) as request parameters. The first start creates the server's secrets in
artifacts/secrets/ (mode 0600); later starts reuse them, so tenant metric labels stay stable.

Triton's control APIs (RESTRICTED_APIS) answer only requests that carry the admin header, whose
value is artifacts/secrets/admin.key; inference, health, metadata and metrics stay open. The engine
models answer only requests that carry artifacts/secrets/engine.key (serving/engine_key.py), which
the models read from the file the server's environment names.

What starts them here is the bottom of `make serve` (specgate_deploy.serve), of the replicas and of the
container (specgate_deploy), and of the benchmarks' and tests' servers: it imports none of them.
Nothing outlives the process that started them: tritonserver and the front die with it
(PR_SET_PDEATHSIG, also when it is killed with SIGKILL), and each stub exits when tritonserver dies
(serving/parent_watch.py).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from specgate.decoding.compute_lock import ENV as ENV_COMPUTE_LOCK
from specgate.gate.labels import LABEL_KEY_ENV
from specgate.secret_file import ensure_secret, read_secret
from specgate.serving.engine_key import ENGINE_KEY_ENV

ROOT = Path(__file__).resolve().parents[1]
HEADER_PATTERN = "x-.*"
SECRETS = ROOT / "artifacts" / "secrets"
LABEL_SECRET = SECRETS / "label.key"  # HMAC key of the gate's tenant metric labels
ADMIN_SECRET = SECRETS / "admin.key"  # the value the admin header must carry
ENGINE_SECRET = SECRETS / "engine.key"  # what every request to an engine model must carry
COMPUTE_LOCK = ROOT / "artifacts" / "run" / "compute.lock"  # its directory is made 0700
# Not x-...: HEADER_PATTERN would forward it into the models' request parameters.
ADMIN_HEADER = "specgate-admin-key"
# Loading and unloading models (which runs the repository's code), shared-memory regions, and the
# log and trace settings (trace settings name files the server writes). Model config and
# statistics are read-only and stay open with inference, health and metadata.
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
# Triton 2.51 expects the gRPC metadata key with this prefix (seen in its refusal message).
GRPC_RESTRICTED_PREFIX = "triton-grpc-protocol-"


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002
    front: int = 9000  # the OpenAI-compatible front, where one runs


def _pytriton_dir() -> Path:
    import pytriton

    return Path(pytriton.__file__).parent / "tritonserver"


def find_tritonserver() -> Path:
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path)
    bundled = _pytriton_dir() / "bin" / "tritonserver"
    if bundled.exists():
        return bundled
    raise SystemExit("tritonserver not found: not on PATH and nvidia-pytriton is not installed (run `make setup`)")


def backend_dir(out: Path) -> Path:
    """A backend directory holding the bundled Python backend plus the stub for this Python."""
    src = _pytriton_dir()
    stub = src / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / "triton_python_backend_stub"
    if not stub.exists():
        raise SystemExit(f"nvidia-pytriton ships no Python backend stub for Python {sys.version_info[:2]}")
    py = out / "python"
    py.mkdir(parents=True, exist_ok=True)
    for f in (src / "backends" / "python" / "libtriton_python.so", src / "backends" / "python" / "triton_python_backend_utils.py", stub):
        dst = py / f.name
        if not dst.exists() or dst.stat().st_mtime < f.stat().st_mtime:
            shutil.copy2(f, dst)
    return out


def server_env() -> dict[str, str]:
    """The stub embeds libpython: point it at this interpreter's libpython and site-packages."""
    env = dict(os.environ)
    paths = [str(ROOT / "python_backend"), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env["SPECGATE_PYTHONPATH"] = os.pathsep.join(paths)
    # the copied stub loses its relative rpath to the wheel's bundled libraries (libcudart etc.)
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(_pytriton_dir().parent.parent / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (*libs, env.get("LD_LIBRARY_PATH", "")) if p)
    # One torch thread per stub: the PyTorch engine decodes on a worker thread, where a second
    # OpenMP thread bought nothing (docs/batching.md, "Threads"), and a single thread never spins
    # against another engine. llama.cpp sets its own thread count per decode and ignores this.
    # No OMP_WAIT_POLICY=PASSIVE: llama.cpp synchronises its threads with OpenMP barriers many times
    # per decode, and passive (sleeping) waits made a decode step 2.7x slower (10.4 -> 28 ms).
    env.setdefault("OMP_NUM_THREADS", "1")
    # Engines of this checkout take turns per decode (decoding/compute_lock.py), on a file only this
    # user can reach (a fixed one in /tmp let another local user stall them: issue 49).
    env.setdefault(ENV_COMPUTE_LOCK, str(COMPUTE_LOCK))
    env[LABEL_KEY_ENV] = str(LABEL_SECRET)
    env[ENGINE_KEY_ENV] = str(ENGINE_SECRET)
    return env


def restricted_api_args(header: str, key: str) -> list[str]:
    """Triton's flags that put RESTRICTED_APIS behind `header: key`, over HTTP and gRPC.

    Triton 2.51 reads the key only from its command line (`<apis>:<header>=<key>`), so it shows in
    the process list to users of the same machine."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", header) or re.fullmatch(HEADER_PATTERN, header):
        raise ValueError(f"admin header {header!r}: use lowercase letters, digits and '-', not starting with 'x-'")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", key):
        raise ValueError("admin key: letters, digits, '_' and '-' only (Triton splits its flag at ':', ',' and '=')")
    spec = f"{','.join(RESTRICTED_APIS)}:{header}={key}"
    return [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]


def admin_headers(header: str = ADMIN_HEADER, grpc: bool = False) -> dict[str, str]:
    """The header (HTTP) or metadata (gRPC) a control-API call needs (tests, operators' scripts)."""
    return {(GRPC_RESTRICTED_PREFIX if grpc else "") + header: read_secret(ADMIN_SECRET)}


def engine_key() -> str:
    """The engine key, for an operator's direct call to an engine (clients/calibrate.py, benchmarks, tests)."""
    return read_secret(ENGINE_SECRET)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with(parent: int, sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn: the child gets `sig` when the thread that started it dies, however it dies (a
    launcher killed with SIGKILL cannot stop its children itself). SIGTERM lets tritonserver unload
    its models, so the stubs end and free their shared memory. Call it on a thread that lives as
    long as the child should (the main thread here)."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the forked child

    def preexec() -> None:
        if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os.kill(os.getpid(), sig)

    return preexec


def command(repo: Path, ports: Ports, backends: Path, admin_header: str = ADMIN_HEADER, extra: list[str] | None = None) -> list[str]:
    return [
        str(find_tritonserver()),
        f"--model-repository={repo}",
        f"--backend-directory={backends}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        "--allow-metrics=true",
        "--allow-cpu-metrics=true",
        f"--http-header-forward-pattern={HEADER_PATTERN}",
        f"--grpc-header-forward-pattern={HEADER_PATTERN}",
        "--model-control-mode=explicit",
        "--load-model=*",
        "--log-verbose=0",
        # engines import torch and load weights at start-up: on a busy 2-core machine that outlasts
        # the Python backend's default 30 s stub handshake and the model fails to load
        "--backend-config=python,stub-timeout-seconds=300",
        *restricted_api_args(admin_header, read_secret(ADMIN_SECRET)),
        *(extra or []),
    ]


def _wait_http(proc: subprocess.Popen, url: str, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before becoming ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f}s")


def wait_ready(proc: subprocess.Popen, ports: Ports, timeout_s: float = 600) -> None:
    _wait_http(proc, f"http://127.0.0.1:{ports.http}/v2/health/ready", "tritonserver", timeout_s)


def wait_calibrated(repo: Path, timeout_s: float = 300) -> Path | None:
    """Wait until spec_engine has published its calibration, the file the gate reads (`calibration_path`
    of spec_gate's config), and return that file (None for tensorrtllm engines, which publish none).
    At load the engine withdraws the last one and measures the machine for up to about 45 s; meanwhile
    the gate sends every request to the baseline (reason `calibrating`). For benchmarks and tests that
    need the speculative route or a quiet machine; a server serves without it."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse((repo / "spec_gate" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    path = config.parameters["calibration_path"].string_value if "calibration_path" in config.parameters else ""
    if not path:
        return None  # tensorrtllm: it publishes no calibration
    published, deadline = Path(path), time.monotonic() + timeout_s
    while not published.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"spec_engine published no calibration ({published}) within {timeout_s:.0f} s")
        time.sleep(0.5)
    return published


def ensure_secrets() -> None:
    """The server's three keys, made where missing (the first start), kept afterwards."""
    for secret in (LABEL_SECRET, ADMIN_SECRET, ENGINE_SECRET):
        ensure_secret(secret)


def start(
    repo: Path, ports: Ports, log_file: Path | None = None, extra: list[str] | None = None, admin_header: str = ADMIN_HEADER
) -> subprocess.Popen:
    backends = backend_dir(ROOT / "artifacts" / "triton_backends")
    ensure_secrets()
    out = open(log_file, "w") if log_file else None
    return subprocess.Popen(
        command(repo, ports, backends, admin_header, extra), env=server_env(), stdout=out, stderr=subprocess.STDOUT if out else None,
        start_new_session=True, preexec_fn=die_with(os.getpid()),
    )


@contextmanager
def _ready(proc: subprocess.Popen, wait: Callable[[], None], log_file: Path) -> Iterator[subprocess.Popen]:
    """`proc` once `wait` returns, stopped with its process group on exit. If it never becomes ready,
    the tail of its log is printed before the error propagates."""
    try:
        try:
            wait()
        except Exception:
            print(log_file.read_text()[-5000:], flush=True)
            raise
        yield proc
    finally:
        stop(proc)


@contextmanager
def running(repo: Path, ports: Ports, log_file: Path, extra: list[str] | None = None) -> Iterator[subprocess.Popen]:
    """A ready tritonserver on `ports` (benchmarks, test fixtures), stopped with its stubs on exit;
    `extra`: more tritonserver arguments."""
    print(f"[launcher] starting tritonserver on :{ports.http} (log {log_file}) ...", flush=True)
    proc = start(repo, ports, log_file=log_file, extra=extra)
    with _ready(proc, lambda: wait_ready(proc, ports), log_file):
        yield proc


def start_front(ports: Ports, log_file: Path | None = None) -> subprocess.Popen:
    """The OpenAI-compatible front on `ports.front`, a client of the Triton gRPC port `ports.grpc`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "python_backend"), env.get("PYTHONPATH", "")) if p)  # this checkout's front
    cmd = [sys.executable, "-m", "specgate_front", "--port", str(ports.front), "--grpc-url", f"localhost:{ports.grpc}",
           "--http-url", f"localhost:{ports.http}"]
    out = open(log_file, "w") if log_file else None
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True,
                            preexec_fn=die_with(os.getpid()))


def wait_front_ready(proc: subprocess.Popen, ports: Ports, timeout_s: float = 120) -> None:
    _wait_http(proc, f"http://127.0.0.1:{ports.front}/v1/models", "the front", timeout_s)


@contextmanager
def running_front(ports: Ports, log_file: Path) -> Iterator[subprocess.Popen]:
    """A ready front on `ports.front` for a Triton already serving on `ports.grpc` (tests, benchmarks)."""
    proc = start_front(ports, log_file)
    with _ready(proc, lambda: wait_front_ready(proc, ports), log_file):
        yield proc


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Stop the server and every stub in its process group, also when the server already died."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout_s)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stubs left behind by a crashed server
    except ProcessLookupError:
        pass
    proc.wait()
