"""A runtime switch for batch-invariant kernels, patched into the llama.cpp that `make setup` builds.

Why a patch: llama.cpp's CPU backend picks kernels by the shape of a decode, and the kernels sum in
different orders, so a token's logits depend on what else the decode holds (docs/engines.md,
"Exact greedy"). At temperature 0 that makes the speculative route and a batched baseline disagree
with a one-token step at near-ties. ggml has a switch for its reference paths (`use_ref`), but only
per backend object, which llama.cpp does not expose, and it also turns off unrelated fusions. So the
patch adds one process-wide switch, `ggml_cpu_set_batch_invariant(bool)`, that makes every decode
take the same per-row path whatever its size:

- flash attention: the one-chunk kernel that reduces each query over the cache cells in order
  (not the split-KV path of one-token decodes past 512 cells, nor the tiled path of 64+ queries);
- matrix products: ggml's own per-row dot products (not llamafile's sgemm at 2+ rows, nor the
  tiled K-quant kernels at 8+ rows).

Off by default, so the build behaves exactly as upstream until an engine asks for it
(`decoding/llamacpp_target.py`). Each edit names the exact upstream text it replaces and fails
loudly if that text is missing, so a version bump cannot silently drop one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# (file under vendor/llama.cpp/ggml, upstream text, replacement): each upstream text occurs once.
EDITS: tuple[tuple[str, str, str], ...] = (
    (
        "include/ggml-cpu.h",
        "    GGML_BACKEND_API void ggml_backend_cpu_set_use_ref(ggml_backend_t backend_cpu, bool use_ref);\n",
        "    GGML_BACKEND_API void ggml_backend_cpu_set_use_ref(ggml_backend_t backend_cpu, bool use_ref);\n"
        "\n"
        "    // specgate patch: every decode takes the same per-row kernels, whatever its size (process-wide)\n"
        "    GGML_BACKEND_API void ggml_cpu_set_batch_invariant(bool on);\n"
        "    GGML_BACKEND_API bool ggml_cpu_batch_invariant(void);\n",
    ),
    (
        "src/ggml-cpu/ggml-cpu.c",
        "void ggml_compute_forward_mul_mat(\n",
        "// specgate patch: read once per op by every thread; set between decodes, never during one\n"
        "static volatile bool ggml_cpu_batch_invariant_on = false;\n"
        "\n"
        "void ggml_cpu_set_batch_invariant(bool on) {\n"
        "    ggml_cpu_batch_invariant_on = on;\n"
        "}\n"
        "\n"
        "bool ggml_cpu_batch_invariant(void) {\n"
        "    return ggml_cpu_batch_invariant_on;\n"
        "}\n"
        "\n"
        "void ggml_compute_forward_mul_mat(\n",
    ),
    (
        "src/ggml-cpu/ggml-cpu.c",
        "    if (ggml_compute_forward_mul_mat_tiled(params, dst)) {\n",
        "    if (!ggml_cpu_batch_invariant() && ggml_compute_forward_mul_mat_tiled(params, dst)) {\n",
    ),
    (
        "src/ggml-cpu/ggml-cpu.c",
        "    if (src1_cont) {\n        for (int64_t i13 = 0; i13 < ne13; i13++)\n",
        "    if (src1_cont && !ggml_cpu_batch_invariant()) {\n        for (int64_t i13 = 0; i13 < ne13; i13++)\n",
    ),
    (
        "src/ggml-cpu/ggml-cpu.c",
        "#if GGML_USE_LLAMAFILE\n    if (src1->type != vec_dot_type) {\n",
        "#if GGML_USE_LLAMAFILE\n    if (src1->type != vec_dot_type && !ggml_cpu_batch_invariant()) {\n",
    ),
    (
        "src/ggml-cpu/ops.cpp",
        "    const bool use_ref = params->use_ref;\n",
        "    const bool use_ref = params->use_ref || ggml_cpu_batch_invariant();\n",
    ),
)


def fingerprint() -> str:
    """Changes whenever the patch does: part of the wheel cache key."""
    return hashlib.sha256(repr(EDITS).encode()).hexdigest()[:12]


def apply(llama_cpp_root: Path) -> None:
    """Apply every edit to an unpacked llama.cpp source tree (vendor/llama.cpp of the sdist)."""
    ggml = llama_cpp_root / "ggml"
    for rel, old, new in EDITS:
        path = ggml / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"[setup] error: the batch-invariance patch no longer fits {path} (expected one occurrence of {old.strip()!r})")
        path.write_text(text.replace(old, new))
