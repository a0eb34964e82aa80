"""The llama.cpp target: tree verification in one decode, the cache after commit, batching, features.

The targets run in exact mode (the served default), so a node's logits from one tree decode equal
those of decoding its path as a chain bit for bit, and after `commit` any accepted path continues
exactly as the chain would (test_llamacpp_exact.py covers exact mode itself).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specgate.decoding.llamacpp_target import LlamaCppTarget
from specgate.decoding.tree import DraftTree

MAX_CONTEXT = 512

# root -> a, b; a -> c, d; c -> e; b -> f   (node ids 0..5 = a b c d e f)
PARENTS = [-1, -1, 0, 0, 2, 1]


@pytest.fixture(scope="module")
def tree_target(gguf) -> LlamaCppTarget:  # noqa: ANN001
    return LlamaCppTarget(gguf, MAX_CONTEXT, num_slots=1, threads=2, tree_nodes=16, exact=True)


@pytest.fixture(scope="module")
def chain_target(gguf) -> LlamaCppTarget:  # noqa: ANN001
    return LlamaCppTarget(gguf, MAX_CONTEXT, num_slots=1, threads=2, exact=True)


@pytest.fixture(scope="module")
def case() -> tuple[list[int], int, DraftTree]:
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(40)]
    tree = DraftTree(torch.tensor([rng.randrange(100, 40000) for _ in PARENTS]), torch.tensor(PARENTS))
    return prompt, 1234, tree


def _path(tree: DraftTree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = int(tree.parents[node])
    return out[::-1]


def _chain_logits(target: LlamaCppTarget, prompt: list[int], root: int, tokens: list[int]) -> np.ndarray:
    target.prefill(0, prompt, features=False)
    logits, _ = target.verify(0, root, DraftTree.chain(tokens), features=False)
    target.release(0)
    return logits


def test_every_node_sees_exactly_its_ancestors(tree_target, chain_target, case) -> None:  # noqa: ANN001
    prompt, root, tree = case
    tree_target.prefill(0, prompt, features=False)
    logits, _ = tree_target.verify(0, root, tree, features=False)
    tree_target.release(0)
    for node in range(len(tree)):
        path = _path(tree, node)
        ref = _chain_logits(chain_target, prompt, root, tree.tokens[path].tolist())
        assert np.array_equal(logits[1 + node], ref[-1]), f"node {node} (path {path})"
    assert np.array_equal(logits[0], ref[0])  # the root sees the prompt only


@pytest.mark.parametrize("prompt_len", [20, 27, 29, 45, 60])
def test_a_nodes_logits_do_not_depend_on_where_its_ancestors_sit(tree_target, chain_target, prompt_len: int) -> None:  # noqa: ANN001
    """A wide tree puts a late sibling's child a dozen cells past where its chain puts it, across the
    cache's block boundaries at some prompt lengths: its logits must still be its chain's, bit for bit
    (an attention that rescales or sums by cell position gets them only by chance)."""
    rng = random.Random(prompt_len)
    prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
    parents = [-1] * 12 + [11, 12]  # twelve siblings; the last one's child, and its child
    tree = DraftTree(torch.tensor([rng.randrange(100, 40000) for _ in parents]), torch.tensor(parents))
    tree_target.prefill(0, prompt, features=False)
    logits, _ = tree_target.verify(0, 1234, tree, features=False)
    tree_target.release(0)
    for node in (11, 12, 13):
        ref = _chain_logits(chain_target, prompt, 1234, tree.tokens[_path(tree, node)].tolist())
        assert np.array_equal(logits[1 + node], ref[-1]), f"node {node}, prompt of {prompt_len}"


def test_a_wrong_sequence_assignment_is_detected(tree_target, chain_target, case, monkeypatch) -> None:  # noqa: ANN001
    """The check above fails if nodes are put into the wrong sequences: here b's branch also holds a,
    so b and f see their uncle a (a batch llama.cpp accepts: positions stay consecutive per sequence)."""
    prompt, root, tree = case
    assert tree.branches() == [[0, 3], [0, 2, 4], [1, 5]]
    original = DraftTree.branches
    monkeypatch.setattr(DraftTree, "branches", lambda self: [[0, 3], [0, 2, 4], [0, 1, 5]] if self is tree else original(self))
    tree_target.prefill(0, prompt, features=False)
    logits, _ = tree_target.verify(0, root, tree, features=False)
    tree_target.release(0)
    worst = max(
        float(np.abs(logits[1 + n] - _chain_logits(chain_target, prompt, root, tree.tokens[_path(tree, n)].tolist())[-1]).max())
        for n in range(len(tree))
    )
    assert worst > 1.0


@pytest.mark.parametrize("keep", [[0], [0, 1], [0, 1, 3, 5], [0, 2, 6], [0, 1, 4]])
def test_commit_keeps_the_accepted_path(tree_target, chain_target, case, keep: list[int]) -> None:  # noqa: ANN001
    """After commit the slot holds prompt + root + accepted nodes: the next token's logits equal a
    chain decode's of that path, whether the path runs through first children or later siblings."""
    prompt, root, tree = case
    nxt = 777
    tree_target.prefill(0, prompt, features=False)
    tree_target.verify(0, root, tree, features=False)
    tree_target.commit(0, keep)
    assert tree_target.length(0) == len(prompt) + len(keep)
    after, _ = tree_target.verify(0, nxt, DraftTree.empty(), features=False)
    tree_target.release(0)
    path = [tree.tokens[r - 1].item() for r in keep[1:]]
    chain_target.prefill(0, prompt, features=False)
    chain_target.verify(0, root, DraftTree.chain(path), features=False)
    chain_target.commit(0, list(range(len(keep))))
    ref, _ = chain_target.verify(0, nxt, DraftTree.empty(), features=False)
    chain_target.release(0)
    assert np.array_equal(after[0], ref[0])


def test_batched_forward_matches_each_sequence_alone(gguf) -> None:  # noqa: ANN001
    """One decode holding several sequences (and a joining prompt, asked for out of slot order) gives
    each the logits it gets alone, in the order they were asked for."""
    batched = LlamaCppTarget(gguf, 256, num_slots=4, threads=2, exact=True)
    alone = LlamaCppTarget(gguf, 256, num_slots=1, threads=2, exact=True)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (12, 30, 7)]
    ref = []
    for p in prompts:
        ref.append(alone.forward([(0, p)])[0])
        ref.append(alone.forward([(0, [42])])[0])
        alone.release(0)
    first = batched.forward([(0, prompts[0]), (1, prompts[1])])
    second = batched.forward([(2, prompts[2]), (1, [42]), (0, [42])])
    third = batched.forward([(2, [42])])
    got = [first[0], second[2], first[1], second[1], second[0], third[0]]
    for g, r in zip(got, ref):
        assert np.array_equal(g, r)


def test_a_batch_reaches_llama_cpp_in_slot_order(gguf) -> None:  # noqa: ANN001
    """Each slot is a KV stream of its own, and llama.cpp puts only consecutive sequence ids into one
    ubatch: slots in the order a scheduler admitted them would cost a pass over the weights per run."""
    target = LlamaCppTarget(gguf, 64, num_slots=4, threads=2, exact=True)
    target.forward([(3, [7, 8]), (1, [9]), (2, [10, 11, 12]), (0, [13])])
    assert [int(target._seq[i][0]) for i in range(7)] == [0, 1, 2, 2, 2, 3, 3]


def test_features_are_the_final_hidden_states(gguf, checkpoint) -> None:  # noqa: ANN001
    """llama.cpp's per-token embeddings (pooling none) are the final-norm hidden states the EAGLE head
    was trained on: close to the PyTorch reference's on the same weights (llama.cpp multiplies with
    8-bit activations), and projected on the output table they give llama.cpp's own logits, once
    quantized the way its Q8_0 output matmul quantizes them (`q8_0`; without that step the logits
    differ by up to about 0.5, by how much depends on the build's kernels). The tables, read from the
    GGUF by ggml's reader, are the checkpoint's exactly: transformers dequantized the same file into it."""
    from specgate.decoding.torch_target import TorchTarget

    rng = random.Random(2)
    prompt = [rng.randrange(100, 40000) for _ in range(24)]
    target = LlamaCppTarget(gguf, 128, num_slots=1, threads=2)
    logits, hidden = target.prefill(0, prompt, features=True)
    reference = TorchTarget.load(checkpoint, torch.float32, 128, 1)
    _, ref_hidden = reference.prefill(0, prompt, features=True)
    cos = torch.nn.functional.cosine_similarity(hidden, ref_hidden, dim=-1)
    assert hidden.shape == ref_hidden.shape and cos.min() > 0.99
    embed, lm_head = target.embeddings()
    assert all(torch.equal(ours, ref) for ours, ref in zip((embed, lm_head), reference.embeddings()))
    implied = q8_0(hidden[-1]) @ lm_head.T
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32  # the Target contract: NumPy logits
    logits = torch.from_numpy(logits)
    assert (implied - logits).abs().max() < 0.05 and implied.argmax() == logits.argmax()


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """`x` as ggml's Q8_0 holds it (its quantize_row_q8_0): blocks of 32 scaled to 127 at their largest
    magnitude, rounded to the nearest integer, the scale kept in half precision."""
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127).half().float()).reshape(x.shape)


def test_cached_tokens_is_what_llama_cpp_holds(tree_target, case) -> None:  # noqa: ANN001
    """The engines export cached_tokens as proof that a finished or cancelled request freed its
    cache: llama.cpp's own cells, tree branches included, until release empties them all."""
    prompt, root, tree = case
    assert tree_target.cached_tokens() == 0
    tree_target.prefill(0, prompt, features=False)
    assert tree_target.cached_tokens() == len(prompt)
    tree_target.verify(0, root, tree, features=False)
    assert tree_target.cached_tokens() > len(prompt) + len(tree)  # every branch holds the prefix too
    tree_target.release(0)  # verified, never committed: a request cancelled mid-step
    assert tree_target.cached_tokens() == 0


def test_exact_mode_keeps_repacked_weights_only_where_the_probe_finds_them_invariant(gguf, monkeypatch) -> None:  # noqa: ANN001
    """The probe decodes tokens alone and in batches of several sizes and compares bit for bit: a
    target whose batched rows differ fails it, and an exact target whose probe fails reloads its
    weights in the file's layout (the patch's kernels, invariant by construction) and stays exact."""
    target = LlamaCppTarget(gguf, 128, num_slots=1, threads=2, exact=True)
    assert target._probe_invariance()  # what it kept passes
    forward = target.forward

    def off_by_a_rounding_in_batches(items):  # noqa: ANN001, ANN202
        out = forward(items)
        return out + 1e-6 if sum(len(t) for _, t in items) > 1 else out

    monkeypatch.setattr(target, "forward", off_by_a_rounding_in_batches)
    assert not target._probe_invariance()
    monkeypatch.setattr(LlamaCppTarget, "_probe_invariance", lambda self: False)
    fallback = LlamaCppTarget(gguf, 128, num_slots=1, threads=2, exact=True)
    assert not fallback.repacked
    monkeypatch.undo()
    assert fallback._probe_invariance()


AMX_NEIGHBOURS = """
import sys, torch
from pathlib import Path
from specgate.decoding.llamacpp_target import LlamaCppTarget
from specgate.speculative.eagle_head import load_eagle_head
target = LlamaCppTarget(Path(sys.argv[1]), 256, num_slots=1, threads=2, exact=True)
embed, lm = target.embeddings()
head = load_eagle_head(Path(sys.argv[2]), embed, lm, torch.bfloat16)
g = torch.Generator().manual_seed(0)
x, ids = torch.randn(1, 4, embed.shape[1], generator=g).bfloat16(), torch.randint(0, 1000, (1, 4), generator=g)
def step():
    return head(x, ids, head.new_cache(16, torch.bfloat16), 0)
alone = step()
for size in (1, 40, 1, 40):  # the one-row kernel, then tiles (past 8 rows), each after a head step
    target.prefill(0, list(range(100, 100 + size)), features=False)
    target.release(0)
    assert torch.equal(step(), alone), f"the head computed otherwise after a decode of {size}"
print("ok")
"""


def test_a_bf16_eagle_head_and_llama_cpp_share_a_thread(gguf) -> None:  # noqa: ANN001
    """On a CPU with AMX, PyTorch's oneDNN (the EAGLE head in bf16) and ggml (repacked weights) both
    configure the AMX tiles of the thread they share. ggml configured them once per thread, and its
    next tile load after a bf16 head step raised SIGILL (seen when spec_engine calibrated). In a
    process of its own, so that a crash fails the test with its signal instead of ending the run."""
    import subprocess
    import sys

    from tests.conftest import HEAD

    run = subprocess.run([sys.executable, "-c", AMX_NEIGHBOURS, str(gguf), str(HEAD)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.returncode, run.stderr[-2000:])


def test_kept_graphs_give_what_fresh_graphs_give(gguf, monkeypatch) -> None:  # noqa: ANN001
    """The patched context keeps a graph per recent decode shape (llamacpp_kernels/kept_graphs.cpp).
    Decodes that alternate shapes, chains and a tree, across a growing cache (past the 256 cells at
    which the attention's view of the cache grows), take kept graphs again and give bit for bit the
    logits of a context that builds every graph anew (upstream's LLAMA_GRAPH_REUSE_DISABLE)."""
    import llama_cpp

    monkeypatch.setenv("LLAMA_GRAPH_REUSE_DISABLE", "1")  # read when a context is made
    fresh = LlamaCppTarget(gguf, MAX_CONTEXT, num_slots=1, threads=2, tree_nodes=16, exact=True)
    monkeypatch.delenv("LLAMA_GRAPH_REUSE_DISABLE")
    kept = LlamaCppTarget(gguf, MAX_CONTEXT, num_slots=1, threads=2, tree_nodes=16, exact=True)
    rng = random.Random(3)
    prompt = [rng.randrange(100, 40000) for _ in range(200)]
    tree = DraftTree(torch.tensor([rng.randrange(100, 40000) for _ in PARENTS]), torch.tensor(PARENTS))
    for target in (fresh, kept):
        target.prefill(0, prompt, features=False)
    llama_cpp.llama_perf_context_reset(kept._ctx)
    for step in range(60):
        draft = tree if step % 7 == 3 else DraftTree.chain([rng.randrange(100, 40000) for _ in range([0, 2, 0, 4, 1][step % 5])])
        root, keep = rng.randrange(100, 40000), [0, 1] if len(draft) and step % 2 else [0]
        got, ref = (target.verify(0, root, draft, features=step % 11 == 5)[0] for target in (kept, fresh))
        for target in (fresh, kept):
            target.commit(0, keep)
        assert np.array_equal(got, ref), f"step {step}"
    assert kept.length(0) > 256
    # all but the first decode of each shape (and the shapes the growing cache made new) were kept graphs
    assert llama_cpp.llama_perf_context(kept._ctx).n_reused >= 40
