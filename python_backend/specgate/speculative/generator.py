"""The speculative generation loop for one sequence (B = 1, cache slot 0).

    prefill -> root token
    loop: drafter proposes a tree under the root
          one target forward over (root, tree) with the tree mask and depth positions
          verify -> accepted path + bonus token
          compact the target KV cache to the accepted path; tell the drafter
          emit accepted + bonus (truncated at EOS / stop words / max_new_tokens); bonus = new root
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from specgate.engine.model import KVCache, Llama
from specgate.engine.sampling import SamplingParams, sample_token, warp
from specgate.speculative.drafter import Drafter
from specgate.speculative.registry import check_request
from specgate.stats import SpecStats
from specgate.speculative.verify import verify_greedy, verify_sampling


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


class SpeculativeGenerator:
    """Speculative decoding over `target` with the given drafters (name -> drafter).

    One request at a time: the target cache and the drafters' state belong to the stream being
    iterated, so run (or drop) one stream before starting the next one.
    """

    def __init__(self, target: Llama, drafters: Mapping[str, Drafter], max_len: int) -> None:
        self.target = target
        self.drafters = dict(drafters)
        self.max_len = max_len
        self.cache = KVCache(target.cfg, 1, max_len, target.embed.weight.dtype)

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        algorithm: str = "eagle",
        k: int | None = None,
        end_id: int | None = None,
        stop_words: list[list[int]] | None = None,
    ) -> SpecStream:
        """Validate the request now (ValueError on a bad algorithm, k or length); decode lazily."""
        k = check_request(algorithm, k, self.drafters)
        if not prompt_ids or len(prompt_ids) >= self.max_len:
            raise ValueError(f"prompt length {len(prompt_ids)} must be in [1, {self.max_len - 1}]")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        stream = SpecStream()
        stream._steps = self._run(
            stream,
            list(prompt_ids),
            max_new_tokens,
            params or SamplingParams(),
            self.drafters[algorithm],
            k,
            self.target.cfg.eos_token_id if end_id is None else end_id,
            [w for w in stop_words or [] if w],
        )
        return stream

    @torch.inference_mode()
    def _run(
        self,
        stream: SpecStream,
        prompt: list[int],
        max_new: int,
        params: SamplingParams,
        drafter: Drafter,
        k: int,
        end_id: int,
        stop_words: list[list[int]],
    ) -> Iterator[list[int]]:
        gen = params.generator()
        slot = torch.zeros(1, dtype=torch.long)
        hidden = self.target(torch.tensor([prompt]), self.cache, slot, torch.zeros(1, dtype=torch.long))
        root = sample_token(self.target.logits(hidden[0, -1]), params, gen)
        cache_len, tokens, features = len(prompt), prompt + [root], hidden[0]
        drafter.begin(prompt, params, gen)
        out: list[int] = []
        new = [root]
        while True:
            emit, stream.finish_reason = _clip(new, out, max_new, end_id, stop_words)
            out += emit
            if emit:
                yield emit
            if stream.finish_reason is None and cache_len + 1 >= self.max_len:
                stream.finish_reason = "context"  # no room for the root's K/V
            if stream.finish_reason is not None:
                return
            # Draft no more than fits in the cache or than the request still needs.
            budget = min(k, self.max_len - cache_len - 1, max_new - len(out) - 1)
            tree = drafter.propose(tokens, features, budget)
            ids = torch.cat([torch.tensor([tokens[-1]]), tree.tokens]).unsqueeze(0)
            # A chain is the model's default (causal mask, consecutive positions): its cheaper path.
            chain = tree.is_chain
            hidden = self.target(
                ids,
                self.cache,
                slot,
                torch.tensor([cache_len]),
                positions=None if chain else tree.positions(cache_len).unsqueeze(0),
                tree_mask=None if chain else tree.attention_mask(),
            )
            logits = self.target.logits(hidden[0])
            if params.greedy:
                path, bonus = verify_greedy(tree, logits)
            else:
                path, bonus = verify_sampling(tree, warp(logits, params), gen)
            keep = torch.tensor([0] + [1 + i for i in path])  # root + accepted nodes
            self.cache.compact(0, cache_len, keep)
            cache_len += keep.numel()
            features = hidden[0, keep]
            drafter.accept(tree, path)
            stream.stats.record(len(tree), len(path))
            new = tree.tokens[path].tolist() + [bonus]
            tokens += new


def _clip(
    new: list[int], out: list[int], max_new: int, end_id: int, stop_words: list[list[int]]
) -> tuple[list[int], str | None]:
    """The prefix of `new` to emit after `out`, and why generation ends there (None: it goes on)."""
    longest = max((len(w) for w in stop_words), default=0)
    tail = out[len(out) - longest :] if longest else []
    for i, tok in enumerate(new):
        if tok == end_id:
            return new[:i], "eos"
        tail.append(tok)
        if any(tail[-len(w) :] == w for w in stop_words if len(w) <= len(tail)):
            return new[: i + 1], "stop"
        if len(out) + i + 1 >= max_new:
            return new[: i + 1], "length"
    return new, None
