"""What the load generators send: prompt mix by category, temperature mix, tenants, headers, max_tokens.

A workload is a named scenario (`SCENARIOS`) or a YAML file with the same fields (docs/loadtest.md).
`PROMPTS` is a small built-in categorized set; another prompt set can replace it with the YAML field
`prompts: {category: [prompt, ...]}`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from specgate_client import GenerateParams

# Written for this project (not from public benchmark sets). Categories differ in how predictable the
# continuation is, which is what moves speculative acceptance: copying and code repeat the prompt or
# follow strict syntax; open-ended writing does not.
PROMPTS: dict[str, list[str]] = {
    "qa": [
        "What is the capital of Japan, and what is it known for?",
        "Why do leaves change color in autumn?",
        "How does a refrigerator keep food cold?",
        "What is the difference between weather and climate?",
    ],
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Write a SQL query that lists the ten most recent orders from a table named orders.",
        "Write a bash one-liner that counts the lines in every .txt file in a directory.",
        "Write a JavaScript function that checks whether a string is a palindrome.",
    ],
    "summarize": [
        "Summarize in two sentences: The city council met on Tuesday to discuss the new bike lanes. "
        "Residents supported the plan, but shop owners worried about parking. The council will vote next month.",
        "Summarize in one sentence: Photosynthesis lets plants turn sunlight, water and carbon dioxide into "
        "sugar and oxygen. It happens mostly in the leaves, inside the chloroplasts.",
    ],
    "rewrite": [
        "Repeat this sentence exactly twice: the early train leaves the station at seven every morning.",
        "Rewrite this list in alphabetical order: pear, apple, mango, banana, cherry, grape.",
        "Correct the spelling in this sentence: I recieved the pakage on wensday afternoon.",
    ],
    "creative": [
        "Write a short poem about a lighthouse keeper.",
        "Invent a name for a new board game and describe its rules briefly.",
        "Describe a walk through a forest after the rain.",
    ],
}

SPEC_MODES = ("off", "shadow", "prod")


@dataclass(frozen=True)
class Tenant:
    """One client population. `api_key` None sends no x-api-key (org default); `spec_mode` is the
    x-speculative-decoding header this tenant sends (None: the policy decides)."""

    api_key: str | None = None
    weight: float = 1.0
    spec_mode: str | None = None


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    category: str
    params: GenerateParams
    api_key: str | None
    spec_mode: str | None


@dataclass(frozen=True)
class Workload:
    name: str
    max_tokens: int = 64
    # category -> weight; empty: every category of `prompts`, equally
    categories: dict[str, float] = field(default_factory=dict)
    # temperature -> weight
    temperatures: dict[float, float] = field(default_factory=lambda: {0.0: 1.0})
    tenants: tuple[Tenant, ...] = (Tenant(),)
    # header for every request, over the tenants' own (None: each tenant's)
    spec_mode: str | None = None
    # Locust user class weights: protocol -> weight (0 leaves the class out)
    protocols: dict[str, float] = field(default_factory=lambda: {"http": 1.0, "grpc": 1.0})
    prompts: dict[str, list[str]] = field(default_factory=lambda: PROMPTS)

    def __post_init__(self) -> None:
        modes = [self.spec_mode, *(t.spec_mode for t in self.tenants)]
        if bad := [m for m in modes if m is not None and m not in SPEC_MODES]:
            raise ValueError(f"workload {self.name}: spec_mode {bad[0]!r} not in {SPEC_MODES}")
        if unknown := set(self.categories) - set(self.prompts):
            raise ValueError(f"workload {self.name}: no prompts for categories {sorted(unknown)}")
        if unknown := set(self.protocols) - {"http", "grpc"}:
            raise ValueError(f"workload {self.name}: unknown protocols {sorted(unknown)}")

    def sample(self, rng: random.Random) -> RequestSpec:
        cats = self.categories or {c: 1.0 for c in self.prompts}
        category = _pick(rng, cats)
        temperature = _pick(rng, self.temperatures)
        tenant = rng.choices(self.tenants, weights=[t.weight for t in self.tenants])[0]
        # a seed keeps sampled (T > 0) requests reproducible per draw without making them all alike
        params = GenerateParams(max_tokens=self.max_tokens, temperature=temperature, seed=rng.randrange(2**31) if temperature > 0 else None)
        return RequestSpec(rng.choice(self.prompts[category]), category, params, tenant.api_key, self.spec_mode or tenant.spec_mode)

    def with_overrides(self, **kw: Any) -> Workload:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


def _mode(v: Any) -> str | None:
    """YAML reads an unquoted `off` as false."""
    return "off" if v is False else v


def _pick(rng: random.Random, weights: dict[Any, float]) -> Any:
    keys = list(weights)
    return rng.choices(keys, weights=[weights[k] for k in keys])[0]


# Scenarios of `make loadtest` and the report. The header decides everything in baseline and
# speculative ("no gates" apart from the rules no request bypasses: load and breaker, docs/gate.md);
# gated and mixed-temperature send no header, so the server's policy decides.
SCENARIOS: dict[str, Workload] = {
    "baseline": Workload("baseline", spec_mode="off"),
    "speculative": Workload("speculative", spec_mode="prod"),
    "gated": Workload("gated"),
    # half the requests at T >= 0.9, which the temperature rule (T > 0.70) sends to baseline
    "mixed-temperature": Workload("mixed-temperature", temperatures={0.0: 0.5, 0.9: 0.25, 1.0: 0.25}),
}


def load(name_or_path: str) -> Workload:
    """A scenario by name, or a YAML file with Workload's fields (`tenants` a list of mappings)."""
    if name_or_path in SCENARIOS:
        return SCENARIOS[name_or_path]
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"no scenario or workload file {name_or_path!r}; scenarios: {', '.join(SCENARIOS)}")
    data = yaml.safe_load(path.read_text()) or {}
    allowed = {f.name for f in fields(Workload)}
    if unknown := set(data) - allowed:
        raise ValueError(f"{path}: unknown fields {sorted(unknown)}; allowed: {sorted(allowed)}")
    data.setdefault("name", path.stem)
    data["spec_mode"] = _mode(data.get("spec_mode"))
    data["tenants"] = tuple(Tenant(**{**t, "spec_mode": _mode(t.get("spec_mode"))}) for t in data.get("tenants", [{}]))
    if "temperatures" in data:
        data["temperatures"] = {float(k): float(v) for k, v in data["temperatures"].items()}
    return Workload(**data)
