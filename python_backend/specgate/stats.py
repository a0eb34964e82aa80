"""Per-request speculative statistics, with the formulas vLLM and TensorRT-LLM use."""

from __future__ import annotations

from dataclasses import dataclass, field


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
