"""Train the EAGLE-1 head for the target on CPU, resumably, then ship it with a card.

Data: the target's own greedy replies to ShareGPT training prompts (self-distilled, generated first
and cached by build.eagle_data), interleaved 3:1 (samples) with whole ShareGPT conversations;
once the distilled set is used up, ShareGPT alone. Target features are computed on the fly (bf16, the
project's own Llama forward, i.e. exactly what the serving drafter sees), never stored.

Loss per pair (f_t, x_{t+1}) -> h_t: SmoothL1(h_t, f_{t+1}) + 0.1 * CE(draft_logits(h_t), g_{t+2})
where g_{t+2} = argmax target.lm_head(f_{t+1}) is the target's greedy token (ignored when outside
the draft vocabulary).

Rerunning continues from artifacts/eagle/ckpt/state.pt until `--minutes` of training are spent.

    python -m build.train_eagle --minutes 65 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from build import eagle_data
from build.eagle_data import CHECKPOINT, WORK, Sample
from specgate.engine.model import KVCache, Llama, load_llama
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


@torch.inference_mode()
def target_features(target: Llama, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Final features [T, D] and the target's greedy next tokens [T] for one sequence."""
    x = torch.tensor([ids])
    cache = KVCache(target.cfg, 1, len(ids), torch.bfloat16)
    f = target(x, cache, torch.tensor([0]), torch.tensor([0]))[0]
    return f.clone(), target.logits(f).argmax(-1)


def make_batch(target: Llama, head: EagleHead, samples: list[Sample], t2d: torch.Tensor) -> dict[str, torch.Tensor]:
    """Pad samples into pair tensors: inputs (f_t, x_{t+1}), targets f_{t+1} and g_{t+2}."""
    L = max(len(s.ids) for s in samples) - 1
    B, D = len(samples), head.cfg.hidden_size
    feats = torch.zeros(B, L, D, dtype=torch.bfloat16)
    tgt = torch.zeros(B, L, D, dtype=torch.bfloat16)
    ids = torch.zeros(B, L, dtype=torch.long)
    labels = torch.full((B, L), -100, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b, s in enumerate(samples):
        f, g = target_features(target, s.ids)
        n = len(s.ids) - 1
        feats[b, :n], tgt[b, :n], ids[b, :n] = f[:-1], f[1:], torch.tensor(s.ids[1:])
        labels[b, :n] = t2d[g[1:]]
        mask[b, max(s.start - 1, 0) : n] = True  # pairs whose predicted feature lies at or after `start`
    labels[~mask] = -100
    return {"feats": feats, "tgt": tgt, "ids": ids, "labels": labels, "mask": mask}


def loss_fn(head: EagleHead, batch: dict[str, torch.Tensor], ce_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = head.forward_train(batch["feats"], batch["ids"])
    h = h.float()
    m = batch["mask"]
    reg = F.smooth_l1_loss(h[m], batch["tgt"][m].float())
    logits = head.draft_logits(h)
    ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    valid = batch["labels"] != -100
    acc = (logits.argmax(-1)[valid] == batch["labels"][valid]).float().mean()
    return reg + ce_weight * ce, {"reg": reg.item(), "ce": ce.item(), "acc": acc.item(), "tokens": int(m.sum())}


def lr_at(frac: float, step: int, base: float, warmup: int) -> float:
    """Linear warm-up, then cosine over the time budget down to 10%."""
    w = min(1.0, (step + 1) / warmup)
    return base * w * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a kill mid-save leaves the previous checkpoint intact


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=65.0, help="training time budget, over all resumes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--distill-prompts", type=int, default=1056, help="self-distilled training prompts (generated first, cached)")
    ap.add_argument("--distill-ratio", type=int, default=3, help="distilled samples per ShareGPT conversation")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ckpt-every", type=float, default=5.0, help="minutes between checkpoints")
    ap.add_argument("--log-every", type=int, default=50, help="steps per loss-curve row")
    ap.add_argument("--eval-prompts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--state", type=Path, default=CKPT, help="resumable training state")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    convs = eagle_data.load_sharegpt()
    train_idx = eagle_data.split_indices(convs, heldout=False)
    if a.distill_prompts:
        eagle_data.generate_distill(convs, train_idx, a.distill_prompts, eagle_data.DISTILL_FILE, 32, 256, 384, a.checkpoint)
    tok = eagle_data.load_tokenizer(a.checkpoint)
    distill = [s for s in sorted(eagle_data.distill_samples(), key=lambda s: s.idx) if not eagle_data.is_heldout(s.idx)]
    stream = data_stream(distill, train_idx, a.distill_ratio, a.seed)
    target = load_llama(a.checkpoint, torch.bfloat16, a.max_len).requires_grad_(False)

    state = torch.load(a.state, weights_only=False) if a.state.exists() else None
    if state is None:
        d2t = eagle_data.draft_vocab(convs, train_idx, tok, a.draft_vocab)
        head = EagleHead(EagleHeadConfig.from_target(target.cfg, a.draft_vocab), target, d2t).float()
        state = {"step": 0, "cursor": 0, "elapsed": 0.0, "tokens": 0, "log": [], "n_distill": len(distill), "args": vars(a)}
    else:
        head = EagleHead(EagleHeadConfig.model_validate(state["cfg"]), target, state["head"]["d2t"]).float()
        head.load_state_dict(state["head"], strict=False)
        if state["n_distill"] != len(distill):
            print(f"[train-eagle] warning: distilled set changed ({state['n_distill']} -> {len(distill)}); stream order shifts")
        print(f"[train-eagle] resuming at step {state['step']}, {state['elapsed'] / 60:.1f} min done", flush=True)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if "opt" in state:
        opt.load_state_dict(state["opt"])
    t2d = torch.full((target.cfg.vocab_size,), -100, dtype=torch.long)
    t2d[head.d2t] = torch.arange(head.d2t.numel())

    def sample_at(ref: tuple[str, int]) -> Sample | None:
        kind, i = ref
        if kind == "d":
            s = distill[i]
            return Sample(s.idx, s.ids[: a.max_len], s.start) if len(s.ids) > s.start + 2 else None
        return next(eagle_data.sharegpt_samples(convs, [i], tok, a.max_len), None)

    budget = a.minutes * 60
    acc_log: dict[str, float] = {"loss": 0.0, "reg": 0.0, "ce": 0.0, "acc": 0.0, "n": 0}
    last_ckpt = time.time()
    bar = tqdm(total=round(budget), initial=round(min(state["elapsed"], budget)), desc="train-eagle", unit="s")

    def checkpoint() -> None:
        state.update(head={k: v for k, v in head.trainable_state().items()}, opt=opt.state_dict(), cfg=head.cfg.model_dump())
        save_state(a.state, state)

    while state["elapsed"] < budget and state["cursor"] < len(stream):
        t0 = time.time()
        samples, n = [], 0
        while n < a.batch_tokens and state["cursor"] < len(stream):
            s = sample_at(stream[state["cursor"]])
            state["cursor"] += 1
            if s is not None:
                samples.append(s)
                n += len(s.ids)
        if not samples:
            break
        batch = make_batch(target, head, samples, t2d)
        for g in opt.param_groups:
            g["lr"] = lr_at(state["elapsed"] / budget, state["step"], a.lr, a.warmup)
        loss, m = loss_fn(head, batch, a.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        state["step"] += 1
        state["tokens"] += m["tokens"]
        dt = time.time() - t0
        state["elapsed"] += dt
        bar.update(round(state["elapsed"]) - bar.n)
        bar.set_postfix(step=state["step"], loss=f"{loss.item():.3f}", acc=f"{m['acc']:.3f}", tok_s=f"{n / dt:.0f}")
        for k in ("reg", "ce", "acc"):
            acc_log[k] += m[k]
        acc_log["loss"] += loss.item()
        acc_log["n"] += 1
        if state["step"] % a.log_every == 0:
            row = {"step": state["step"], "tokens": state["tokens"], "minutes": round(state["elapsed"] / 60, 1)}
            row.update({k: round(acc_log[k] / acc_log["n"], 4) for k in ("loss", "reg", "ce", "acc")})
            state["log"].append(row)
            tqdm.write(json.dumps(row))
            acc_log = {"loss": 0.0, "reg": 0.0, "ce": 0.0, "acc": 0.0, "n": 0}
        if time.time() - last_ckpt > a.ckpt_every * 60:
            checkpoint()
            last_ckpt = time.time()
    bar.close()
    checkpoint()
    save_eagle_head(head.to(torch.bfloat16), a.out)
    print(f"[train-eagle] {state['step']} steps, {state['tokens']} tokens, {state['elapsed'] / 60:.1f} min -> {a.out}", flush=True)

    from build import eval_eagle

    report = eval_eagle.evaluate(a.checkpoint, a.out, convs, a.eval_prompts, threads=a.threads)
    eval_eagle.write_card(a.out / "CARD.md", state, report, distill_prompts=len(distill))


if __name__ == "__main__":
    main()
