"""Per-request speculative statistics, with the formulas vLLM and TensorRT-LLM use, and their
tensors in an engine's responses (one mapping, both ways: the engines write it, the gate reads it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specgate.contract import ENGINE_EXTENSIONS, ENGINE_OUTPUTS

_DTYPES = {t.name: t.np_dtype for t in (*ENGINE_OUTPUTS, *ENGINE_EXTENSIONS)}


@dataclass
class SpecStats:
    num_drafts: int = 0  # verification steps that had at least one draft token
    draft_tokens: int = 0  # draft nodes sent to the target (a tree counts all its nodes)
    accepted_tokens: int = 0  # draft tokens accepted (bonus tokens not counted)
    accepted_per_position: list[int] = field(default_factory=list)  # [d] = accepted at depth d+1
    draft_budget: int = -1  # the budget the engine's controller chose at the last step (-1: none yet)
    # The engine's own estimate of how much faster than plain decoding this request's steps were, on
    # its live cost curve: tokens emitted x cost(1) over the sum of cost(1 + draft nodes) plus
    # drafting time per step (1.0: decoded plainly throughout). None where the engine has no curve
    # (tensorrtllm, exactness tests). The gate's breaker reads it: a route whose drafts are rare or
    # cheap to reject can have a high acceptance rate and still buy nothing.
    modelled_speedup: float | None = None

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position += [0] * (num_accepted - len(self.accepted_per_position))
        for d in range(num_accepted):
            self.accepted_per_position[d] += 1

    @property
    def acceptance_rate(self) -> float:
        """accepted / draft tokens."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens emitted per target forward."""
        return 1.0 + self.accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_tensors(self) -> dict[str, np.ndarray]:
        """The statistics' tensors of an engine response, by name, with the contract's dtypes
        (contract.ENGINE_OUTPUTS, ENGINE_EXTENSIONS); a missing speedup is sent as 0."""
        values = {
            "acceptance_rate": [[self.acceptance_rate]],
            "total_accepted_draft_tokens": [[self.accepted_tokens]],
            "total_draft_tokens": [[self.draft_tokens]],
            "num_drafts": [[self.num_drafts]],
            "accepted_per_position": [self.accepted_per_position or [0]],
            "draft_budget": [[self.draft_budget]],
            "modelled_speedup": [[self.modelled_speedup or 0.0]],
        }
        return {name: np.asarray(v, dtype=_DTYPES[name]) for name, v in values.items()}

    @classmethod
    def from_response(cls, out: Callable[[str], np.ndarray | None], last: SpecStats) -> SpecStats:
        """What `to_tensors` wrote, read back through `out` (a response's tensor by name, None where
        absent). Engines may leave the statistics out of a response (tensorrtllm's extensions never
        come; a CPU engine sends them only when they changed): then `last` holds."""
        drafted, accepted = out("total_draft_tokens"), out("total_accepted_draft_tokens")
        if drafted is None or accepted is None:
            return last

        def scalar(name: str) -> float | None:
            t = out(name)
            return None if t is None else t.reshape(-1)[0].item()

        per_pos, drafts = out("accepted_per_position"), scalar("num_drafts")
        budget, gain = scalar("draft_budget"), scalar("modelled_speedup")
        return cls(
            num_drafts=0 if drafts is None else int(drafts),
            draft_tokens=int(drafted.reshape(-1)[0]),
            accepted_tokens=int(accepted.reshape(-1)[0]),
            accepted_per_position=[] if per_pos is None else [int(x) for x in per_pos.reshape(-1) if x > 0],
            draft_budget=-1 if budget is None else int(budget),
            modelled_speedup=None if gain is None or gain <= 0 else float(gain),
        )
