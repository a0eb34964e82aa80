"""Exact mode of the llama.cpp target: a token's logits are bit-identical whatever its decode holds.

The same token after the same prefix is decoded alone, as the root of a verified chain of 2, 8, 16
and 64 tokens, and beside the next tokens of 7 other sequences; its logits must be equal bit for
bit, below and above 512 cache cells (where upstream's one-token decodes switch to a split-KV
attention), and every token of a 64-token verification must match its one-at-a-time decode (64
queries: upstream's tiled attention). For every format the patch's tile kernels cover (the shipped
Q4_1, and Q4_0 and Q8_0 made from it), with the tile kernels and with the per-row kernels of the
earlier exact mode. A negative control shows the probe sees the difference exact mode removes.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specgate.decoding.gguf_format import requantized
from specgate.decoding.llamacpp_native import native
from specgate.decoding.llamacpp_target import LlamaCppTarget
from specgate.decoding.tree import DraftTree
from tests.conftest import TEST_OUT

MAX_CONTEXT = 1024
X = 1234  # the token whose logits are compared


def _prefix(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _alone(target: LlamaCppTarget, prefix: list[int]) -> np.ndarray:
    target.prefill(0, prefix, features=False)
    out = target.forward([(0, [X])])[0]
    target.release(0)
    return out


def _root_of_chain(target: LlamaCppTarget, prefix: list[int], size: int) -> np.ndarray:
    target.prefill(0, prefix, features=False)
    logits, _ = target.verify(0, X, DraftTree.chain([600 + j for j in range(size - 1)]), features=False)
    target.release(0)
    return logits[0]


def _in_a_batch(target: LlamaCppTarget, prefix: list[int]) -> np.ndarray:
    """X as slot 0's next token, decoded with the next tokens of 7 other sequences of other lengths."""
    target.prefill(0, prefix, features=False)
    for s in range(1, 8):
        target.prefill(s, _prefix(len(prefix) - 5 * s, seed=s), features=False)
    out = target.forward([(0, [X])] + [(s, [777 + s]) for s in range(1, 8)])[0]
    for s in range(8):
        target.release(s)
    return out


@pytest.fixture(scope="module", params=["Q4_1", "Q4_0", "Q8_0"])
def exact_targets(gguf, request) -> tuple[LlamaCppTarget, LlamaCppTarget]:  # noqa: ANN001
    """(one that verifies trees, one that batches 8 sequences), both exact, on the shipped file or
    one made from it."""
    path = gguf if request.param == "Q4_1" else requantized(gguf, request.param, TEST_OUT)
    targets = (
        LlamaCppTarget(path, MAX_CONTEXT, num_slots=1, threads=2, tree_nodes=64, exact=True),
        LlamaCppTarget(path, MAX_CONTEXT, num_slots=8, threads=2, exact=True),
    )
    assert targets[0].info.dtype == request.param
    return targets


@pytest.fixture(params=["tile kernels", "per-row kernels"])
def kernels(request):  # noqa: ANN001, ANN201
    """The patch's tile kernels and blocked attention (the default), or the per-row kernels of the
    earlier exact mode (which benchmarks measure them against): both must be exact."""
    native().set_tile_kernels(request.param == "tile kernels")
    yield request.param
    native().set_tile_kernels(True)


@pytest.mark.parametrize("context", [100, 600])
def test_logits_do_not_depend_on_what_the_decode_holds(exact_targets, kernels, context: int) -> None:  # noqa: ANN001
    trees, batch = exact_targets
    prefix = _prefix(context)
    ref = _alone(trees, prefix)
    for size in (2, 8, 16, 64):
        assert np.array_equal(_root_of_chain(trees, prefix, size), ref), f"root of a {size}-token verification"
    assert np.array_equal(_alone(batch, prefix), ref), "alone, in an 8-slot cache"
    assert np.array_equal(_in_a_batch(batch, prefix), ref), "beside 7 other sequences"


def test_every_token_of_a_64_token_verification_is_its_one_token_decode(exact_targets, kernels) -> None:  # noqa: ANN001
    """64 queries in one decode: where upstream's attention switches to its tiled kernel and the
    matmuls see their largest column counts, every row must still be its one-at-a-time result."""
    trees, _ = exact_targets
    prefix = _prefix(200, seed=7)
    chain = [int(t) for t in torch.randint(100, 40000, (64,), generator=torch.Generator().manual_seed(8))]
    trees.prefill(0, prefix, features=False)
    rows, _ = trees.verify(0, chain[0], DraftTree.chain(chain[1:]), features=False)
    trees.release(0)
    trees.prefill(0, prefix, features=False)
    for i, tok in enumerate(chain):
        assert np.array_equal(trees.forward([(0, [tok])])[0], rows[i]), f"token {i} of the verification"
    trees.release(0)


def test_without_exact_mode_a_one_token_decode_past_512_cells_differs(gguf) -> None:  # noqa: ANN001
    """The control: upstream kernels give a one-token decode other rounding than a verification
    once the cache passes 512 cells (split-KV attention), so the check above can fail."""
    target = LlamaCppTarget(gguf, MAX_CONTEXT, num_slots=1, threads=2, tree_nodes=16, exact=False)
    prefix = _prefix(600)
    assert not np.array_equal(_root_of_chain(target, prefix, 2), _alone(target, prefix))


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

    def continue_with(target: LlamaCppTarget) -> list[np.ndarray]:
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
        assert np.array_equal(g, r), f"decode {i} after the tree"
