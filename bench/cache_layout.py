"""`python -m bench.cache_layout`: does a cache that speculation rolled back decode slower?

Two caches of the same length: one filled by a prefill, one grown the way the speculative engine
grows it (each step verifies a chain or a tree of draft tokens and keeps only part of it; the rest is
rolled back). Then plain one-token decodes on each, alternated, on the same target. If rolled-back
cells left holes that later decodes paid for, the second would be slower. Prints both medians and
their ratio, with the machine.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from bench.common import GGUF, machine_lines, machine_record
from specgate.decoding.llamacpp_target import LlamaCppTarget
from specgate.decoding.tree import DraftTree

PARENTS = [-1, -1, 0, 0, 2, 1, 5]  # a small tree: root -> a, b; a -> c, d; c -> e; b -> f -> g


def grow(target: LlamaCppTarget, slot: int, prompt: list[int], length: int, rng: random.Random) -> None:
    """Prefill `prompt`, then verify drafts and keep part of each until the slot holds `length` tokens."""
    target.prefill(slot, prompt, features=False)
    while target.length(slot) < length:
        tokens = [rng.randrange(100, 40000) for _ in PARENTS]
        if rng.random() < 0.5:  # a chain of 6, 0-3 of it accepted
            target.verify(slot, rng.randrange(100, 40000), DraftTree.chain(tokens[:6]), features=False)
            target.commit(slot, list(range(1 + rng.randrange(4))))
        else:  # the tree, accepting a path through a later sibling now and then
            target.verify(slot, rng.randrange(100, 40000), DraftTree(torch.tensor(tokens), torch.tensor(PARENTS)), features=False)
            target.commit(slot, rng.choice([[0], [0, 1], [0, 1, 3], [0, 2, 6], [0, 2, 6, 7]]))
    target.truncate(slot, length)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=600, help="cached tokens when the plain decodes are timed")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    rng = random.Random(0)
    target = LlamaCppTarget(GGUF, 2048, num_slots=1, threads=machine_record()["cores"], tree_nodes=16, exact=args.exact)
    prompt = [rng.randrange(100, 40000) for _ in range(64)]
    times: dict[str, list[float]] = {"prefilled": [], "rolled back": []}
    for r in range(args.rounds):
        for name in (("prefilled", "rolled back") if r % 2 == 0 else ("rolled back", "prefilled")):
            target.release(0)
            if name == "prefilled":
                target.prefill(0, prompt + [rng.randrange(100, 40000) for _ in range(args.length - len(prompt))], features=False)
            else:
                grow(target, 0, prompt, args.length, rng)
            ms = []
            for _ in range(16):
                target.verify(0, rng.randrange(100, 40000), DraftTree.empty(), features=False)
                target.commit(0, [0])
                ms.append(target.last_verify_ms)
            times[name].append(statistics.median(ms[2:]))
    a, b = statistics.median(times["prefilled"]), statistics.median(times["rolled back"])
    print("\n".join(machine_lines(machine_record())))
    print(f"- {args.length} cached tokens, exact={args.exact}, {args.rounds} rounds of 16 plain decodes each (median of each round)")
    for name, xs in times.items():
        print(f"- {name}: {statistics.median(xs):.2f} ms [{min(xs):.2f}-{max(xs):.2f}]")
    print(f"- rolled back / prefilled: {b / a:.3f}")


if __name__ == "__main__":
    main()
