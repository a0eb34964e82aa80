"""`python -m specgate_front`: serve the OpenAI-compatible front with uvicorn. `make serve` starts it
next to tritonserver (specgate_launcher); run it alone to put it in front of a server started elsewhere."""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from specgate_front.app import create_app
from specgate_front.triton import LLM_MODEL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=int(os.environ.get("FRONT_PORT", 9000)))
    ap.add_argument("--grpc-url", default=f"localhost:{os.environ.get('GRPC_PORT', 8001)}", help="Triton's gRPC endpoint")
    ap.add_argument("--model", default=LLM_MODEL, help="the entry-point model, also the name clients send")
    ap.add_argument("--http-url", default=None,
                    help="Triton's HTTP endpoint (host:port), which /health/ready asks (a drain closes it at once)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")  # uvicorn's own look
    uvicorn.run(create_app(args.grpc_url, args.model, args.http_url), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
