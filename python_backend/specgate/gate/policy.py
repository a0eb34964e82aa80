"""The gate's policy: one YAML (or JSON) file, validated with pydantic, reloaded without a restart.

`Policy` is the whole file. Every field has a default, so an empty mapping (`{}`) is a valid policy;
an empty *file* is not (a half-written file must not silently reset every threshold).

Tenants are named here; which API keys belong to which tenant is in the key file that `key_file`
names (tenants.py), which holds hashes, not keys.

`PolicyStore` owns the current policy and key file. `current()` is called on every decision; it
`stat`s both files at most once per `check_interval_s` and, when either changed, loads and validates
both. An invalid pair is rejected with a logged reason and the previous one stays in force.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specgate.contract import SpecAlgorithm
from specgate.gate.tenants import TenantKeys, TenantName, load_key_file

log = logging.getLogger(__name__)

Percent = Annotated[float, Field(ge=0.0, le=100.0)]
UnitInterval = Annotated[float, Field(ge=0.0, le=1.0)]


class Mode(str, Enum):
    OFF = "off"  # always baseline
    SHADOW = "shadow"  # serve baseline, mirror to the speculative engine and compare
    PROD = "prod"  # serve speculative (subject to the rules)


class PolicyError(ValueError):
    """A request the policy rejects (e.g. a malformed `x-speculative-decoding` value).

    The adapter answers it with `pb_utils.TritonError.INVALID_ARG` and `str(error)` as the message.
    """


def _yaml_off(value: object) -> object:
    # YAML 1.1 reads an unquoted `off` as False; `mode: off` must still mean Mode.OFF.
    return Mode.OFF if value is False else value


class _Strict(BaseModel):
    # A typo in a threshold name must fail loudly, not fall back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True)


# Thresholds an `auto` breaker falls back to when spec_engine publishes no calibration (the
# tensorrtllm engines): the CPU engine's break-even in bf16 PyTorch on a bf16-capable machine.
FALLBACK_OPEN, FALLBACK_CLOSE = 0.08, 0.10


class BreakerPolicy(_Strict):
    """Per-tenant circuit breaker on the rolling acceptance rate (see breaker.py)."""

    ema_weight: float = Field(0.1, gt=0.0, le=1.0)
    # auto: from spec_engine's calibration, the acceptance below which drafting stops paying on this
    # machine (cost_model/route.py), and 25% above it; a number pins it.
    open_threshold: UnitInterval | Literal["auto"] = "auto"
    close_threshold: UnitInterval | Literal["auto"] = "auto"
    min_samples: int = Field(20, ge=1)
    # Open also when the engine's modelled speedup per request (EMA) falls below this: the
    # speculative route must buy more than its own per-step cost over the baseline's (docs/gate.md,
    # "Breaker"). 1.0 never opens on it.
    min_gain: float = Field(1.03, ge=0.0, le=10.0)
    # Prompt lengths (tokens) that part a tenant's modelled gain into classes judged apart: what
    # drafting buys follows what the reply can copy from its prompt (a summary of a long document,
    # against a short chat turn), and one tenant sends both (docs/gate.md, "Gain by prompt length").
    gain_prompt_classes: list[int] = Field(default_factory=lambda: [128, 512])
    cooldown_s: float = Field(30.0, ge=0.0)
    probe_fraction: float = Field(0.1, gt=0.0, le=0.5)
    probe_samples: int = Field(5, ge=1)
    failure_threshold: int = Field(3, ge=1)

    @field_validator("gain_prompt_classes")
    @classmethod
    def _ascending(cls, v: list[int]) -> list[int]:
        if any(b <= a for a, b in zip(v, v[1:])) or any(x < 1 for x in v):
            raise ValueError("breaker.gain_prompt_classes must be prompt lengths >= 1 in ascending order")
        return v

    def prompt_class(self, prompt_tokens: int) -> int:
        """The class of a prompt of this many tokens: 0 below the first boundary, and so on."""
        return bisect.bisect_right(self.gain_prompt_classes, prompt_tokens)

    @model_validator(mode="after")
    def _hysteresis(self) -> BreakerPolicy:
        if (self.open_threshold == "auto") != (self.close_threshold == "auto"):
            raise ValueError("breaker.open_threshold and close_threshold are both auto or both numbers")
        if self.open_threshold != "auto" and self.close_threshold < self.open_threshold:  # type: ignore[operator]
            raise ValueError("breaker.close_threshold must be >= breaker.open_threshold")
        return self

    def pinned(self, open_: float, close: float) -> BreakerPolicy:
        """This policy with `auto` thresholds replaced by the given ones."""
        if self.open_threshold != "auto":
            return self
        return self.model_copy(update={"open_threshold": open_, "close_threshold": close})


class LoadPolicy(_Strict):
    # Speculative only while fewer than this many requests are already in flight; None disables
    # the gate. 1: from 2 concurrent requests on, the batched baseline's throughput beats the
    # one-at-a-time speculative engine's (`make bench-batching`; docs/batching.md, "The gate's default").
    max_in_flight: int | None = Field(1, ge=1)


# Bounds of the admission fields: the gate's thread pool holds one thread per admitted or queued request.
MAX_CONCURRENT_CAP, MAX_QUEUED_CAP = 256, 1024


class AdmissionPolicy(_Strict):
    """The gate's admission queue (admission.py). 16 at once: the baseline batches 8 sequences and
    the speculative engine runs one, so 16 keeps the next batch ready at the engines while bounding
    what waits inside them, where no timeout applies; the rest wait here, where one does."""

    max_concurrent: int = Field(16, ge=1, le=MAX_CONCURRENT_CAP)
    max_queued: int = Field(64, ge=0, le=MAX_QUEUED_CAP)
    # Past this wait for a slot the request is refused (503): an interactive client has given up by
    # then, and a quick refusal lets it back off or go elsewhere.
    queue_timeout_s: float = Field(30.0, gt=0.0, le=600.0)


class ShadowPolicy(_Strict):
    max_concurrent_mirrors: int = Field(2, ge=0, le=64)


Algorithm = SpecAlgorithm | Literal["auto"]


class SpeculativePolicy(_Strict):
    # auto: the algorithm spec_engine's calibration expects fastest on this machine, at the tenant's
    # acceptance (cost_model/route.py); without a calibration (tensorrtllm), eagle.
    algorithm: Algorithm = "auto"
    # None: the engine's own default for whichever algorithm a request ends up with (CPU engine:
    # eagle 5-chain, eagle2 8-node tree, hybrid 13 nodes, ngram 5, draft_model 3), so a tenant or
    # request that picks another algorithm gets that algorithm's length: k means chain length for
    # some, tree nodes for eagle2 and hybrid.
    num_speculative_tokens: int | None = Field(None, ge=1)
    # An operator's cap on k below each algorithm's own maximum (specgate.algorithms); None: those.
    max_num_speculative_tokens: int | None = Field(None, ge=1)
    # No response from spec_engine for this long counts as a failure and the request continues on
    # the baseline: Triton 2.51 never finalizes requests in flight on a Python-backend stub that
    # died, so without it such a client would wait forever.
    stall_timeout_s: float = Field(60.0, gt=0.0)

    @model_validator(mode="after")
    def _within_max(self) -> SpeculativePolicy:
        cap = self.max_num_speculative_tokens
        if self.num_speculative_tokens is not None and cap is not None and self.num_speculative_tokens > cap:
            raise ValueError("speculative.num_speculative_tokens exceeds max_num_speculative_tokens")
        return self


class TenantPolicy(_Strict):
    """Per-tenant settings; `None` means "inherit the org value"."""

    mode: Mode | None = None
    # may the tenant's requests choose their own mode (x-speculative-decoding, use_speculative_decoding)?
    allow_override: bool | None = None
    temperature_threshold: float | None = Field(None, ge=0.0)
    canary_percent: Percent | None = None
    algorithm: Algorithm | None = None
    num_speculative_tokens: int | None = Field(None, ge=1)

    _mode_off = field_validator("mode", mode="before")(_yaml_off)


class Policy(_Strict):
    version: int = 1
    mode: Mode = Mode.OFF
    temperature_threshold: float = Field(0.70, ge=0.0)
    canary_percent: Percent = 100.0
    breaker: BreakerPolicy = BreakerPolicy()
    load: LoadPolicy = LoadPolicy()
    admission: AdmissionPolicy = AdmissionPolicy()
    shadow: ShadowPolicy = ShadowPolicy()
    speculative: SpeculativePolicy = SpeculativePolicy()
    unknown_tenant: Literal["org_default", "reject"] = "org_default"
    malformed_header: Literal["reject", "ignore"] = "reject"
    # Org default (and so for requests without a known key): may a request choose its own mode?
    # Off unless granted: a request that forces `shadow` doubles its cost, one that forces `prod`
    # skips the canary.
    allow_override: bool = False
    # The tenants' key file (tenants.py), relative to this file's folder; None: no tenants.
    key_file: str | None = None
    tenants: dict[TenantName, TenantPolicy] = {}

    _mode_off = field_validator("mode", mode="before")(_yaml_off)

    @field_validator("tenants", mode="before")
    @classmethod
    def _named_not_keyed(cls, tenants: object) -> object:
        if isinstance(tenants, dict) and any(str(k).startswith("sha256:") for k in tenants):
            raise ValueError("tenants are keyed by name now: move each key hash into the key file "
                             "under that name (docs/gate.md, 'Tenants and keys')")
        return tenants

    @model_validator(mode="after")
    def _tenant_tokens_within_max(self) -> Policy:
        limit = self.speculative.max_num_speculative_tokens
        for name, t in self.tenants.items():
            if t.num_speculative_tokens is not None and limit is not None and t.num_speculative_tokens > limit:
                raise ValueError(f"tenant {name}: num_speculative_tokens exceeds {limit}")
        return self


class Loaded(NamedTuple):
    """A policy with the key file it names, validated together."""

    policy: Policy
    keys: TenantKeys


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    """Parse and validate policy text (YAML; JSON is a subset). Raises ValueError with the reason."""
    if not text.strip():
        raise ValueError(f"{source}: policy file is empty")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{source}: not YAML/JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    try:
        return Policy.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"{source}: {e}") from e


def load_policy(path: str | os.PathLike[str]) -> Policy:
    return parse_policy(Path(path).read_text(encoding="utf-8"), str(path))


def key_file_path(policy_path: Path, policy: Policy) -> Path | None:
    return None if policy.key_file is None else policy_path.parent / policy.key_file


_Signature = tuple[tuple[int, int] | None, tuple[int, int] | None]  # (mtime_ns, size) of both files


def _load(path: Path) -> tuple[Loaded, _Signature]:
    """The policy at `path` and its key file, and their signatures taken before reading them (so a
    write during the read shows as a change at the next check). Every tenant the policy configures
    must have a key."""
    policy_sig = _stat(path)
    policy = load_policy(path)
    keys_path = key_file_path(path, policy)
    keys_sig = _stat(keys_path)
    keys = TenantKeys() if keys_path is None else load_key_file(keys_path)
    if missing := sorted(set(policy.tenants) - keys.names):
        where = keys_path or "(no key_file)"
        raise ValueError(f"{path}: tenants with settings but no key in {where}: {', '.join(missing)}")
    return Loaded(policy, keys), (policy_sig, keys_sig)


class PolicyStore:
    """The current policy and key file, hot-reloaded from `path` (None: the built-in defaults and no
    tenants, never reloaded).

    The initial load raises on an invalid or missing file (fail at model load, not at the first
    request). Later an invalid, missing or unreadable file keeps the previous policy and keys.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        check_interval_s: float = 1.0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = Path(path) if path is not None else None
        self._interval = check_interval_s
        self._now = now
        self._lock = threading.Lock()
        self._next_check = now() + check_interval_s
        self._seen: _Signature | None = None  # of the files last loaded or rejected
        if self._path is None:
            self._loaded = Loaded(Policy(), TenantKeys())
        else:
            self._loaded, self._seen = _load(self._path)

    @property
    def path(self) -> Path | None:
        return self._path

    def current(self) -> Policy:
        return self.snapshot().policy

    def snapshot(self) -> Loaded:
        """The policy and the keys that belong to it (one read, so a reload cannot split them)."""
        if self._path is not None and self._now() >= self._next_check:
            self._maybe_reload()
        return self._loaded

    def _maybe_reload(self) -> None:
        # Non-blocking: one caller checks, the others keep deciding with the current policy.
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._next_check = self._now() + self._interval
            assert self._path is not None
            signature = (_stat(self._path), _stat(key_file_path(self._path, self._loaded.policy)))
            if signature == self._seen:
                return
            # Remember the rejected version too, so a bad file is logged once, not every second.
            self._seen = signature
            try:
                loaded, self._seen = _load(self._path)  # its key file may be another one now
            except (OSError, ValueError) as e:
                log.error("policy %s rejected, keeping previous policy and keys: %s", self._path, e)
                return
            self._loaded = loaded
            log.info("policy %s reloaded (version %d, mode %s, %d tenants with keys)", self._path,
                     loaded.policy.version, loaded.policy.mode.value, len(loaded.keys.names))
        finally:
            self._lock.release()


def _stat(path: Path | None) -> tuple[int, int] | None:
    """(mtime_ns, size); None when there is no such file (or no path)."""
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
