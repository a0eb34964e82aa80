"""Exact mode of the llama.cpp target: a token's logits are bit-identical whatever its decode holds.

The same token after the same prefix is decoded alone, as the root of a verified chain of 2, 8 and
16 tokens, and beside the next tokens of 7 other sequences; its logits must be equal bit for bit,
below and above 512 cache cells (where upstream's one-token decodes switch to a split-KV attention).
A negative control shows the probe sees the difference exact mode removes.
"""

from __future__ import annotations

import random

import pytest
import torch

from specgate.decoding.llamacpp_target import LlamaCppTarget
from specgate.decoding.tree import DraftTree

MAX_CONTEXT = 1024
X = 1234  # the token whose logits are compared


def _prefix(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _alone(target: LlamaCppTarget, prefix: list[int]) -> torch.Tensor:
    target.prefill(0, prefix, features=False)
    out = target.forward([(0, [X])])[0]
    target.release(0)
    return out


def _root_of_chain(target: LlamaCppTarget, prefix: list[int], size: int) -> torch.Tensor:
    target.prefill(0, prefix, features=False)
    logits, _ = target.verify(0, X, DraftTree.chain([600 + j for j in range(size - 1)]), features=False)
    target.release(0)
    return logits[0]


def _in_a_batch(target: LlamaCppTarget, prefix: list[int]) -> torch.Tensor:
    """X as slot 0's next token, decoded with the next tokens of 7 other sequences of other lengths."""
    target.prefill(0, prefix, features=False)
    for s in range(1, 8):
        target.prefill(s, _prefix(len(prefix) - 5 * s, seed=s), features=False)
    out = target.forward([(0, [X])] + [(s, [777 + s]) for s in range(1, 8)])[0]
    for s in range(8):
        target.release(s)
    return out


@pytest.fixture(scope="module")
def exact_targets(gguf) -> tuple[LlamaCppTarget, LlamaCppTarget]:  # noqa: ANN001
    """(one that verifies trees, one that batches 8 sequences), both exact."""
    return (
        LlamaCppTarget(gguf, MAX_CONTEXT, num_slots=1, threads=2, tree_nodes=16, exact=True),
        LlamaCppTarget(gguf, MAX_CONTEXT, num_slots=8, threads=2, exact=True),
    )


@pytest.mark.parametrize("context", [100, 600])
def test_logits_do_not_depend_on_what_the_decode_holds(exact_targets, context: int) -> None:  # noqa: ANN001
    trees, batch = exact_targets
    prefix = _prefix(context)
    ref = _alone(trees, prefix)
    for size in (2, 8, 16):
        assert torch.equal(_root_of_chain(trees, prefix, size), ref), f"root of a {size}-token verification"
    assert torch.equal(_alone(batch, prefix), ref), "alone, in an 8-slot cache"
    assert torch.equal(_in_a_batch(batch, prefix), ref), "beside 7 other sequences"


def test_without_exact_mode_a_one_token_decode_past_512_cells_differs(gguf) -> None:  # noqa: ANN001
    """The control: upstream kernels give a one-token decode other rounding than a verification
    once the cache passes 512 cells (split-KV attention), so the check above can fail."""
    target = LlamaCppTarget(gguf, MAX_CONTEXT, num_slots=1, threads=2, tree_nodes=16, exact=False)
    prefix = _prefix(600)
    assert not torch.equal(_root_of_chain(target, prefix, 2), _alone(target, prefix))


# root -> a, b; a -> c, d; c -> e; b -> f   (node ids 0..5 = a b c d e f)
PARENTS = [-1, -1, 0, 0, 2, 1]


@pytest.mark.parametrize("keep", [[0, 1, 3, 5], [0, 2, 6], [0, 1, 4], [0, 2]])
def test_a_path_through_a_later_sibling_continues_as_the_chain(exact_targets, keep: list[int]) -> None:  # noqa: ANN001
    """Whatever path a tree accepts, the decodes after it are bit-identical to decoding that path as a
    chain: the accepted tokens past the first hole are decoded again in order, with the next step."""
    trees, _ = exact_targets
    rng = random.Random(3)
    prefix = _prefix(300, seed=3)
    tree = DraftTree(torch.tensor([rng.randrange(100, 40000) for _ in PARENTS]), torch.tensor(PARENTS))
    path = [int(tree.tokens[node - 1]) for node in keep[1:]]
    after = [int(t) for t in torch.randint(100, 40000, (6,), generator=torch.Generator().manual_seed(4))]

    def continue_with(target: LlamaCppTarget) -> list[torch.Tensor]:
        out = []
        for i, tok in enumerate(after):  # a plain step, then chains: the next tree step's shapes
            logits, _ = target.verify(0, tok, DraftTree.chain(after[i + 1 : i + 1 + i % 3]), features=False)
            target.commit(0, [0])
            out.append(logits[0])
        return out

    trees.prefill(0, prefix, features=False)
    trees.verify(0, X, tree, features=False)
    trees.commit(0, keep)
    assert trees.length(0) == len(prefix) + len(keep)
    got = continue_with(trees)
    trees.release(0)
    trees.prefill(0, prefix + [X] + path, features=False)
    ref = continue_with(trees)
    trees.release(0)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert torch.equal(g, r), f"decode {i} after the tree"
