"""Measure each drafter at a fixed k: acceptance, tokens per target step, tokens/s vs plain greedy.

Greedy decoding of --prompts prompts of tests/data/speculative_prompts.json (spread over the
file) on the chosen engine, single sequence, every step drafting k (no cost curve: the point is
the drafter's own quality and cost). Used to choose the drafter defaults: draft-model depth
(--draft-layers: the target's first N layers), the EAGLE-2 tree (--eagle2 depth:top_k:total_tokens)
and the hybrid's split (--hybrid tree_nodes:chain_tokens). Prints one row per configuration. Not a test.

    python -m build.bench_drafters --prompts 20 --max-new 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from build.make_draft_model import DEFAULT_LAYERS, make_draft, make_draft_gguf
from specgate.algorithms import ALGORITHMS, EAGLE_HEAD_ALGORITHMS
from specgate.decoding.config import EngineConfig
from specgate.decoding.loading import load_target
from specgate.decoding.plain import greedy_decode
from specgate.decoding.target import Target
from specgate.speculative import SpeculativeGenerator
from specgate.speculative.draft_model import DraftModelDrafter
from specgate.speculative.drafter import Drafter
from specgate.speculative.eagle import EagleDrafter
from specgate.speculative.eagle2 import Eagle2Drafter
from specgate.speculative.eagle_head import load_eagle_head
from specgate.speculative.hybrid import HybridDrafter
from specgate.speculative.ngram import NgramDrafter
from specgate.text.tokenizer import PromptTokenizer

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "tests" / "data" / "speculative_prompts.json"
CKPT = ROOT / "artifacts" / "checkpoints" / "smollm2-135m-instruct"
GGUF = ROOT / "artifacts" / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_LEN = 512


def first_layers(cfg: EngineConfig, n: int, scratch: Path) -> Target:
    """The target's first n layers + final norm + head, on cfg's engine (what build/make_draft_model.py writes)."""
    if cfg.backend == "llamacpp":
        make_draft_gguf(GGUF, scratch / f"draft-{n}.gguf", n)
        return load_target(cfg, scratch / f"draft-{n}.gguf", num_slots=1)
    make_draft(CKPT, scratch / f"draft-{n}", n)
    return load_target(cfg, scratch / f"draft-{n}", num_slots=1)


def run(gen: SpeculativeGenerator, prompts: list[list[int]], algorithm: str, k: int, max_new: int) -> dict:
    """Per prompt, plain greedy then speculative, back to back: the speedup is paired, so a shared
    machine's load drifting during the run affects both sides alike."""
    tokens = base_tokens = drafts = accepted = draft_tokens = matched = 0
    seconds = base_seconds = 0.0
    for prompt in prompts:
        t0 = time.perf_counter()
        ref = greedy_decode(gen.target, prompt, max_new)
        t1 = time.perf_counter()
        stream = gen.generate(prompt, max_new, algorithm=algorithm, k=k)
        out = [t for block in stream for t in block]
        seconds += time.perf_counter() - t1
        base_seconds += t1 - t0
        tokens, base_tokens = tokens + len(out), base_tokens + len(ref)
        matched += out == ref
        s = stream.stats
        drafts, accepted, draft_tokens = drafts + s.num_drafts, accepted + s.accepted_tokens, draft_tokens + s.draft_tokens
    return {
        "acceptance": accepted / max(draft_tokens, 1),
        "tokens_per_step": 1 + accepted / max(drafts, 1),
        "base_tok_s": base_tokens / base_seconds,
        "tok_s": tokens / seconds,
        "identical": matched / len(prompts),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["llamacpp", "torch"], default="llamacpp")
    ap.add_argument("--eagle-head", type=Path, default=ROOT / "heads" / "smollm2-135m-eagle")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto", help="torch engine and the EAGLE head")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--algorithms", default="ngram,draft_model,eagle,eagle2,hybrid")
    ap.add_argument("--k", default="", help="comma list of k for the chain drafters (default: each drafter's default)")
    ap.add_argument("--draft-layers", default=str(DEFAULT_LAYERS), help="comma list of draft-model depths to try")
    ap.add_argument("--eagle2", default="5:4:8", help="comma list of depth:top_k:total_tokens to try")
    ap.add_argument("--hybrid", default="8:5", help="comma list of tree_nodes:chain_tokens to try (default tree shape)")
    args = ap.parse_args()
    cfg = EngineConfig(backend=args.backend, model=GGUF if args.backend == "llamacpp" else CKPT, dtype=args.dtype, num_threads=args.threads,
                       max_context=MAX_LEN)
    texts = json.loads(PROMPTS.read_text())
    step = len(texts) / args.prompts
    tok = PromptTokenizer(CKPT, MAX_LEN)
    prompts = [tok.encode_prompt(texts[int(i * step)]) for i in range(args.prompts)]
    target = load_target(cfg, cfg.model, num_slots=1, tree_nodes=max(a.max_k for a in ALGORITHMS.values()))
    greedy_decode(target, prompts[0], 4)  # warm-up
    print(f"{args.prompts} prompts x {args.max_new} new tokens, {target.info.backend} {target.info.dtype}, {target.info.threads} thread(s)")
    print(f"{'algorithm':<26}{'k':>4}{'accept':>9}{'tok/step':>10}{'greedy tok/s':>14}{'tok/s':>8}{'speedup':>9}{'identical':>11}")

    V = target.info.vocab_size
    configs: list[tuple[str, Drafter, list[int]]] = []
    algos = args.algorithms.split(",")
    ks = [int(k) for k in args.k.split(",")] if args.k else []
    scratch = Path(tempfile.mkdtemp(prefix="bench-drafters-"))
    if "ngram" in algos:
        configs.append(("ngram", NgramDrafter(), ks or [ALGORITHMS["ngram"].default_k]))
    if "draft_model" in algos:
        for n in map(int, args.draft_layers.split(",")):
            configs.append((f"draft_model ({n} layers)", DraftModelDrafter(first_layers(cfg, n, scratch), V),
                            ks or [ALGORITHMS["draft_model"].default_k]))
    if set(EAGLE_HEAD_ALGORITHMS) & set(algos):
        if not (args.eagle_head / "config.json").exists():
            print(f"(no EAGLE head at {args.eagle_head}: {'/'.join(EAGLE_HEAD_ALGORITHMS)} skipped; `make train-eagle` writes it)")
        else:
            head = load_eagle_head(args.eagle_head, *target.embeddings(), cfg.torch_dtype)
            if "eagle" in algos:
                configs.append(("eagle", EagleDrafter(head, V, MAX_LEN), ks or [ALGORITHMS["eagle"].default_k]))
            for spec in args.eagle2.split(",") if "eagle2" in algos else []:
                depth, top_k, total = map(int, spec.split(":"))
                configs.append((f"eagle2 (d={depth}, top_k={top_k})", Eagle2Drafter(head, V, MAX_LEN, depth=depth, top_k=top_k), [total]))
            for spec in args.hybrid.split(",") if "hybrid" in algos else []:
                nodes, chain = map(int, spec.split(":"))
                drafter = HybridDrafter(Eagle2Drafter(head, V, MAX_LEN), NgramDrafter(), chain_k=chain)
                configs.append((f"hybrid (chain {chain})", drafter, [nodes + chain]))
    for label, drafter, k_list in configs:
        gen = SpeculativeGenerator(target, {drafter.name: drafter})
        for k in k_list:
            r = run(gen, prompts, drafter.name, k, args.max_new)
            print(
                f"{label:<26}{k:>4}{r['acceptance']:>9.2f}{r['tokens_per_step']:>10.2f}{r['base_tok_s']:>14.1f}"
                f"{r['tok_s']:>8.1f}{r['tok_s'] / r['base_tok_s']:>9.2f}{r['identical']:>11.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
