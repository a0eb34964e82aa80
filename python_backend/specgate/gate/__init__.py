"""The gate: per-request choice between the baseline and the speculative engine.

policy  - the policy file (pydantic), hot reload
tenants - the key file: API key hashes -> tenant names
labels  - tenant metric labels, keyed by a server secret
breaker - per-tenant acceptance EMA and circuit breaker
decision      - what the gate decides about a request and the words it uses (routes, reasons)
request_rules - what the policy says about one request (tenant, requested mode, canary, algorithm)
router  - `Gate`: decide() and the outcome reports that feed the breaker and metrics
metrics - Prometheus families through Triton's pb_utils.MetricFamily (injected)
"""

from specgate.gate.breaker import Admission, BreakerState, CircuitBreakers
from specgate.gate.decision import REASONS, Decision, GateRequest, GateStats, RequestInputs, Route, RouteResult
from specgate.gate.metrics import GateMetrics
from specgate.gate.policy import Mode, Policy, PolicyError, PolicyStore, load_policy, parse_policy
from specgate.gate.router import Gate

__all__ = [
    "REASONS", "Admission", "BreakerState", "CircuitBreakers", "Decision", "Gate", "GateMetrics",
    "GateRequest", "GateStats", "Mode", "Policy", "PolicyError", "PolicyStore", "RequestInputs", "Route", "RouteResult",
    "load_policy", "parse_policy",
]
