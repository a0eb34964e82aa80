"""How often an engine streams: the finest interval whose responses cost at most a budget of its decode.

A streamed response wakes the engine's response sender, Triton, the gate and postprocessing. Where
the decode has every core (2 threads on 2 cores), that work preempts a decode thread and the other
spins at a barrier: on a 2-core Ice Lake VM the engine measured 3-4 ms of decode time a response,
a third of a token (docs/engines.md, "Streaming"). With a core to spare it costs far less.
So no fixed interval is right everywhere, and the engine measures its own price:

- while a streamed request is open (`opened`, `closed`: calibration and plain requests teach
  nothing), every decode of the target reports its shape, start and end (`Target.on_decode`), and
  every response sent is counted (`sent`) in the window of the decode it overlapped (from the
  previous decode's end to this one's) and the next one's, since its work spills over. The time
  fitted is that window's, the Python before the decode included: a response slows that step too
  (the sender thread shares the GIL, other processes preempt it), and fitting the decode alone read
  a response about a tenth cheaper than it was (docs/engines.md, "Streaming");
- a least-squares fit over the last `WINDOW` decodes, one intercept per decode shape (batch size,
  verification size) plus the responses in this window and the previous one, gives what one
  response adds: the sum of those two coefficients. The pacer takes it at one standard error above
  the fit: on a noisy VM successive fits move by a millisecond or more, and too short an interval is
  the side that costs the user;
- one stream's interval is that cost over the budget (5% by default: 2.5 ms a response gives 50 ms),
  at most `MAX_INTERVAL_MS`; with no fit yet, `START_INTERVAL_MS`. N streams open at once (the
  batched baseline) each get N times that, within the same cap: what their responses cost together
  is what the budget bounds.

A fit needs decodes with no response near them. Where the interval is shorter than a few decodes,
the pacer makes some: every `PROBE_EVERY` decodes it holds responses for `PROBE_HOLD` decodes (the
tokens go out together after). A fixed interval (EngineConfig.stream_interval_ms) measures nothing.
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

WINDOW = 512  # decodes the fit looks at: several requests' worth at c=1
REFIT_EVERY = 64  # decodes between fits
MIN_PER_SHAPE = 16  # a shape with fewer decodes in the window is left out of the fit
MIN_DECODES = 192  # no fit from fewer: first fits from 64 decodes ranged up to 15 ms on a 3 ms cost
MIN_QUIET = 12  # decodes with no response in their window or the previous one, needed for a fit
START_INTERVAL_MS = 50.0  # before the first fit: about 5% at what a response cost on 2-core VMs
MAX_INTERVAL_MS = 100.0  # however dear a response, a stream still streams (100 ms: the default of old)
PROBE_EVERY = 32
PROBE_HOLD = 4  # the first held decode still carries the previous send's spill-over: 3 quiet ones
OUTLIER = 3.0  # a decode this many times its shape's median (a host stall) is left out of the fit
# A decode that starts this long after the previous one ended is not part of a steady stream (the
# engine was idle or admitting): its window would count responses whose cost fell in the gap.
MAX_GAP_S = 0.005


@dataclass(frozen=True)
class Pace:
    """One fit's interval and the cost it came from, replaced whole: the decode thread refits while
    the response sender exports, and two separate reads could pair one fit's interval with the next
    fit's cost."""

    interval_ms: float  # for one stream open
    cost_ms: float | None = None  # what one response is taken to cost the decode; None until a fit


@dataclass(frozen=True)
class _Decode:
    shape: Hashable
    seconds: float  # from the previous decode's end to this one's: the Python between, and the decode
    sent: int  # responses sent in this decode's window
    sent_before: int  # ... and in the previous decode's


class StreamPacer:
    """One per engine process: `decoded` from the decode thread, `sent` from the response sender,
    `due` from whichever thread emits events."""

    def __init__(self, budget: float = 0.05, fixed_ms: float | None = None) -> None:
        if not 0 < budget < 1:
            raise ValueError(f"the streaming budget is a fraction of decode time in (0, 1), got {budget}")
        self.budget, self.fixed = budget, fixed_ms is not None
        self.pace = Pace(START_INTERVAL_MS if fixed_ms is None else fixed_ms)
        self._lock = threading.Lock()
        self._sends = 0  # responses sent since the last decode ended
        self._decodes: collections.deque[_Decode] = collections.deque(maxlen=WINDOW)
        self._count = 0
        self._hold_until = 0  # no response is due until this many decodes have been seen
        self._prev_end: float | None = None
        self._prev_sent = 0
        self._streams = 0  # streamed requests open

    @property
    def interval_ms(self) -> float:
        return self.pace.interval_ms

    @property
    def cost_ms(self) -> float | None:
        return self.pace.cost_ms

    def opened(self) -> None:
        with self._lock:
            self._streams += 1

    def closed(self) -> None:
        with self._lock:
            self._streams -= 1

    # -- what the engine reports ----------------------------------------------------------------
    def sent(self) -> None:
        """A streamed response went out."""
        if not self.fixed:
            with self._lock:
                self._sends += 1

    def decoded(self, shape: Hashable, start: float, end: float) -> None:
        """One decode of the target: its shape (anything hashable) and perf_counter start and end."""
        if self.fixed:
            return
        with self._lock:
            sent, self._sends, streaming = self._sends, 0, self._streams > 0
        if not streaming:
            self._prev_end = None
            return
        steady = self._prev_end is not None and start - self._prev_end <= max(MAX_GAP_S, end - start)
        if steady:
            self._decodes.append(_Decode(shape, end - self._prev_end, sent, self._prev_sent))
        self._prev_end, self._prev_sent = end, sent
        self._count += 1
        if self._count % REFIT_EVERY == 0:
            self._refit()
        if self._count % PROBE_EVERY == 0 and self._needs_quiet():
            self._hold_until = self._count + PROBE_HOLD

    def due(self, last_flush: float, now: float) -> bool:
        """Whether a stream that last sent at `last_flush` (-inf: never) may send now (both
        time.monotonic()). A stream's first tokens are always due: a probe's hold must not delay a
        time to first token."""
        if last_flush == float("-inf"):
            return True
        if self._count < self._hold_until:
            return False
        interval = self.interval_ms if self.fixed else min(MAX_INTERVAL_MS, self.interval_ms * max(1, self._streams))
        return (now - last_flush) * 1000 >= interval

    # -- the fit -----------------------------------------------------------------------------
    def _needs_quiet(self) -> bool:
        """Responses could go out every decode or two: the window then has few quiet decodes."""
        if not self._decodes:
            return False
        typical = statistics.median(d.seconds for d in self._decodes) * 1000
        return self.interval_ms < 3 * typical

    def _refit(self) -> None:
        if len(self._decodes) < MIN_DECODES:
            return
        cost = fit_response_cost(list(self._decodes))
        if cost is None:
            return
        interval = min(MAX_INTERVAL_MS, cost / self.budget)
        old = self.pace
        if old.cost_ms is None or abs(interval - old.interval_ms) > 0.2 * max(old.interval_ms, 1.0):
            log.info(
                "streaming: a response costs %.2f ms of decode time; interval %.0f -> %.0f ms (budget %.0f%%)",
                cost, old.interval_ms, interval, 100 * self.budget,
            )
        self.pace = Pace(interval, cost)


def fit_response_cost(decodes: list[_Decode]) -> float | None:
    """Milliseconds one response adds to the decode (the fit plus one standard error), or None
    where the decodes cannot tell."""
    by_shape: dict[Hashable, list[float]] = collections.defaultdict(list)
    for d in decodes:
        by_shape[d.shape].append(d.seconds)
    medians = {s: statistics.median(v) for s, v in by_shape.items() if len(v) >= MIN_PER_SHAPE}
    rows = [d for d in decodes if d.shape in medians and d.seconds <= OUTLIER * medians[d.shape]]
    if sum(d.sent == d.sent_before == 0 for d in rows) < MIN_QUIET:
        return None
    column = {s: i for i, s in enumerate(medians)}
    x = np.zeros((len(rows), len(column) + 2))
    for i, d in enumerate(rows):
        x[i, column[d.shape]] = 1.0
        x[i, -2:] = d.sent, d.sent_before
    if np.linalg.matrix_rank(x) < x.shape[1]:  # e.g. every decode had a response next to it
        return None
    y = np.array([d.seconds for d in rows])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    # the standard error of coef[-2] + coef[-1], from the residuals (ordinary least squares)
    residual = y - x @ coef
    sigma2 = float(residual @ residual) / max(1, len(rows) - x.shape[1])
    pick = np.zeros(x.shape[1])
    pick[-2:] = 1.0
    se = float(np.sqrt(sigma2 * pick @ np.linalg.inv(x.T @ x) @ pick))
    return max(0.0, float(coef[-2] + coef[-1]) + se) * 1000
