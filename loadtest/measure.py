"""One timed streaming request and its latency metrics: the only place TTFT/TPOT are defined, so the
Locust users and the report measure the same way.

- TTFT: time to the first chunk that carries text.
- TPOT: (time of the last chunk - TTFT) / (output tokens - 1), as vLLM and TensorRT-LLM's benchmarks
  define it; a speculative step delivers several tokens in one chunk, so chunks are not tokens.
- tokens/s: output tokens / end-to-end latency, per request.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

from loadtest.workloads import RequestSpec
from specgate_client import Chunk, GenerateParams, Result


class StreamingClient(Protocol):
    def stream(self, prompt: str, p: GenerateParams, api_key: str | None = None, spec_mode: str | None = None) -> Any: ...


@dataclass
class Sample:
    category: str
    temperature: float
    e2e_s: float
    error: str | None = None
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    tokens: int = 0
    route: str = "-"
    reason: str = "-"
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.e2e_s if self.e2e_s > 0 else math.nan


def timed(client: StreamingClient, spec: RequestSpec) -> Sample:
    """Stream one request; errors become a Sample with `error` set (never raised)."""
    t0 = time.perf_counter()
    result = Result()
    try:
        for chunk in client.stream(spec.prompt, spec.params, api_key=spec.api_key, spec_mode=spec.spec_mode):
            result.chunks.append(chunk)
    except Exception as exc:  # a load generator counts failures instead of stopping
        return Sample(spec.category, spec.params.temperature, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}")
    return from_result(result, spec, time.perf_counter() - t0)


def from_result(result: Result, spec: RequestSpec, e2e_s: float) -> Sample:
    meta = result.meta
    tokens = int(meta.get("num_output_tokens") or 0)
    s = Sample(spec.category, spec.params.temperature, e2e_s)
    if not result.chunks or tokens == 0:
        s.error = "empty response"
        return s
    last: Chunk = result.chunks[-1]
    s.ttft_s = result.ttft
    s.tpot_s = (last.t - s.ttft_s) / (tokens - 1) if tokens > 1 else math.nan
    s.tokens = tokens
    s.route, s.reason = str(meta.get("route")), str(meta.get("gate_reason"))
    s.draft_tokens, s.accepted_tokens = int(meta.get("num_draft_tokens") or 0), int(meta.get("num_accepted_tokens") or 0)
    return s
