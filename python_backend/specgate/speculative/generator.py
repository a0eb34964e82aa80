"""The speculative generation loop for one sequence at a time (target slot 0).

    prefill -> root token
    loop: choose the step's draft budget (cost_model/goodput.py; fixed k without a cost curve)
          the drafter proposes a tree of at most that many nodes under the root
          one target pass over (root, tree), each node seeing only its ancestors
          verify -> accepted path + bonus token; the target keeps the accepted path
          emit accepted + bonus (truncated at EOS / stop words / max_new_tokens); bonus = new root

A budget of 0 makes the step a plain decode of the root on the same cache.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from specgate.algorithms import ALGORITHMS, check_k

from specgate.decoding.request import hits_stop
from specgate.decoding.sampling import SamplingParams, sample_token, warp
from specgate.decoding.target import Target
from specgate.decoding.tree import DraftTree
from specgate.cost_model.goodput import PRIOR_WEIGHT, Acceptance, CostCurve, DraftCost, choose_budget
from specgate.cost_model.live import LiveCurve
from specgate.speculative.drafter import Drafter
from specgate.speculative.verify import verify_greedy, verify_sampling
from specgate.stats import SpecStats

SLOT = 0
MAX_REQUEST_PRIOR_WEIGHT = 32.0  # the most of the engine's evidence a request's acceptance starts with
NO_DRAFT = DraftTree.empty()  # a budget-0 step: a plain decode of the root on the same cache
ENGINE_MEMORY = 0.98  # weight of earlier requests in the engine-wide acceptance each request starts from


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
        self.curve: LiveCurve | None = None
        self.set_curve(curve)
        self.max_len = target.info.max_context
        # engine-wide acceptance by (algorithm, drafter context): each request starts from it
        self.acceptance: dict[tuple[str, int], Acceptance] = {}
        self.draft_cost = {name: DraftCost(per_node=ALGORITHMS[name].draft_cost_per_node) for name in self.drafters}
        self._explore = random.Random(0)  # the budget's posterior draws (choose_budget); never the request's generator

    def set_curve(self, curve: CostCurve | None) -> None:
        """Start from a (new) calibration: what the engine learned of the old one is dropped."""
        self.curve = None if curve is None else LiveCurve(curve)

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

    def _engine_acceptance(self, algorithm: str, context: int) -> Acceptance:
        key = (algorithm, context)
        if key not in self.acceptance:
            self.acceptance[key] = Acceptance(prior=[ALGORITHMS[algorithm].prior(context)])
        return self.acceptance[key]

    def _budget(self, algorithm: str, acceptance: Acceptance, k: int) -> int:
        if self.curve is None:
            return k
        return choose_budget(self.curve, acceptance, self.draft_cost[algorithm], k, ALGORITHMS[algorithm].max_depth, self._explore)

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
        drafter, target = self.drafters[algorithm], self.target
        features = drafter.uses_features
        # this request's acceptance by drafter context, each starting from what the engine has seen
        acceptance: dict[int, Acceptance] = {}

        def request_acceptance(context: int) -> Acceptance:
            if context not in acceptance:
                engine = self._engine_acceptance(algorithm, context)
                positions = range(max(k, 1))
                acceptance[context] = Acceptance(
                    prior=[engine.rate(i) for i in positions],
                    weight=[min(PRIOR_WEIGHT + (engine.tries[i] if i < len(engine.tries) else 0.0), MAX_REQUEST_PRIOR_WEIGHT) for i in positions],
                )
            return acceptance[context]

        gen = params.generator()
        logits, hidden = target.prefill(SLOT, prompt, features)
        root = sample_token(logits, params, gen)
        tokens = prompt + [root]
        pending: list[Tensor] = [hidden] if hidden is not None else []  # features the drafter has not seen
        drafter.begin(prompt, params, gen)
        out: list[int] = []
        new = [root]
        plain_ms = spent_ms = 0.0  # what plain decoding would have cost, and what the steps cost (live curve)
        try:
            while True:
                emit, stream.finish_reason = _clip(new, out, max_new, end_id, stop_words, stop_tail)
                out += emit
                if emit:
                    yield emit
                cache_len = target.length(SLOT)
                if stream.finish_reason is None and cache_len + 1 >= self.max_len:
                    stream.finish_reason = "context"  # no room for the root's K/V
                if stream.finish_reason is not None:
                    return
                context = drafter.context(tokens)
                budget = self._budget(algorithm, request_acceptance(context), k)
                stream.stats.draft_budget = budget
                # Draft no more than fits in the cache or than the request still needs.
                budget = min(budget, self.max_len - cache_len - 1, max_new - len(out) - 1)
                tree = NO_DRAFT
                drafting_ms = 0.0
                if budget > 0:
                    start = time.perf_counter()
                    tree = drafter.propose(tokens, torch.cat(pending) if pending else torch.empty(0), budget)
                    drafting_ms = 1000 * (time.perf_counter() - start)
                    self.draft_cost[algorithm].record(drafting_ms, len(tree))
                    pending = []
                logits, hidden = target.verify(SLOT, tokens[-1], tree, features)
                if self.curve is not None:
                    self.curve.record_step(1 + len(tree), target.last_verify_ms)
                if not len(tree):  # what verifying an empty tree draws, without walking one
                    path, bonus = [], sample_token(logits[0], params, gen)
                elif params.greedy:
                    path, bonus = verify_greedy(tree, logits)
                else:
                    path, bonus = verify_sampling(tree, warp(logits, params), gen)
                keep = [0] + [1 + i for i in path]  # root + accepted nodes
                target.commit(SLOT, keep)
                if hidden is not None:
                    pending.append(hidden[keep])
                if len(tree):
                    drafter.accept(tree, path)
                    stream.stats.record(len(tree), len(path))
                    request_acceptance(context).record(int(tree.depth.max()), len(path))
                new = (tree.tokens[path].tolist() if path else []) + [bonus]
                tokens += new
                if self.curve is not None:
                    plain_ms += len(new) * self.curve.cost(1)
                    spent_ms += self.curve.cost(1 + len(tree)) + drafting_ms
                    stream.stats.modelled_speedup = plain_ms / spent_ms
        finally:
            if self.curve is not None:
                self.curve.end_request()
            for context, acc in acceptance.items():
                self._engine_acceptance(algorithm, context).merge(acc, ENGINE_MEMORY)
            target.release(SLOT)


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
