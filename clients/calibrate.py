"""Ask a running server's spec_engine to measure its machine again (cost curve, drafting times).

    .venv/bin/python clients/calibrate.py                       # measure everything again
    .venv/bin/python clients/calibrate.py --pin '{"cost_ratios": {"1": 1, "8": 8}}'   # pin a curve shape
    .venv/bin/python clients/calibrate.py --pin '{"cost_ratios": {"1": 1, "8": 8}, "base_ms": 9.5}'   # and its scale

The new calibration is logged by the server, exported as spec_decode_verification_cost_seconds and
written for the gate; this returns when it is in force. spec_engine obeys only callers with the
server's engine key, artifacts/secrets/engine.key (make serve creates it; --key-file names another).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specgate.secret_file import read_secret
from specgate_client import ServerError, calibrate
from specgate_launcher import ENGINE_SECRET


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="localhost:8001", help="tritonserver gRPC address")
    ap.add_argument("--pin", default=None, help="JSON CalibrationOverride: cost_ratios (and their scale base_ms) and/or draft_ms to pin")
    ap.add_argument("--key-file", type=Path, default=ENGINE_SECRET, help="the server's engine key (spec_engine obeys no one without it)")
    args = ap.parse_args()
    try:
        calibrate(args.url, json.loads(args.pin) if args.pin else None, engine_key=read_secret(args.key_file))
    except ServerError as exc:
        raise SystemExit(f"calibration failed: {exc}") from None
    print("spec_engine recalibrated; see the server log or spec_decode_verification_cost_seconds on the metrics port")


if __name__ == "__main__":
    main()
