"""The speculative generation loop for one sequence at a time (target slot 0).

    prefill -> root token
    loop: emit the new tokens (truncated at EOS / stop words / max_new_tokens), then one step:
      step: choose the draft budget (cost_model/ledger.py; fixed k without a cost curve)
            the drafter proposes a tree of at most that many nodes under the root
            one target pass over (root, tree), each node seeing only its ancestors
            verify -> accepted path + bonus token; the target keeps the accepted path
            the new tokens: accepted + bonus; bonus = the next root

A budget of 0 makes the step a plain decode of the root on the same cache. The loop and the step
only decode and report what happened; the cost and acceptance bookkeeping is the ledger's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specgate.algorithms import ALGORITHMS, check_k
from specgate.cost_model.goodput import CostCurve, DraftCost
from specgate.cost_model.ledger import EngineLedger, RequestLedger
from specgate.cost_model.live import LiveCurve
from specgate.decoding.request import hits_stop
from specgate.decoding.sampling import SamplingParams, sample_token, warp
from specgate.decoding.target import Target
from specgate.decoding.tree import DraftTree
from specgate.speculative.drafter import Drafter
from specgate.speculative.verify import verify_greedy, verify_sampling
from specgate.stats import SpecStats

SLOT = 0
NO_DRAFT = DraftTree.empty()  # a budget-0 step: a plain decode of the root on the same cache


class SpecStream:
    """Iterate to get lists of new token ids as they are accepted; `stats` fill in as it runs.

    `finish_reason` is set when iteration ends: "eos", "stop", "length" (max_new_tokens) or
    "context" (the KV cache is full). EOS is not emitted; a matched stop sequence is (as the
    baseline engine and TensorRT-LLM do).
    """

    def __init__(self) -> None:
        self.stats = SpecStats()
        self.finish_reason: str | None = None
        self._steps: Iterator[list[int]] = iter(())

    def __iter__(self) -> Iterator[list[int]]:
        return self._steps

    def close(self) -> None:
        """End a stream that is not iterated to its end (it frees the target's slot).

        Call it: a stream left to the garbage collector (it and its generator refer to each other)
        would free the slot at some later moment, in the middle of another request.
        """
        self._steps.close()  # type: ignore[attr-defined]


class SpeculativeGenerator:
    """Speculative decoding over `target` with the given drafters (name -> drafter).

    `curve`: the machine's verification cost curve; each step then drafts the budget that pays most
    (up to the request's k), 0 included, and every verification corrects the curve (LiveCurve).
    Without one every step drafts k (exactness tests).

    One request at a time: the target's slot and the drafters' state belong to the stream being
    iterated, so run (or drop) one stream before starting the next one.
    """

    def __init__(self, target: Target, drafters: Mapping[str, Drafter], curve: CostCurve | None = None) -> None:
        self.target = target
        self.drafters = dict(drafters)
        self.ledger = EngineLedger(self.drafters, curve)
        self.max_len = target.info.max_context

    @property
    def curve(self) -> LiveCurve | None:
        return self.ledger.curve

    @property
    def draft_cost(self) -> dict[str, DraftCost]:
        return self.ledger.draft_cost

    def set_curve(self, curve: CostCurve | None) -> None:
        """Start from a (new) calibration: what the engine learned of the old one is dropped."""
        self.ledger.set_curve(curve)

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        algorithm: str = "ngram",
        k: int | None = None,
        end_id: int | None = None,
        stop_words: list[list[int]] | None = None,
    ) -> SpecStream:
        """Validate the request now (ValueError on a bad algorithm, k or length); decode lazily.
        The entry for direct callers; SpeculativeRunner validates at its own submit and calls `start`."""
        k = self.check(algorithm, k)
        if not prompt_ids or len(prompt_ids) >= self.max_len:
            raise ValueError(f"prompt length {len(prompt_ids)} must be in [1, {self.max_len - 1}]")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return self.start(prompt_ids, max_new_tokens, params or SamplingParams(), algorithm, k, end_id, stop_words or [])

    def start(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        algorithm: str,
        k: int,
        end_id: int | None,
        stop_words: list[list[int]],
        stop_tail: list[int] | None = None,
    ) -> SpecStream:
        """Decode a request validated already (k resolved by `check`); nothing is re-checked.
        `stop_tail`: output of the request this one continues, which a stop word may span."""
        stream = SpecStream()
        stream._steps = self._run(
            stream,
            list(prompt_ids),
            max_new_tokens,
            params,
            algorithm,
            k,
            self.target.info.eos_token_id if end_id is None else end_id,
            [w for w in stop_words if w],
            stop_tail or [],
        )
        return stream

    def check(self, algorithm: str, k: int | None) -> int:
        """The budget cap for a request (its k or the algorithm's default); ValueError naming the
        problem for an unknown or unloaded algorithm or a k out of range."""
        k = check_k(algorithm, k)
        if algorithm not in self.drafters:
            why = (
                "needs an EAGLE head trained for this model, and this engine has none (`make train-eagle` trains one for the shipped model)"
                if ALGORITHMS[algorithm].needs_eagle_head
                else "is not loaded in this engine (draft_model needs a draft model sharing the vocabulary: DRAFT=)"
            )
            raise ValueError(f"speculative algorithm {algorithm!r} {why}; loaded: {', '.join(sorted(self.drafters))}")
        return k

    @torch.inference_mode()
    def _run(
        self,
        stream: SpecStream,
        prompt: list[int],
        max_new: int,
        params: SamplingParams,
        algorithm: str,
        k: int,
        end_id: int,
        stop_words: list[list[int]],
        stop_tail: list[int],
    ) -> Iterator[list[int]]:
        drafter = self.drafters[algorithm]
        r = _Request(stream, drafter, params, params.generator(), self.ledger.request(algorithm, k), max_new)
        try:
            logits, hidden = self.target.prefill(SLOT, prompt, drafter.uses_features)
            new = [sample_token(logits, params, r.gen)]
            r.tokens = prompt + new
            r.pending = [hidden] if hidden is not None else []
            drafter.begin(prompt, params, r.gen)
            while True:
                emit, stream.finish_reason = _clip(new, r.out, max_new, end_id, stop_words, stop_tail)
                r.out += emit
                if emit:
                    yield emit
                if stream.finish_reason is None and self.target.length(SLOT) + 1 >= self.max_len:
                    stream.finish_reason = "context"  # no room for the root's K/V
                if stream.finish_reason is not None:
                    return
                new = self._step(r)
                r.tokens += new
        finally:
            r.ledger.close()
            self.target.release(SLOT)

    def _step(self, r: _Request) -> list[int]:
        """Draft what pays after the root (r.tokens[-1]), verify it in one pass, keep the accepted
        path; returns the new tokens (the accepted ones and the bonus token, the next root)."""
        step_start = time.perf_counter()
        target, drafter = self.target, r.drafter
        context = drafter.context(r.tokens)
        unseen = drafter.backlog(r.tokens, sum(len(f) for f in r.pending))  # what drafting first catches up on
        budget = r.ledger.budget(context, unseen, r.max_new - len(r.out))
        r.stream.stats.draft_budget = budget
        # Draft no more than fits in the cache or than the request still needs.
        budget = min(budget, self.max_len - target.length(SLOT) - 1, r.max_new - len(r.out) - 1)
        tree, drafting_ms, catchup_ms = NO_DRAFT, 0.0, 0.0
        if budget > 0:
            start = time.perf_counter()
            tree = drafter.propose(r.tokens, torch.cat(r.pending) if r.pending else torch.empty(0), budget)
            catchup_ms = drafter.catchup_ms
            drafting_ms = 1000 * (time.perf_counter() - start) - catchup_ms
            r.pending = []
        logits, hidden = target.verify(SLOT, r.tokens[-1], tree, drafter.uses_features)
        if not len(tree):  # what verifying an empty tree draws, without walking one
            path, bonus = [], sample_token(logits[0], r.params, r.gen)
        elif r.params.greedy:
            path, bonus = verify_greedy(tree, logits)
        else:
            path, bonus = verify_sampling(tree, warp(logits, r.params), r.gen)
        keep = [0] + [1 + i for i in path]  # root + accepted nodes
        target.commit(SLOT, keep)
        if hidden is not None:
            r.pending.append(hidden[keep])
        if len(tree):
            drafter.accept(tree, path)
            r.stream.stats.record(len(tree), len(path))
        depth = int(tree.depth.max()) if len(tree) else 0
        step_ms = 1000 * (time.perf_counter() - step_start)
        speedup = r.ledger.step(context, len(tree), depth, len(path), drafting_ms, target.last_verify_ms, step_ms, catchup_ms, unseen)
        if speedup is not None:
            r.stream.stats.modelled_speedup = speedup
        return (tree.tokens[path].tolist() if path else []) + [bonus]


@dataclass
class _Request:
    """One request's decoding state between steps."""

    stream: SpecStream
    drafter: Drafter
    params: SamplingParams
    gen: torch.Generator
    ledger: RequestLedger
    max_new: int
    tokens: list[int] = field(default_factory=list)  # prompt and output; the last one is the next root
    out: list[int] = field(default_factory=list)  # emitted so far
    pending: list[Tensor] = field(default_factory=list)  # target features the drafter has not seen


def _clip(
    new: list[int], out: list[int], max_new: int, end_id: int, stop_words: list[list[int]], before: list[int]
) -> tuple[list[int], str | None]:
    """The prefix of `new` to emit after `out` (which follows `before`, a continued request's earlier
    output), and why generation ends there (None: it goes on)."""
    seen = before + out if before else out
    tail = seen[len(seen) - max((len(w) for w in stop_words), default=0) :]  # all a stop word can span
    for i, tok in enumerate(new):
        if tok == end_id:
            return new[:i], "eos"
        if hits_stop(tail + new[: i + 1], stop_words):
            return new[: i + 1], "stop"
        if len(out) + i + 1 >= max_new:
            return new[: i + 1], "length"
    return new, None
