"""Train the EAGLE-1 head for the target on CPU, resumably, then ship it with a card.

Data: the target's own greedy replies to ShareGPT training prompts (self-distilled, generated first
and cached by build.eagle_data), interleaved 3:1 (samples) with whole ShareGPT conversations;
once the distilled set is used up, ShareGPT alone. The target's bf16 features for the first
`--feature-tokens` of that stream are cached once (build.eagle_features, the project's own Llama
forward, i.e. exactly what the serving drafter sees); training then takes epochs over the cache.

Loss per chain level j (`--levels`, EAGLE-3's training-time test: level j feeds the head its own
level j-1 features), at base pair p: SmoothL1(h, f_{p+j+1}) + 0.1 * CE(draft_logits(h), g_{p+j+1})
where g_i = argmax target.lm_head(f_i) is the target's greedy token (ignored when outside the draft
vocabulary); levels are weighted 0.8^j, normalised. With `--ttt-from M`, the first M minutes train
one level (cheap: many passes) and the rest fine-tune with `--levels` at half the learning rate,
which gave the best held-out tau of the runs on heads/smollm2-135m-eagle/CARD.md.

Rerunning continues from artifacts/eagle/ckpt/state.pt until `--minutes` of training are spent.

    python -m build.train_eagle --minutes 65 --levels 3 --ttt-from 40 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from build import eagle_data, eagle_features
from build.eagle_data import CHECKPOINT, WORK, Sample
from build.eagle_features import FeatureSet
from specgate.decoding.model import load_llama
from specgate.speculative.eagle_head import EagleHead, EagleHeadConfig, save_eagle_head

CKPT = WORK / "ckpt" / "state.pt"
OUT = Path("heads/smollm2-135m-eagle")


def data_stream(distill: list[Sample], sharegpt_idx: list[int], ratio: int, seed: int) -> list[tuple[str, int]]:
    """A fixed order of ("d", distill index) / ("s", conversation index): `ratio` distilled samples
    per ShareGPT conversation while the distilled set lasts (a reply is ~1/3 of a conversation's
    tokens), then ShareGPT alone."""
    rng = random.Random(seed)
    d = list(range(len(distill)))
    s = list(sharegpt_idx)
    rng.shuffle(d)
    rng.shuffle(s)
    out: list[tuple[str, int]] = []
    for i in range(max(-(-len(d) // ratio), len(s))):
        out += [("d", j) for j in d[i * ratio : (i + 1) * ratio]]
        if i < len(s):
            out.append(("s", s[i]))
    return out


def batches(spans: list[tuple[int, int, int]], epoch: int, seed: int, batch_tokens: int) -> list[list[int]]:
    """One epoch's batches of sample indices: shuffled, then sorted by length within windows of 64
    samples (less padding), cut at `batch_tokens`, and the batches shuffled again."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = torch.randperm(len(spans), generator=g).tolist()
    out: list[list[int]] = []
    for w in range(0, len(order), 64):
        cur: list[int] = []
        n = 0
        for i in sorted(order[w : w + 64], key=lambda i: spans[i][1]):
            if cur and n + spans[i][1] > batch_tokens:
                out.append(cur)
                cur, n = [], 0
            cur.append(i)
            n += spans[i][1]
        if cur:
            out.append(cur)
    perm = torch.randperm(len(out), generator=g).tolist()
    return [out[i] for i in perm]


def make_batch(fs: FeatureSet, idx: list[int], t2d: torch.Tensor, levels: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors over L+levels positions: features f_i, next tokens x_{i+1}, labels
    t2d[g_i], and `base` = pair rows p whose chain is trained (p >= start-1, p < n-1)."""
    L = max(fs.spans[i][1] for i in idx) - 1
    B, D, W = len(idx), fs.feats.shape[1], L + levels
    feats = torch.zeros(B, W, D, dtype=torch.bfloat16)
    ids = torch.zeros(B, W, dtype=torch.long)
    labels = torch.full((B, W), -100, dtype=torch.long)
    base = torch.zeros(B, L, dtype=torch.bool)
    lens = torch.zeros(B, dtype=torch.long)
    for b, i in enumerate(idx):
        o, n, start = fs.spans[i]
        feats[b, :n] = fs.feats[o : o + n]
        ids[b, : n - 1] = fs.ids[o + 1 : o + n]
        labels[b, :n] = t2d[fs.greedy[o : o + n]]
        base[b, max(start - 1, 0) : n - 1] = True
        lens[b] = n
    return {"feats": feats, "ids": ids, "labels": labels, "base": base, "lens": lens}


def loss_fn(head: EagleHead, batch: dict[str, torch.Tensor], ce_weight: float, levels: int) -> tuple[torch.Tensor, dict[str, float]]:
    L = batch["base"].shape[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hs = head.forward_levels(batch["feats"][:, :L], batch["ids"][:, : L + levels - 1], levels)
    w = torch.tensor([0.8**j for j in range(levels)])
    w = w / w.sum()
    total, m = torch.zeros(()), {}
    rows = torch.arange(L)
    for j, h in enumerate(hs):
        valid = batch["base"] & (rows + j + 1 < batch["lens"].unsqueeze(1))  # f_{p+j+1} exists
        h = h.float()[valid]
        reg = F.smooth_l1_loss(h, batch["feats"][:, j + 1 : j + 1 + L][valid].float())
        labels = batch["labels"][:, j + 1 : j + 1 + L][valid]
        logits = head.draft_logits(h)
        ce = F.cross_entropy(logits, labels, ignore_index=-100)
        total = total + w[j] * (reg + ce_weight * ce)
        if j == 0:
            known = labels != -100
            acc = (logits.argmax(-1)[known] == labels[known]).float().mean()
            m = {"reg": reg.item(), "ce": ce.item(), "acc": acc.item(), "tokens": int(valid.sum())}
    return total, m


def lr_at(frac: float, step: int, base: float, warmup: int) -> float:
    """Linear warm-up, then cosine over the phase down to 10%."""
    w = min(1.0, (step + 1) / warmup)
    return base * w * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def phase(elapsed: float, a: argparse.Namespace) -> tuple[int, float, float]:
    """(chain levels, base lr, fraction of the phase done). With --ttt-from, plain training
    (1 level) runs first, then the training-time test fine-tunes at half the learning rate."""
    budget, switch = a.minutes * 60, (a.ttt_from or 0) * 60
    if not switch:
        return a.levels, a.lr, elapsed / budget
    if elapsed < switch:
        return 1, a.lr, elapsed / switch
    return a.levels, a.lr / 2, (elapsed - switch) / max(budget - switch, 1.0)


def save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a kill mid-save leaves the previous checkpoint intact


def training_samples(a: argparse.Namespace, convs: list[dict], tok) -> Iterator[Sample]:
    """The fixed training stream: self-distilled replies interleaved with ShareGPT conversations."""
    train_idx = eagle_data.split_indices(convs, heldout=False)
    if a.distill_prompts:
        eagle_data.generate_distill(convs, train_idx, a.distill_prompts, eagle_data.DISTILL_FILE, 32, 256, 384, a.checkpoint)
    distill = [s for s in sorted(eagle_data.distill_samples(), key=lambda s: s.idx) if not eagle_data.is_heldout(s.idx)]
    for kind, i in data_stream(distill, train_idx, a.distill_ratio, a.seed):
        if kind == "d":
            s = distill[i]
            if len(s.ids) > s.start + 2:
                yield Sample(s.idx, s.ids[: a.max_len], s.start)
        else:
            yield from eagle_data.sharegpt_samples(convs, [i], tok, a.max_len)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=65.0, help="training time budget, over all resumes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--distill-prompts", type=int, default=1056, help="self-distilled training prompts (generated first, cached)")
    ap.add_argument("--distill-ratio", type=int, default=3, help="distilled samples per ShareGPT conversation")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--feature-tokens", type=int, default=1_000_000, help="stream tokens whose target features are cached")
    ap.add_argument("--features-only", action="store_true", help="fill the feature cache, then stop")
    ap.add_argument("--levels", type=int, default=3, help="chain levels per training step (1 = plain EAGLE-1 training)")
    ap.add_argument("--ttt-from", type=float, default=40.0,
                    help="minutes of plain training before the --levels phase (0: --levels throughout)")
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ckpt-every", type=float, default=5.0, help="minutes between checkpoints")
    ap.add_argument("--log-every", type=int, default=100, help="steps per loss-curve row")
    ap.add_argument("--eval-prompts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    ap.add_argument("--features", type=Path, default=eagle_features.FEATURES)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--state", type=Path, default=CKPT, help="resumable training state")
    return ap.parse_args()


def start_or_resume(a: argparse.Namespace, target, convs: list, tok, fs) -> tuple[EagleHead, dict]:  # noqa: ANN001
    """A fresh head and state, or the ones saved in --state (a resumed run may extend the budget or add a phase)."""
    state = torch.load(a.state, weights_only=False) if a.state.exists() else None
    if state is None:
        d2t = eagle_data.draft_vocab(convs, eagle_data.split_indices(convs, heldout=False), tok, a.draft_vocab)
        head = EagleHead(EagleHeadConfig.from_target(target.cfg, a.draft_vocab), target.embed.weight, target.lm_head.weight, d2t).float()
        state = {"step": 0, "epoch": 0, "pos": 0, "elapsed": 0.0, "tokens": 0, "log": [], "args": vars(a)}
    else:
        head = EagleHead(EagleHeadConfig.model_validate(state["cfg"]), target.embed.weight, target.lm_head.weight,
                         state["head"]["d2t"]).float()
        head.load_state_dict(state["head"], strict=False)
        print(f"[train-eagle] resuming at step {state['step']}, {state['elapsed'] / 60:.1f} min done", flush=True)
        state["args"] = vars(a)
    state["samples"], state["cached_tokens"] = len(fs.spans), fs.tokens
    return head, state


class LossCurve:
    """Averages of the step metrics over `every` steps, appended to the state's log."""

    KEYS = ("loss", "reg", "ce", "acc")

    def __init__(self, state: dict, every: int) -> None:
        self.state, self.every = state, every
        self.sums, self.n = dict.fromkeys(self.KEYS, 0.0), 0

    def add(self, loss: float, m: dict) -> None:
        for k in self.KEYS:
            self.sums[k] += loss if k == "loss" else m[k]
        self.n += 1
        st = self.state
        if st["step"] % self.every == 0:
            row = {"step": st["step"], "epoch": st["epoch"], "tokens": st["tokens"], "minutes": round(st["elapsed"] / 60, 1)}
            row.update({k: round(v / self.n, 4) for k, v in self.sums.items()})
            st["log"].append(row)
            tqdm.write(json.dumps(row))
            self.sums, self.n = dict.fromkeys(self.KEYS, 0.0), 0


def train(a: argparse.Namespace, head: EagleHead, state: dict, fs, vocab_size: int) -> None:  # noqa: ANN001
    """Steps until the time budget is spent, checkpointing every --ckpt-every minutes."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if "opt" in state:
        opt.load_state_dict(state["opt"])
    t2d = torch.full((vocab_size,), -100, dtype=torch.long)
    t2d[head.d2t] = torch.arange(head.d2t.numel())
    budget = a.minutes * 60
    curve = LossCurve(state, a.log_every)
    last_ckpt = time.time()
    bar = tqdm(total=round(budget), initial=round(min(state["elapsed"], budget)), desc="train-eagle", unit="s")

    def checkpoint() -> None:
        state.update(head={k: v for k, v in head.trainable_state().items()}, opt=opt.state_dict(), cfg=head.cfg.model_dump())
        save_state(a.state, state)

    epoch_batches = batches(fs.spans, state["epoch"], a.seed, a.batch_tokens)
    while state["elapsed"] < budget:
        if state["pos"] >= len(epoch_batches):
            state["epoch"], state["pos"] = state["epoch"] + 1, 0
            epoch_batches = batches(fs.spans, state["epoch"], a.seed, a.batch_tokens)
        t0 = time.time()
        levels, lr, frac = phase(state["elapsed"], a)
        batch = make_batch(fs, epoch_batches[state["pos"]], t2d, levels)
        state["pos"] += 1
        for g in opt.param_groups:
            g["lr"] = lr_at(frac, state["step"], lr, a.warmup)
        loss, m = loss_fn(head, batch, a.ce_weight, levels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        state["step"] += 1
        state["tokens"] += m["tokens"]
        dt = time.time() - t0
        state["elapsed"] += dt
        bar.update(round(state["elapsed"]) - bar.n)
        bar.set_postfix(step=state["step"], epoch=state["epoch"], loss=f"{loss.item():.3f}", acc=f"{m['acc']:.3f}",
                        tok_s=f"{m['tokens'] / dt:.0f}")
        curve.add(loss.item(), m)
        if time.time() - last_ckpt > a.ckpt_every * 60:
            checkpoint()
            last_ckpt = time.time()
    bar.close()
    checkpoint()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    convs = eagle_data.load_sharegpt()
    tok = eagle_data.load_tokenizer(a.checkpoint)
    target = load_llama(a.checkpoint, torch.bfloat16, a.max_len).requires_grad_(False)
    eagle_features.extract(target, training_samples(a, convs, tok), a.feature_tokens, a.features)
    if a.features_only:
        return
    fs = eagle_features.load(a.features)
    print(f"[train-eagle] {len(fs.spans):,} cached samples, {fs.tokens:,} tokens", flush=True)
    head, state = start_or_resume(a, target, convs, tok, fs)
    train(a, head, state, fs, target.cfg.vocab_size)
    save_eagle_head(head.to(torch.bfloat16), a.out)
    print(f"[train-eagle] {state['step']} steps, {state['tokens']} tokens, {state['elapsed'] / 60:.1f} min -> {a.out}", flush=True)

    from build import eval_eagle

    report = eval_eagle.evaluate(a.checkpoint, a.out, convs, a.eval_prompts, threads=a.threads)
    eval_eagle.write_card(a.out / "CARD.md", state, report)


if __name__ == "__main__":
    main()
