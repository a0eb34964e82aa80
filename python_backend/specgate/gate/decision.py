"""What the gate decides about one request, and the words it uses: routes, reason codes (stable:
they are metric label values and the `gate_reason` output), the request it reads (`GateRequest`), its
`Decision`, and the speculative outcome it is told about (`GateStats`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from specgate.gate.policy import Mode
from specgate.gate.tenants import ORG


class Route(StrEnum):
    """Which engine serves a request; the value is the `route` output and metric label."""

    SPECULATIVE = "speculative"
    BASELINE = "baseline"

    @property
    def engine(self) -> str:
        """The Triton model that serves this route."""
        return "spec_engine" if self is Route.SPECULATIVE else "target_engine"


# Reason codes: stable, they are metric label values and the `gate_reason` output.
MODE_OFF = "mode_off"
TEMPERATURE = "temperature"
CANARY_OUT = "canary_out"
LOAD = "load"
CIRCUIT_OPEN = "circuit_open"
SHADOW = "shadow"
SHADOW_BUSY = "shadow_busy"
HALF_OPEN_PROBE = "half_open_probe"
GAIN_PROBE = "gain_probe"
CANARY_IN = "canary_in"
PROD = "prod"
NO_GAIN = "no_gain"
CALIBRATING = "calibrating"
REASONS: tuple[str, ...] = (
    MODE_OFF, TEMPERATURE, CALIBRATING, CANARY_OUT, LOAD, NO_GAIN, CIRCUIT_OPEN, SHADOW, SHADOW_BUSY,
    HALF_OPEN_PROBE, GAIN_PROBE, CANARY_IN, PROD,
)
# Each reason has one route: the label sets of spec_gate_decisions_total, exported at 0 from load.
ROUTE_OF: dict[str, Route] = {
    reason: Route.SPECULATIVE if reason in (HALF_OPEN_PROBE, GAIN_PROBE, CANARY_IN, PROD) else Route.BASELINE for reason in REASONS
}


class GateRequest(Protocol):
    """What decide() reads from a request (`specgate.serving.llm_request.LLMRequest` has these fields).

    Strings are already decoded; absent is None. `temperature` should be the effective one (None
    passes the temperature gate).
    """

    @property
    def request_id(self) -> str: ...
    @property
    def canary_key(self) -> str: ...  # a digest of the request's content (the canary hashes it without an id)
    @property
    def api_key(self) -> str | None: ...
    @property
    def spec_header(self) -> str | None: ...  # the x-speculative-decoding parameter, raw
    @property
    def use_speculative_decoding(self) -> bool | None: ...
    @property
    def temperature(self) -> float | None: ...
    @property
    def speculative_algorithm(self) -> str | None: ...
    @property
    def num_speculative_tokens(self) -> int | None: ...
    @property
    def prompt_tokens(self) -> int: ...  # the prompt's length (0: unknown); its class keys the tenant's gain


@dataclass(frozen=True, slots=True)
class RequestInputs:
    """A plain GateRequest (tests, benchmarks, adapters without an LLMRequest)."""

    request_id: str = ""
    canary_key: str = ""
    api_key: str | None = None
    spec_header: str | None = None
    use_speculative_decoding: bool | None = None
    temperature: float | None = None
    speculative_algorithm: str | None = None
    num_speculative_tokens: int | None = None
    prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RouteResult:
    """What the routing rules found for one request (router.Gate._route)."""

    route: Route
    reason: str
    shadow: bool = False  # serve on the baseline and mirror on spec_engine (a mirror slot is taken)
    probe: bool = False  # admitted as a half-open probe (prod) or a probing mirror (shadow)


@dataclass(frozen=True, slots=True)
class Decision:
    route: Route
    reason: str
    shadow: bool  # serve baseline AND mirror to the speculative engine; call end_shadow() after
    algorithm: str
    num_speculative_tokens: int | None  # None: the engine's default for the algorithm
    mode: Mode
    tenant: str  # metric label: 8 hex of an HMAC of the tenant's name under the server secret, or "org"
    probe: bool = False  # admitted as a half-open probe (prod) or a probing mirror (shadow)
    tenant_key: str = ORG  # breaker key: the tenant's name in the key file, or "org"
    prompt_class: int = 0  # BreakerPolicy.prompt_class of the prompt: its gain is kept apart


class GateStats(Protocol):
    """One finished speculative request or shadow mirror (`specgate.stats.SpecStats` is one).

    `num_drafts` (verification steps), `accepted_per_position` and `modelled_speedup` are CPU-engine
    extensions (None or empty from tensorrtllm); when
    `num_drafts` is 0 or None while tokens were drafted (tensorrtllm) it is estimated as
    ceil(draft_tokens / num_speculative_tokens), exact for fixed-length chains (and left at 0 when
    the decision leaves k to the engine's default).
    """

    @property
    def draft_tokens(self) -> int: ...
    @property
    def accepted_tokens(self) -> int: ...
    @property
    def num_drafts(self) -> int | None: ...
    @property
    def accepted_per_position(self) -> Sequence[int]: ...
    @property
    def modelled_speedup(self) -> float | None: ...
