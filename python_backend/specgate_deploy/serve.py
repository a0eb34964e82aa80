"""`make serve`: one replica on the public ports (HTTP 8000, gRPC 8001, metrics 8002, front 9000),
supervised as each of `make serve REPLICAS=N`'s is (specgate_deploy.replica): a cluster of one,
without the balancer. Ctrl-C, SIGHUP and SIGTERM drain it and stop it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import specgate_launcher as launcher
from specgate_deploy.replica import DRAIN_S, EXIT_S, Replica


def main() -> None:
    """One replica on the public ports, supervised like each of
    `make serve REPLICAS=N`'s: a tritonserver that dies is restarted. Triton 2.51's Python backend can
    abort the whole server when a stub dies in the middle of its shared-memory IPC (docs/robustness.md,
    "Limits"), so a dead engine process must not leave the user without a server."""
    ap = argparse.ArgumentParser(description="Serve the rendered model repository with tritonserver, and the OpenAI-compatible front.")
    ap.add_argument("--model-repository", type=Path, default=launcher.ROOT / "artifacts" / "model_repository")
    ap.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    ap.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    ap.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    ap.add_argument("--front-port", type=int, default=int(os.environ.get("FRONT_PORT", 9000)))
    ap.add_argument("--admin-header", default=os.environ.get("ADMIN_HEADER", launcher.ADMIN_HEADER),
                    help=f"header the control APIs ({', '.join(launcher.RESTRICTED_APIS)}) require; "
                         f"its value is {launcher.ADMIN_SECRET.relative_to(launcher.ROOT)}")
    ap.add_argument("--drain-s", type=int, default=int(os.environ.get("DRAIN_S", DRAIN_S)),
                    help="on Ctrl-C or SIGTERM, how long the requests in flight may take to finish")
    ap.add_argument("--log-dir", type=Path, default=launcher.ROOT / "artifacts" / "logs")
    args = ap.parse_args()
    if not (args.model_repository / "llm" / "config.pbtxt").exists():
        raise SystemExit(f"no model repository at {args.model_repository}: run `make build-engines`")
    ports = launcher.Ports(args.http_port, args.grpc_port, args.metrics_port, args.front_port)
    replica = Replica("serve", ports, args.model_repository, args.log_dir, args.drain_s, args.admin_header)
    log = replica.server_log
    stopping = False

    def request_stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    # Ctrl-C, SIGTERM (a supervisor) and SIGHUP (a closed terminal) all drain and stop
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, request_stop)
    code = 0
    replica.start()
    print(f"[serve] starting tritonserver (pid {replica.server.pid}, log {log}); loading models ...", flush=True)
    announced = False
    try:
        while not stopping:
            replica.poll()
            if replica.failed_to_start or replica.status == "failed":  # the first start, or every restart since, never got ready
                print(replica.log_tail(), flush=True)
                print(f"[serve] tritonserver exited with code {replica.server.returncode} before it was ready (log above: {log})",
                      flush=True)
                code = replica.server.returncode or 1
                break
            if replica.status == "ready" and not announced:
                launcher.wait_front_ready(replica.front, ports)  # started once tritonserver was ready
                announced = True
                print(
                    f"[serve] ready\n"
                    f"  HTTP     http://localhost:{ports.http}/v2/models/llm/generate  (and generate_stream)\n"
                    f"  gRPC     localhost:{ports.grpc}  (model llm, streaming)\n"
                    f"  metrics  http://localhost:{ports.metrics}/metrics\n"
                    f"  OpenAI   http://localhost:{ports.front}/v1  (chat/completions, completions, models; model llm)\n"
                    f"  control  {', '.join(launcher.RESTRICTED_APIS)} APIs need the contents of "
                    f"{launcher.ADMIN_SECRET.relative_to(launcher.ROOT)}\n"
                    f"           in the header {args.admin_header} (HTTP) or {launcher.GRPC_RESTRICTED_PREFIX}{args.admin_header} (gRPC)\n"
                    f"  logs     {log}, {replica.front_log.name} (the logs of earlier runs, once restarted: .log.1, .log.2, ...)\n"
                    f"  try:     python clients/generate.py 'Hello!' --stream\n"
                    "A tritonserver that dies or loses a stub is restarted (a dead spec_engine is reloaded). "
                    "Ctrl-C stops the server and the front.",
                    flush=True,
                )
            time.sleep(1)
        else:
            print(f"\n[serve] stopping (requests in flight get up to {args.drain_s} s) ...", flush=True)
    finally:
        replica.begin_drain()
        replica.finish_drain(time.monotonic() + args.drain_s + EXIT_S)
    sys.exit(code)


if __name__ == "__main__":
    main()
