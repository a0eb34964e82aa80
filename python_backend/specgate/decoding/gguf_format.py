"""Another quantization of a GGUF, made by llama.cpp itself (`llama_model_quantize`).

A format's batched kernels decide how flat the verification curve is (docs/engines.md, "Exact
greedy"): the exactness tests run Q4_0 and Q8_0 made from the shipped Q4_1, and bench.perplexity
and bench.curve compare them.
"""

from __future__ import annotations

from pathlib import Path

FORMATS = ("Q4_0", "Q4_1", "Q8_0")


def requantized(gguf: Path, ftype: str, out_dir: Path) -> Path:
    """`gguf` requantized to `ftype`, written once to `out_dir` and reused after."""
    import llama_cpp

    if ftype not in FORMATS:
        raise ValueError(f"unknown format {ftype!r}; one of {', '.join(FORMATS)}")
    out = out_dir / f"{gguf.stem}.{ftype}.gguf"
    if not out.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.allow_requantize = True
        tmp = out.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize could not make {ftype} from {gguf}")
        tmp.rename(out)
    return out
