"""spec_engine's calibration through a real server: what it drafts follows the machine's cost curve.

The curve shape is pinned with the control message (clients/calibrate.py does the same), so the
behaviour is the same on every machine: where T tokens cost T times one token nothing is drafted
(the response says budget 0), where verification is free the full k is. A plain re-measurement
publishes the machine's own curve as a gauge and in the file the gate reads. The suite's free
calibration is put back at the end.
"""

from __future__ import annotations

import json
import time

import pytest

from loadtest.metrics import scrape
from specgate.algorithms import SPEC_ALGORITHMS
from specgate.contract import VERIFY_COST_METRIC
from specgate.cost_model.calibration import Calibration
from specgate_client import GenerateParams, calibrate
from specgate_launcher import engine_key
from tests.conftest import FREE_DRAFTING, PINNED_DRAFTING, TEST_OUT
from tests.integration.test_gate import ECHO

CALIBRATION = TEST_OUT / "engines" / "cpu" / "calibration.json"
K = 4
PARAMS = GenerateParams(max_tokens=32, num_speculative_tokens=K, speculative_algorithm="ngram")
LINEAR = {t: float(t) for t in (1, 2, 4, 8, 16, 32)}
FREE = {a: 0.0 for a in SPEC_ALGORITHMS}


def _gauge(metrics_port: int) -> dict[int, float]:
    return {int(dict(labels)["tokens"]): v for (name, labels), v in scrape(metrics_port).items() if name == VERIFY_COST_METRIC}


def test_budget_follows_the_cost_curve(http, server) -> None:  # noqa: ANN001
    url = f"localhost:{server.grpc}"
    try:
        calibrate(url, {"cost_ratios": LINEAR, "draft_ms": FREE}, engine_key=engine_key())
        linear = http.generate(ECHO, PARAMS, spec_mode="prod")
        assert linear.meta["route"] == "speculative"
        assert linear.meta["num_draft_tokens"] == 0 and linear.meta["draft_budget"] == 0, linear.meta
        gauge = _gauge(server.metrics)
        assert gauge[8] / gauge[1] == pytest.approx(8.0, rel=1e-3) and gauge[32] / gauge[1] == pytest.approx(32.0, rel=1e-3)

        calibrate(url, json.loads(FREE_DRAFTING), engine_key=engine_key())
        flat = http.generate(ECHO, PARAMS, spec_mode="prod")
        assert flat.meta["draft_budget"] == K and flat.meta["num_draft_tokens"] > 0, flat.meta
        assert flat.text == linear.text  # greedy: drafting changes the speed, not the text

        before = Calibration.load(CALIBRATION)
        time.sleep(1)  # measured_at has one-second resolution
        calibrate(url, engine_key=engine_key())  # measure this machine
        measured = Calibration.load(CALIBRATION)
        assert measured.curve.measured and measured.measured_at != before.measured_at
        assert set(measured.algorithms) == set(SPEC_ALGORITHMS)
        gauge = _gauge(server.metrics)
        assert [gauge[t] for t in measured.curve.tokens] == pytest.approx([m / 1000 for m in measured.curve.ms], rel=1e-3)
    finally:  # the suite's calibration back
        calibrate(url, json.loads(PINNED_DRAFTING), engine_key=engine_key())
