"""cost_model/measure.measure: what a draft step is charged, on a target with scripted timings."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from specgate.cost_model.measure import measure
from specgate.decoding.config import CalibrationOverride
from specgate.decoding.target import Target, TargetInfo
from specgate.decoding.tree import DraftTree

PER_TOKEN_MS, REPLAN_MS = 7.0, 1.0


class ScriptedTarget(Target):
    """A decode of T tokens takes 7T ms, plus 1 ms when T differs from the previous decode's (as
    llama.cpp re-plans its compute graph when the batch shape changes)."""

    def __init__(self) -> None:
        self.info = TargetInfo("scripted", "none", 1, 16, 4, 0, 512, 1)
        self._len, self._base, self._last = 0, 0, 1
        self.contexts: set[int] = set()  # cached tokens at each verification

    def verify(self, slot: int, root: int, tree: DraftTree, features: bool) -> tuple[np.ndarray, None]:
        t = 1 + len(tree)
        self.last_verify_ms = PER_TOKEN_MS * t + (REPLAN_MS if t != self._last else 0.0)
        self._last = t
        self.contexts.add(self._len)
        self._base, self._len = self._len, self._len + t
        return np.zeros((t, self.info.vocab_size), np.float32), None

    def commit(self, slot: int, keep: Sequence[int]) -> None:
        self._len = self._base + len(keep)

    def extend(self, slot: int, tokens: Sequence[int], features: bool) -> tuple[np.ndarray, None]:
        self._len += len(tokens)
        return np.zeros(self.info.vocab_size, np.float32), None

    def forward(self, items: Sequence[tuple[int, Sequence[int]]]) -> np.ndarray:
        raise NotImplementedError

    def truncate(self, slot: int, length: int) -> None:
        self._len = min(self._len, length)

    def release(self, slot: int) -> None:
        self._len = 0

    def length(self, slot: int) -> int:
        return self._len

    def embeddings(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def test_a_draft_is_charged_its_decode_and_the_replanning_it_causes() -> None:
    target = ScriptedTarget()
    curve = measure(target, slot=0, sizes=(1, 2, 4, 8), context=32, reps=3)
    assert curve.cost(1) == pytest.approx(PER_TOKEN_MS)  # a plain step between plain steps
    assert curve.floor_ms == pytest.approx(PER_TOKEN_MS)  # plain steps in a row
    for t in (2, 4, 8):  # its own re-plan, and the plain step's after it
        assert curve.cost(t) == pytest.approx(PER_TOKEN_MS * t + 2 * REPLAN_MS)
    assert curve.context == 32 and target.contexts == {32}  # every decode at the same context


def test_a_fully_pinned_calibration_measures_nothing_and_waits_for_no_quiet_machine(monkeypatch) -> None:  # noqa: ANN001
    """Replicas on one machine each wait for the other to go quiet before measuring; with the shape,
    the scale and every drafter pinned there is nothing to measure, so neither waits."""
    import specgate.cost_model.measure as m

    class Untouchable(ScriptedTarget):
        def verify(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            raise AssertionError("a pinned calibration decoded")

        extend = verify

    monkeypatch.setattr(m, "wait_until_idle", lambda **kw: pytest.fail("a pinned calibration waited for a quiet machine"))
    override = CalibrationOverride(cost_ratios={1: 1.0, 8: 2.0}, base_ms=4.0, draft_ms={"ngram": 0.5})
    cal = m.calibrate(Untouchable(), {"ngram": object()}, override, idle_timeout_s=30)
    assert cal.curve.cost(1) == pytest.approx(4.0) and cal.curve.cost(8) == pytest.approx(8.0) and not cal.curve.measured
    with pytest.raises(ValueError, match="cost_ratios"):
        CalibrationOverride(base_ms=4.0)


def test_a_repetition_others_disturbed_is_measured_again_not_counted(monkeypatch) -> None:  # noqa: ANN001
    """While the rest of the machine computes (here: while the scripted target is made slow), a
    repetition is repeated instead of counted; the curve is the quiet repetitions'."""
    import specgate.cost_model.measure as m

    target = ScriptedTarget()
    busy = iter([False, True, True, False, False, False])  # the warm-up, then 2 disturbed of 5

    class Scripted(m.Overlap):
        def __enter__(self):  # noqa: ANN204
            self.disturbed = next(busy)
            target.slow = 3.0 if self.disturbed else 1.0
            return self

        def __exit__(self, *exc: object) -> None:
            self.others = 0.5 if self.disturbed else 0.0

    def verify(slot, root, tree, features):  # noqa: ANN001, ANN202
        out = ScriptedTarget.verify(target, slot, root, tree, features)
        target.last_verify_ms *= target.slow
        return out

    monkeypatch.setattr(m, "Overlap", Scripted)
    monkeypatch.setattr(target, "verify", verify)
    curve = measure(target, slot=0, sizes=(1, 2, 4), context=32, reps=3)
    assert next(busy, None) is None  # 3 quiet repetitions took 5
    assert curve.cost(1) == pytest.approx(PER_TOKEN_MS) and curve.floor_ms == pytest.approx(PER_TOKEN_MS)
    assert curve.cost(4) == pytest.approx(PER_TOKEN_MS * 4 + 2 * REPLAN_MS) and curve.others == 0.0


def test_a_republished_calibration_keeps_the_measured_shape_and_floor() -> None:
    """Served decodes rescale the calibration to the machine's speed now; its shape and floor are
    the quiet measurement's (served decodes once published cost(2)/cost(1) = 1.18 against 1.7 quiet)."""
    from specgate.cost_model.calibration import Calibration
    from specgate.cost_model.goodput import CostCurve
    from specgate.machine import machine

    curve = CostCurve(tokens=[1, 2, 8], ms=[10.0, 17.0, 39.0], floor_ms=9.8, others=0.01)
    cal = Calibration.build(curve, {"ngram": 0.1}, set(), machine=machine(), backend="llamacpp", dtype="Q4_1", threads=2,
                            measured_at="then")
    now = cal.refined(12.0, {"ngram": 0.2}, at="now")
    assert now.curve.ms == pytest.approx([12.0, 20.4, 46.8]) and now.curve.floor_ms == 9.8
    assert [now.curve.ratio(t) for t in (2, 8)] == pytest.approx([1.7, 3.9])
    assert now.algorithms["ngram"].draft_ms == 0.2 and now.refined_at == "now"
