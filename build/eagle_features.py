"""The target's final features for the EAGLE training stream, cached in resumable shards.

A head step on cached features costs about a fifth of one that also runs the 30-layer target, so the
head can take several passes over the same tokens in the same CPU time (the early probes gained most
from that). Each shard holds whole samples: bf16 features [N, D], token ids, the target's greedy
next token per position, and (offset, length, start) per sample; about 1.15 KB per token.
`python -m build.train_eagle --features-only` fills the cache without training.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from build.eagle_data import WORK, Sample
from specgate.decoding.model import KVCache, Llama

FEATURES = WORK / "features"


@dataclass(frozen=True)
class FeatureSet:
    """All cached samples, concatenated: sample i is rows spans[i] = (offset, length, start)."""

    feats: torch.Tensor  # [N, D] bf16
    ids: torch.Tensor  # [N] long
    greedy: torch.Tensor  # [N] long: argmax target logits at each position (the next token it would emit)
    spans: list[tuple[int, int, int]]

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())


@torch.inference_mode()
def target_features(target: Llama, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Final features [T, D] and the target's greedy next tokens [T] for one sequence."""
    cache = KVCache(target.cfg, 1, len(ids), torch.bfloat16)
    f = target(torch.tensor([ids]), cache, torch.tensor([0]), torch.tensor([0]))[0]
    return f.clone(), target.logits(f).argmax(-1)


def _shards(out: Path) -> list[Path]:
    return sorted(out.glob("shard-*.pt"))


def extract(target: Llama, samples: Iterator[Sample], max_tokens: int, out: Path = FEATURES, shard_tokens: int = 65536) -> None:
    """Run the target over `samples` (a fixed order) until `max_tokens` are cached; resumes after the
    last complete shard (a shard records how many stream items it has consumed in all)."""
    out.mkdir(parents=True, exist_ok=True)
    done = [torch.load(p, weights_only=True, mmap=True) for p in _shards(out)]
    have = sum(int(d["ids"].numel()) for d in done)
    consumed = int(done[-1]["consumed"]) if done else 0
    if have >= max_tokens:
        print(f"[eagle-features] {have:,} tokens cached in {out}", flush=True)
        return
    bar = tqdm(total=max_tokens, initial=have, desc="target features", unit="tok", unit_scale=True)
    buf: dict[str, list] = {"feats": [], "ids": [], "greedy": [], "spans": []}
    n = 0

    def flush() -> None:
        nonlocal n
        shard = {
            "feats": torch.cat(buf["feats"]),
            "ids": torch.tensor(sum(buf["ids"], []), dtype=torch.int32),
            "greedy": torch.cat(buf["greedy"]).to(torch.int32),
            "spans": torch.tensor(buf["spans"], dtype=torch.int64),
            "consumed": torch.tensor(consumed),
        }
        path = out / f"shard-{consumed:07d}.pt"  # named by stream items consumed: unique, in stream order
        torch.save(shard, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)  # atomic: a killed run leaves whole shards only
        buf.update(feats=[], ids=[], greedy=[], spans=[])
        n = 0

    for i, s in enumerate(samples):
        if i < consumed:
            continue
        consumed = i + 1
        f, g = target_features(target, s.ids)
        buf["spans"].append((n, len(s.ids), s.start))
        buf["feats"].append(f)
        buf["ids"].append(s.ids)
        buf["greedy"].append(g)
        n += len(s.ids)
        have += len(s.ids)
        bar.update(len(s.ids))
        if n >= shard_tokens or have >= max_tokens:
            flush()
        if have >= max_tokens:
            break
    if n:
        flush()
    bar.close()


def load(out: Path = FEATURES) -> FeatureSet:
    shards = [torch.load(p, weights_only=True, mmap=True) for p in _shards(out)]
    if not shards:
        raise FileNotFoundError(f"no feature shards in {out}: run `python -m build.train_eagle --features-only`")
    spans, base = [], 0
    for d in shards:
        spans += [(base + int(o), int(n), int(s)) for o, n, s in d["spans"].tolist()]
        base += int(d["ids"].numel())
    return FeatureSet(
        torch.cat([d["feats"] for d in shards]),
        torch.cat([d["ids"] for d in shards]).long(),
        torch.cat([d["greedy"] for d in shards]).long(),
        spans,
    )
