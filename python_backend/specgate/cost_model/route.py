"""The gate's view of spec_engine's calibration (specgate.cost_model.calibration), reloaded when the engine
publishes a new one (at its load, and whenever it is asked to measure again).

What the gate takes from it:
- which algorithms the engine has (the calibrated ones): a request for another is refused;
- `auto`, the policy's default algorithm: the one expected fastest at the tenant's acceptance;
- `can_pay`: whether drafting with an algorithm can beat plain decoding on this machine at all
  (else routing to the one-at-a-time speculative engine buys nothing: reason `no_gain`);
- `pays`: whether it is expected to buy `min_gain` at the tenant's acceptance, the prior until the
  tenant has evidence (else a new tenant's breaker starts half-open and probes, gate/breaker.py, and
  a known one is routed only by its probes);
- the breaker's thresholds when the policy says `auto`: below the acceptance at which drafting
  stops paying, the tenant's circuit opens.

With a path but no file there, spec_engine is measuring (at its load it withdraws the last run's
file and serves nothing until it has published a new one): the gate routes to the baseline (reason
`calibrating`) and looks for the file at every request until it appears. Without a path (the
tensorrtllm engines publish no calibration) the gate routes on the policy alone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from specgate.algorithms import ALGORITHMS
from specgate.cost_model.calibration import Calibration
from specgate.cost_model.goodput import alpha_of_rate

log = logging.getLogger(__name__)


class CalibrationStore:
    def __init__(self, path: Path | None, now: Callable[[], float], check_interval_s: float = 1.0) -> None:
        self._path, self._now, self._interval = path, now, check_interval_s
        self._next = 0.0
        self._seen: tuple[int, int] | None = None
        self._current: Calibration | None = None

    @classmethod
    def fixed(cls, calibration: Calibration | None) -> "CalibrationStore":
        """A store that never reloads (tests, benchmarks)."""
        store = cls(None, lambda: 0.0)
        store._current = calibration
        return store

    @property
    def follows_engine(self) -> bool:
        """Whether spec_engine publishes a calibration here (no calibration then means: measuring)."""
        return self._path is not None

    def current(self) -> Calibration | None:
        # While there is none, look at every request: the first one after the engine published goes to it.
        if self._path is not None and (self._current is None or self._now() >= self._next):
            self._next = self._now() + self._interval
            self._reload()
        return self._current

    def _reload(self) -> None:
        assert self._path is not None
        try:
            st = self._path.stat()
        except FileNotFoundError:
            if self._current is not None:
                log.info("spec_engine withdrew its calibration (it measures again): routing to the baseline until it publishes")
            self._current, self._seen = None, None
            return
        except OSError as exc:
            log.error("calibration %s unreadable, keeping the previous one: %s", self._path, exc)
            return
        signature = (st.st_mtime_ns, st.st_size)
        if signature == self._seen:
            return
        self._seen = signature
        try:
            self._current = Calibration.load(self._path)
        except (OSError, ValueError) as exc:
            log.error("calibration %s unreadable, keeping the previous one: %s", self._path, exc)
            return
        log.info("gate uses spec_engine's %s", self._current.summary())


def tenant_alpha(algorithm: str, rate: float | None) -> float:
    """Per-position acceptance: from the tenant's measured acceptance rate if any, else the prior."""
    spec = ALGORITHMS[algorithm]
    return spec.prior_acceptance if rate is None else alpha_of_rate(rate, spec.default_depth)


def best_algorithm(cal: Calibration, rate: float | None) -> str:
    """The calibrated algorithm with the highest expected speedup at this acceptance."""
    return max(cal.algorithms, key=lambda name: cal.speedup(name, tenant_alpha(name, rate)))


def can_pay(cal: Calibration, algorithm: str) -> bool:
    return cal.algorithms[algorithm].break_even_alpha is not None


def pays(cal: Calibration, algorithm: str, rate: float | None, min_gain: float) -> bool:
    """Drafting at the tenant's acceptance rate (the algorithm's prior acceptance while it has no
    evidence: `rate` None) is expected to buy at least `min_gain`."""
    return cal.speedup(algorithm, tenant_alpha(algorithm, rate)) >= min_gain


def breaker_thresholds(cal: Calibration, algorithm: str) -> tuple[float, float]:
    """(open, close) acceptance-rate thresholds: drafting stops paying below `open`; `close` is 25%
    above it so that a tenant near the line does not flap."""
    rate = cal.break_even_rate(algorithm)
    open_ = 1.0 if rate is None else rate
    return open_, min(1.0, open_ * 1.25)
