"""What an engine is asked to do and what it reports back, independent of Triton."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field

from specgate.decoding.sampling import SamplingParams
from specgate.stats import SpecStats


class GenerationRequest(BaseModel):
    input_ids: list[int] = Field(min_length=1)
    max_new_tokens: int = Field(ge=1)
    end_id: int | None = None
    stop_words: list[list[int]] = Field(default_factory=list)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    # How many of input_ids' last tokens are output the client already has: a request the gate
    # continues on another engine (a hand-over, a failed engine). A stop word may span them.
    continued: int = Field(0, ge=0)

    def stop_tail(self) -> list[int]:
        """The continued output that a stop word may still end in (all but its last token)."""
        if not self.continued:
            return []
        n = min(self.continued, len(self.input_ids), max((len(w) for w in self.stop_words), default=1) - 1)
        return self.input_ids[len(self.input_ids) - n :] if n > 0 else []


@dataclass
class Event:
    """One step's new tokens for one request; `finished` marks the last event, `error` a failure,
    `handed_over` a speculative request stopped early so the baseline can continue it. The last
    event also reports `cached_tokens`: the target's whole KV cache once this request let go of it."""

    tokens: list[int]
    finished: bool = False
    error: str | None = None
    stats: SpecStats | None = None
    handed_over: bool = False
    cached_tokens: int | None = None


def check_prompt(req: GenerationRequest, max_context: int, vocab_size: int) -> None:
    """ValueError unless the prompt is token ids of the model and leaves room for a new token."""
    if len(req.input_ids) + 1 > max_context:
        raise ValueError(f"prompt of {len(req.input_ids)} tokens leaves no room in the {max_context}-token context")
    if not all(0 <= t < vocab_size for t in req.input_ids):
        raise ValueError(f"input_ids must be token ids in [0, {vocab_size})")


def hits_stop(generated: list[int], stop_words: list[list[int]], before: list[int] | None = None) -> bool:
    """True when the generated tokens end with one of the stop sequences (TensorRT-LLM semantics);
    `before`: output of the request this one continues (GenerationRequest.stop_tail)."""
    seen = before + generated if before else generated
    return any(len(w) <= len(seen) and seen[-len(w) :] == w for w in stop_words if w)
