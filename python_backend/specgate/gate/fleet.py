"""What each prompt class bought on each algorithm across all tenants: evidence for a tenant's class
it has none of its own for yet.

A tenant is judged on its own evidence (breaker.py) and, before it has any, on the algorithm's prior
acceptance on the calibrated curve, which knows nothing of prompt length. Prompt lookup pays on long
prompts and not on short ones, so where the prior falls short of `min_gain` a new tenant's long
prompts started on the baseline (`no_gain`), to be probed one in `probe_fraction`, though other
tenants' long prompts had shown the route paying. Here every speculative request's modelled speedup
also feeds one gain per (algorithm, prompt class) over all tenants (the breaker's warm-up mean,
then its EMA), and the gate reads it for a class where the tenant has no evidence of its own.

Only to admit: a class the fleet found paying, over at least `probe_samples` requests, sends a
tenant's requests of that class to the speculative route, where their own samples take over; a
class the fleet found not paying changes nothing. So one tenant whose requests do not pay cannot hold
another back, and a tenant's own breaker (its open circuit, its evidence) always comes first.
"""

from __future__ import annotations

import threading

from specgate.cost_model.goodput import WarmMean


class FleetGains:
    """Thread-safe; one per gate."""

    def __init__(self) -> None:
        self._gains: dict[tuple[str, int], WarmMean] = {}
        self._lock = threading.Lock()

    def record(self, algorithm: str, prompt_class: int, gain: float, weight: float) -> None:
        with self._lock:
            self._gains.setdefault((algorithm, prompt_class), WarmMean()).add(gain, weight)

    def pays(self, algorithm: str, prompt_class: int, min_gain: float, min_samples: int) -> bool:
        """Whether the fleet's requests of this class on this algorithm bought `min_gain`, over at
        least `min_samples` of them."""
        with self._lock:
            g = self._gains.get((algorithm, prompt_class))
            return g is not None and g.value is not None and g.samples >= min_samples and g.value >= min_gain
