"""Shadow traffic: a request served by the baseline is mirrored on spec_engine, its result discarded.

The mirror's acceptance feeds the tenant's rolling acceptance (so a tenant in shadow mode builds the
evidence that lets it go speculative), and at T=0 its output is compared with what was served
(`spec_gate_shadow_mismatch_total`).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from specgate.gate import Decision, Gate, Route
from specgate.serving.bls import Cancelled
from specgate.serving.engine_client import EngineClient, EngineRefused, HandedOver
from specgate.serving.llm_request import LLMRequest
from specgate.stats import SpecStats

log = logging.getLogger(__name__)

MIRROR_TIMEOUT_S = 600


class Shadow:
    def __init__(self, gate: Gate, engines: EngineClient) -> None:
        self.gate, self.engines = gate, engines
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="shadow")

    def start(self, llm: LLMRequest, d: Decision, prompt: list[int], stops: np.ndarray | None, cancel: threading.Event) -> Future:
        def mirror() -> tuple[list[int], SpecStats] | None:
            ids: list[int] = []
            try:
                stats = self.engines.run("spec_engine", llm, d, prompt, stops, lambda t, s: ids.extend(t), cancel, stream=False)
            except (HandedOver, Cancelled, EngineRefused):
                # stopped early (under load, or its request was cancelled), or refused as invalid (no
                # failure of the engine): nothing to compare
                return None
            return ids, stats

        return self.pool.submit(mirror)

    def end(self, d: Decision, mirror: Future, served: list[int] | None) -> None:
        """Record the mirror once it ends (off the request's thread); `served`: the ids to compare at T=0."""
        self.pool.submit(self._end, d, mirror, served)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _end(self, d: Decision, mirror: Future, served: list[int] | None) -> None:
        try:
            result = mirror.result(timeout=MIRROR_TIMEOUT_S)
        except Exception as exc:
            log.warning("shadow mirror failed: %s", exc)
            self.gate.record_failure(d, Route.SPECULATIVE)
            self.gate.end_shadow(d, None)
            return
        if result is None:
            self.gate.end_shadow(d, None)
            return
        ids, stats = result
        self.gate.record_speculative(d, stats)
        self.gate.end_shadow(d, None if served is None else ids != served)
