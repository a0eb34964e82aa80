"""What the policy says about one request, before any engine or breaker is asked: its tenant, the
mode it asks for itself, which side of the canary it falls on, and the algorithm and k a speculative
route would use (refusing what the engine would refuse). Pure functions of the request, the policy
and spec_engine's calibration; `Gate.decide` (router.py) applies them in the order its rules table gives."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

from specgate.algorithms import ALGORITHMS, SPEC_ALGORITHMS, check_k
from specgate.contract import HEADER_SPEC_MODE
from specgate.cost_model.calibration import Calibration
from specgate.cost_model.route import best_algorithm
from specgate.gate.decision import GateRequest
from specgate.gate.policy import Mode, Policy, PolicyError, TenantPolicy
from specgate.gate.tenants import ORG, TenantKeys

MODES = {m.value: m for m in Mode}
# `auto` without a calibration (the tensorrtllm engines publish none): the algorithm of the default
# TensorRT-LLM build (build/specs/smollm2-eagle.yaml).
AUTO_UNCALIBRATED = "eagle"


def tenant_of(api_key: str | None, policy: Policy, keys: TenantKeys) -> tuple[str, TenantPolicy | None]:
    """The tenant's name (ORG for a missing or unknown key) and its settings (None: the org's)."""
    name = keys.tenant_of(str(api_key)) if api_key else None
    if name is not None:
        return name, policy.tenants.get(name)
    if policy.unknown_tenant == "reject":
        raise PolicyError("x-api-key is missing or not a known tenant key")
    return ORG, None


def requested_mode(inputs: GateRequest, policy: Policy) -> Mode | None:
    """The mode the request asks for itself, if any (header first, then the BOOL input)."""
    if inputs.spec_header is not None:
        mode = MODES.get(inputs.spec_header.strip().lower())
        if mode is not None:
            return mode
        if policy.malformed_header == "reject":
            raise PolicyError(
                f"{HEADER_SPEC_MODE}: invalid value {inputs.spec_header[:32]!r}; "
                f"allowed: {', '.join(MODES)}"
            )
    if inputs.use_speculative_decoding is not None:
        return Mode.PROD if inputs.use_speculative_decoding else Mode.OFF
    return None


def in_canary(key: str, percent: float) -> bool:
    """Deterministic from the request alone (its id, else a digest of its content), never from process
    state: every replica behind a load balancer, and a retry on another one, puts a request on the
    same side of the canary."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 10_000
    return bucket < percent * 100.0


def setting(tenant: TenantPolicy | None, field: str, default: Any) -> Any:
    if tenant is None:
        return default
    value = getattr(tenant, field)
    return default if value is None else value


def speculation(
    inputs: GateRequest, tenant: TenantPolicy | None, policy: Policy, cal: Calibration | None, acceptance_rate: Callable[[], float | None]
) -> tuple[str, int | None]:
    """The algorithm and k a speculative route would use; PolicyError for what the engine would refuse.
    `acceptance_rate`: the tenant's measured acceptance (None while too few samples), asked only for `auto`."""
    algorithm = inputs.speculative_algorithm or setting(tenant, "algorithm", policy.speculative.algorithm)
    if algorithm == "auto":
        algorithm = AUTO_UNCALIBRATED if cal is None else best_algorithm(cal, acceptance_rate())
    if algorithm not in SPEC_ALGORITHMS:
        raise PolicyError(f"speculative_algorithm: invalid value {algorithm[:32]!r}; allowed: {', '.join(SPEC_ALGORITHMS)}")
    if cal is not None and algorithm not in cal.algorithms:
        why = ("it needs an EAGLE head trained for the served model" if ALGORITHMS[algorithm].needs_eagle_head
               else "no draft model is configured")
        raise PolicyError(f"speculative_algorithm {algorithm} is not available on this server ({why}); "
                          f"available: {', '.join(cal.algorithms)}")
    k = inputs.num_speculative_tokens
    if k is None:
        k = setting(tenant, "num_speculative_tokens", policy.speculative.num_speculative_tokens)
    cap = policy.speculative.max_num_speculative_tokens
    if k is not None and cap is not None and k > cap:
        raise PolicyError(f"num_speculative_tokens: {k} is above this server's limit of {cap}")
    try:
        check_k(algorithm, k)  # the engine's own limits (specgate.algorithms)
    except ValueError as exc:
        raise PolicyError(str(exc)) from None
    return algorithm, k

