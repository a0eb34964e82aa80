"""Prompt-lookup drafters replayed over the target's own greedy replies: acceptance, no timing.

Each bench prompt's greedy reply (the llama.cpp target, exact mode) is generated once; then each
drafter is replayed over it as speculative decoding would run it: at a step it proposes up to k
tokens after prompt + reply so far, the longest prefix equal to the reply's next tokens is
accepted, and the replay moves past it and the bonus token. Greedy verification accepts exactly
that, so the counts are what serving would see at T=0. Printed per category: drafted tokens per
step, accepted / drafted (the price of each drafted token), and accepted per step (what it buys).

Then our drafter by its context class (`NgramDrafter.context`, the class the engine prices a draft
by: the matched suffix's length, 1-4): per class, how
often the reply's next token followed the match, what a 5-token chain (the default k) accepted per
step, and the constant per-position acceptance a with a + a^2 + ... + a^5 equal to that: what the
class's prior stands for (docs/speculative.md, "Priors").

Drafters:
- ours: speculative/ngram.py, the latest earlier occurrence of the longest suffix of 1-4 tokens,
  a chain of k (5, and 16), and k=5 only where that suffix is 3 or 4 tokens long;
- ngram-mod (llama.cpp PR #19164, as described there): a rolling hash of the last n tokens (24)
  in one table shared across requests, drafting what followed, up to 48 tokens;
- ngram-map-k4v (llama.cpp PR #18471): up to four continuations per key of the last n tokens (2),
  the most frequent one drafted as a chain of k.

    python -m bench.ngram_replay --per-category 6 --tokens 128
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from collections.abc import Callable

import torch

from bench.common import GGUF, ROOT, machine_lines, machine_record
from bench.prompts import CATEGORIES, load_prompts
from specgate.algorithms import ALGORITHMS
from specgate.cost_model.goodput import alpha_of_rate
from specgate.decoding.llamacpp_target import LlamaCppTarget
from specgate.decoding.plain import plain_decode
from specgate.decoding.sampling import SamplingParams
from specgate.speculative.ngram import NgramDrafter
from specgate.text.tokenizer import PromptTokenizer

CKPT = ROOT / "artifacts" / "checkpoints" / "smollm2-135m-instruct"

Propose = Callable[[list[int]], list[int]]


def ours(k: int, min_match: int = 1) -> Callable[[], Propose]:
    """Our drafter, proposing only where the matched suffix is at least `min_match` tokens long (its
    `context`): the engine prices a draft by that length, so it mostly drafts from long matches."""

    def make() -> Propose:
        d = NgramDrafter()
        d.begin([], SamplingParams(), torch.Generator())
        return lambda tokens: d.propose(tokens, torch.empty(0), k).tokens.tolist() if d.context(tokens) >= min_match else []

    return make


class NgramMod:
    """A table of the last n tokens' hash -> where they were followed, shared by every request."""

    def __init__(self, n: int = 24, k: int = 48) -> None:
        self.n, self.k = n, k
        self.table: dict[int, tuple[int, ...]] = {}

    def make(self) -> Propose:
        indexed = [0]

        def propose(tokens: list[int]) -> list[int]:
            n = self.n
            for end in range(max(indexed[0], n), len(tokens)):  # keys ending before the root
                self.table[hash(tuple(tokens[end - n : end]))] = tuple(tokens[end : end + self.k])
            indexed[0] = len(tokens)
            if len(tokens) < n:
                return []
            follow = self.table.get(hash(tuple(tokens[-n:])), ())
            return list(follow[: self.k])

        return propose


def ngram_map_k4v(n: int = 2, k: int = 5) -> Callable[[], Propose]:
    def make() -> Propose:
        seen: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        indexed = [n]

        def propose(tokens: list[int]) -> list[int]:
            for end in range(indexed[0], len(tokens) - k + 1):
                key, value = tuple(tokens[end - n : end]), tuple(tokens[end : end + k])
                if value in seen[key] or len(seen[key]) < 4:  # at most four continuations per key
                    seen[key][value] += 1
            indexed[0] = max(indexed[0], len(tokens) - k + 1)
            best = seen.get(tuple(tokens[-n:]))
            return list(best.most_common(1)[0][0]) if best else []

        return propose

    return make


def replay(make: Callable[[], Propose], prompt: list[int], reply: list[int]) -> tuple[int, int, int]:
    """(steps, drafted, accepted) of greedy speculative decoding of `reply` after `prompt`."""
    propose = make()
    steps = drafted = accepted = 0
    i = 0
    while i < len(reply):
        draft = propose(prompt + reply[: i + 1])[: len(reply) - i - 1]  # reply[i] is the root
        a = accepted_prefix(draft, reply, i)
        steps, drafted, accepted = steps + 1, drafted + len(draft), accepted + a
        i += a + 1
    return steps, drafted, accepted


def accepted_prefix(draft: list[int], reply: list[int], root: int) -> int:
    """How many of `draft` (drafted after reply[root]) greedy verification accepts."""
    a = 0
    while a < len(draft) and draft[a] == reply[root + 1 + a]:
        a += 1
    return a


def by_context(prompt: list[int], reply: list[int], k: int = 5) -> list[tuple[int, int]]:
    """(context class, accepted of a k-chain) at each step of `reply` where our drafter matched."""
    d = NgramDrafter()
    d.begin([], SamplingParams(), torch.Generator())
    out, i = [], 0
    while i < len(reply):
        tokens = prompt + reply[: i + 1]
        context = d.context(tokens)
        draft = d.propose(tokens, torch.empty(0), k).tokens.tolist()[: len(reply) - i - 1] if context else []
        a = accepted_prefix(draft, reply, i)
        if context:
            out.append((context, a))
        i += a + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("\n".join(machine_lines(machine_record())), flush=True)
    tok = PromptTokenizer(CKPT, 900)
    target = LlamaCppTarget(GGUF, 1024 + args.tokens, num_slots=1, threads=2, exact=True)
    prompts = load_prompts(limit_per_category=args.per_category)
    replies = []
    for p in prompts:
        ids = tok.encode_prompt(p.text)
        replies.append((p.category, ids, plain_decode(target, ids, args.tokens, SamplingParams(), target.info.eos_token_id)))
    # per pass over the replies: a drafter for each request (ngram-mod's one table shared by the pass's requests)
    drafters: dict[str, Callable[[], Callable[[], Propose]]] = {
        "ours k=5": lambda: ours(5), "ours k=16": lambda: ours(16), "ours k=5, matches of 3+": lambda: ours(5, 3),
        "ours k=5, matches of 4": lambda: ours(5, 4), "ngram-mod n=24": lambda: NgramMod().make,
        "ngram-map-k4v n=2 k=5": ngram_map_k4v,
    }
    print("\n| drafter | category | drafted/step | accepted/drafted | accepted/step |\n|---|---|---|---|---|")
    for name, session in drafters.items():
        for cat in (*CATEGORIES, "overall"):
            make = session()
            rows = [replay(make, ids, reply) for c, ids, reply in replies if cat in (c, "overall")]
            steps, drafted, accepted = (sum(r[i] for r in rows) for i in range(3))
            print(f"| {name} | {cat} | {drafted / steps:.2f} | {accepted / max(drafted, 1):.2f} | {accepted / steps:.2f} |", flush=True)
    steps = [s for _, ids, reply in replies for s in by_context(ids, reply)]
    print("\n| our context class | steps | next token followed | accepted per step, k=5 | constant a | prior |\n|---|---|---|---|---|---|")
    for c in sorted({c for c, _ in steps}):
        accepted = [a for cc, a in steps if cc == c]
        followed = sum(a > 0 for a in accepted) / len(accepted)
        mean = sum(accepted) / len(accepted)
        a = alpha_of_rate(mean / 5, 5)  # the 5-chain's accepted / drafted
        print(f"| {c} | {len(accepted)} | {followed:.2f} | {mean:.2f} | {a:.2f} | {ALGORITHMS['ngram'].prior(c):.2f} |")


if __name__ == "__main__":
    main()
