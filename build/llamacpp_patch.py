"""The patch `make setup` applies to the llama.cpp it builds: batch-invariant kernels that stay fast.

Why a patch: llama.cpp's CPU backend picks kernels by the shape of a decode, and the kernels sum in
different orders, so a token's logits depend on what else the decode holds (docs/engines.md,
"Exact greedy"). At temperature 0 that makes the speculative route and a batched baseline disagree
with a one-token step at near-ties. The patch adds a process-wide switch,
`ggml_cpu_set_batch_invariant(bool)`, under which every decode reduces each token the same way
whatever its size, and kernels that make that cheap:

- matrix products of Q4_0, Q4_1 and Q8_0 weights (x86 with AVX2): a tile kernel of weight rows
  against up to 16 token columns (llamacpp_kernels/matmul_tiles.c). Each weight block is unpacked
  once for all the columns, and each output is summed in one order for every column count, one
  included, so it serves every decode in both modes. Other formats take ggml's per-row dot products
  in batch-invariant mode (not llamafile's sgemm at 2+ rows, nor the tiled K-quant kernels);
- flash attention in batch-invariant mode: each query reduced over the cache in two passes (scores
  and their maximum, then weights and values, each summed in cell order), 16-lane FMAs with no call
  per cell, a block's keys and values converted to F32 once for the rows that share a K/V head
  (llamacpp_kernels/flash_attn_blocked.cpp); a row's result depends only on the cells it sees, in
  order, not on their positions. Never the split-KV path of one-token decodes past 512 cells, nor
  the tiled path of 64+ queries;
- AMX (ggml's own kernels for repacked Q4_0/Q4_1/Q8_0/K-quant weights, where the CPU has it): a
  one-line fix for GCC 12, whose `_tile_loadconfig` declares an 8-byte read of the 64-byte tile
  configuration, so the stores of its rows and columns were dropped as dead and the first tile load
  raised SIGILL (the crash behind llama.cpp #20824 on this compiler); and the configuration is loaded
  at every call, since another AMX user on the thread (PyTorch's oneDNN, the EAGLE head in bf16)
  changes it between decodes (SIGILL again, seen here). Its one-row (VNNI) and
  many-row (AMX tile) kernels both reduce each block to an exact int32 sum and accumulate
  fma(sum, d_w * d_a, acc) in block order, so they agree bit for bit; the engines check that on
  their own model at load (decoding/llamacpp_target.py) before they keep repacked weights. Up to 8
  token rows take the one-row kernel's arithmetic, which was faster there than the tiles: 2-8 rows
  through llamacpp_kernels/amx_vnni_rows.cpp, which loads and unpacks each weight tile once for all
  of them (ggml's VNNI kernels read one row).

Beside the decode's kernels, one for the EAGLE head (llamacpp_kernels/eagle_layer.c): its layer and
draft logits for a few new pairs in one call, int8 products read once each and split with one helper
thread, where PyTorch ran about 60 operators a drafted node (specgate.speculative.eagle_kernel). It sits in the CPU backend so that
each of a portable build's variants compiles it for its own instruction sets.

Beside the kernels, one edit to llama.cpp itself: a context keeps the graph of each recent decode
shape with the scheduler that allocated it, where upstream keeps only the last one
(llamacpp_kernels/kept_graphs.cpp). Speculative decoding alternates shapes, and every change built
and allocated a graph again, about 0.4 ms of a 2.5-3 ms decode. The same graph runs the same
kernels, so this changes no result.

`ggml_cpu_set_tile_kernels(false)` turns the tile kernels and the blocked attention off again (the
per-row kernels of the earlier exact mode), so a benchmark can measure one against the other in
one process. Off by default: batch invariance; on by default: the tile kernels.

Each edit names the exact upstream text it replaces and fails loudly if that text is missing, so a
version bump cannot silently drop one. Whole new kernels (and kept_graphs.cpp) live in
llamacpp_kernels/ and are inserted before a named upstream line.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

KERNELS = Path(__file__).resolve().parent / "llamacpp_kernels"


def _insert_before(anchor: str, kernel_file: str) -> tuple[str, str]:
    """(upstream text, replacement): the kernel file's source, then the anchor itself."""
    return anchor, (KERNELS / kernel_file).read_text() + anchor


_TILE_HOOK = """#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    // specgate patch: where a tile kernel exists (quants.h), every column count takes it, one included,
    // so a token's result is the same whatever else its decode holds
    void (*const vec_dot_tile)(int, int, int, float *, size_t, const void *, size_t, const void *, size_t) =
        num_rows_per_vec_dot != 1 || ne02 != 1 || ne03 != 1 || ne12 != 1 || ne13 != 1 ? NULL :
        type == GGML_TYPE_Q4_0 ? ggml_vec_dot_tile_q4_0_q8_0 :
        type == GGML_TYPE_Q4_1 ? ggml_vec_dot_tile_q4_1_q8_1 :
        type == GGML_TYPE_Q8_0 ? ggml_vec_dot_tile_q8_0_q8_0 : NULL;
    if (vec_dot_tile != NULL && ggml_cpu_tile_kernels()) {
        const size_t col_stride = src1_cont || src1->type != vec_dot_type ? row_size : nb11;
        for (int64_t iir1 = ir1_start; iir1 < ir1_end; iir1 += 16) {
            vec_dot_tile(ne00, (int) (ir0_end - ir0_start), (int) (MIN(iir1 + 16, ir1_end) - iir1),
                         (float *) ((char *) dst->data + iir1*nb1) + ir0_start, nb1/sizeof(float),
                         (const char *) src0->data + ir0_start*nb01, nb01, (const char *) wdata + iir1*col_stride, col_stride);
        }
        return;
    }
#endif

"""

_SWITCHES = """// specgate patch: read once per op by every thread; set between decodes, never during one
static volatile bool ggml_cpu_batch_invariant_on = false;
static volatile bool ggml_cpu_tile_kernels_on = true;

void ggml_cpu_set_batch_invariant(bool on) {
    ggml_cpu_batch_invariant_on = on;
}

bool ggml_cpu_batch_invariant(void) {
    return ggml_cpu_batch_invariant_on;
}

void ggml_cpu_set_tile_kernels(bool on) {
    ggml_cpu_tile_kernels_on = on;
}

bool ggml_cpu_tile_kernels(void) {
    return ggml_cpu_tile_kernels_on;
}

"""

# (file under vendor/llama.cpp, upstream text, replacement): each upstream text occurs once.
EDITS: tuple[tuple[str, str, str], ...] = (
    (
        "ggml/include/ggml-cpu.h",
        "    GGML_BACKEND_API void ggml_backend_cpu_set_use_ref(ggml_backend_t backend_cpu, bool use_ref);\n",
        "    GGML_BACKEND_API void ggml_backend_cpu_set_use_ref(ggml_backend_t backend_cpu, bool use_ref);\n"
        "\n"
        "    // specgate patch: every decode reduces each token the same way, whatever its size (process-wide)\n"
        "    GGML_BACKEND_API void ggml_cpu_set_batch_invariant(bool on);\n"
        "    GGML_BACKEND_API bool ggml_cpu_batch_invariant(void);\n"
        "    // specgate patch: the tile matmul kernels and the blocked attention (on by default); off: per-row kernels\n"
        "    GGML_BACKEND_API void ggml_cpu_set_tile_kernels(bool on);\n"
        "    GGML_BACKEND_API bool ggml_cpu_tile_kernels(void);\n"
        "    // specgate patch: the EAGLE head's layer and draft logits, fused (llamacpp_kernels/eagle_layer.c)\n"
        "    struct specgate_eagle_weights;\n"
        "    GGML_BACKEND_API int ggml_cpu_specgate_eagle_layer(const struct specgate_eagle_weights * w, int rows,\n"
        "        const int32_t * tokens, const float * features, const int32_t * positions, const uint8_t * visible,\n"
        "        float * cache_k, float * cache_v, int cache_len, float * out);\n"
        "    GGML_BACKEND_API void ggml_cpu_specgate_eagle_logits(const struct specgate_eagle_weights * w, int rows,\n"
        "        const float * hidden, float * logits);\n",
    ),
    ("ggml/src/ggml-cpu/ggml-cpu.c", *_insert_before("void ggml_cpu_init(void) {\n", "eagle_layer.c")),
    ("ggml/src/ggml-cpu/ggml-cpu.c", "void ggml_compute_forward_mul_mat(\n", _SWITCHES + "void ggml_compute_forward_mul_mat(\n"),
    (
        "ggml/src/ggml-cpu/ggml-cpu.c",
        "    // block-tiling attempt\n    const int64_t blck_0 = 16;\n    const int64_t blck_1 = 16;\n",
        _TILE_HOOK + "    // block-tiling attempt\n    const int64_t blck_0 = 16;\n    const int64_t blck_1 = 16;\n",
    ),
    (
        "ggml/src/ggml-cpu/ggml-cpu.c",
        "    if (ggml_compute_forward_mul_mat_tiled(params, dst)) {\n",
        "    if (!ggml_cpu_batch_invariant() && ggml_compute_forward_mul_mat_tiled(params, dst)) {\n",
    ),
    (
        "ggml/src/ggml-cpu/ggml-cpu.c",
        "    if (src1_cont) {\n        for (int64_t i13 = 0; i13 < ne13; i13++)\n",
        "    if (src1_cont && !ggml_cpu_batch_invariant()) {\n        for (int64_t i13 = 0; i13 < ne13; i13++)\n",
    ),
    (
        "ggml/src/ggml-cpu/ggml-cpu.c",
        "#if GGML_USE_LLAMAFILE\n    if (src1->type != vec_dot_type) {\n",
        "#if GGML_USE_LLAMAFILE\n    if (src1->type != vec_dot_type && !ggml_cpu_batch_invariant()) {\n",
    ),
    ("ggml/src/ggml-cpu/quants.h", *_insert_before("void ggml_vec_dot_mxfp4_q8_0(", "matmul_tiles.h")),
    ("ggml/src/ggml-cpu/arch/x86/quants.c", *_insert_before("void ggml_vec_dot_mxfp4_q8_0(", "matmul_tiles.c")),
    (
        "ggml/src/ggml-cpu/ops.cpp",
        "    const bool use_ref = params->use_ref;\n",
        "    const bool use_ref = params->use_ref || ggml_cpu_batch_invariant();\n",
    ),
    ("ggml/src/ggml-cpu/ops.cpp", *_insert_before("static void ggml_compute_forward_flash_attn_ext_f16(\n", "flash_attn_blocked.cpp")),
    (
        "ggml/src/ggml-cpu/ops.cpp",
        "            if (use_tiled) {\n"
        "                ggml_compute_forward_flash_attn_ext_tiled(params, dst, ir0, ir1);\n"
        "            } else {",
        "            if (use_tiled) {\n"
        "                ggml_compute_forward_flash_attn_ext_tiled(params, dst, ir0, ir1);\n"
        "            } else if (ggml_cpu_batch_invariant() && ggml_cpu_tile_kernels() && specgate_fa_blocked_supported(dst)) {\n"
        "                specgate_fa_blocked(params, dst, ir0, ir1);\n"
        "            } else {",
    ),
    ("ggml/src/ggml-cpu/amx/mmq.cpp", *_insert_before("#define LAUNCH_TINYGEMM_KERNEL_VNNI(NB_SIZE)", "amx_vnni_rows.cpp")),
    (
        "ggml/src/ggml-cpu/amx/mmq.cpp",
        "    if (M == 1) {\n        // MB = 1 and handle 8 tiles in each block\n",
        "    // specgate patch: up to 8 token rows take the one-row (VNNI) kernel's arithmetic; it reduces\n"
        "    // each block as the AMX tiles do (the same bits), and at 2-8 rows it was as fast or faster than\n"
        "    // the tiles, which unpack a whole 32-row block for them (2-core Xeon with AMX, family 6 model 207,\n"
        "    // quiet runs one after the other: 2 rows 4.5 ms against 7.1, 4 rows 7.7 against 9.0, 8 rows 14.1 against 14.4)\n"
        "    if (M <= 8) {\n        // MB = 1 and handle 8 tiles in each block\n",
    ),
    (
        "ggml/src/ggml-cpu/amx/mmq.cpp",
        "                    int64_t dst_offset  = ggml_batch_offset(dst,  batch_idx, ne2);\n"
        "                    const char * wdata_batch = (const char *)wdata + batch_idx * row_size_A;\n"
        "\n"
        "                    int nb_start = nb * BLOCK_N;\n"
        "                    int nb_size = std::min(BLOCK_N, N - nb_start); // 32, 64, 96\n"
        "\n"
        "                    switch (nb_size) {\n"
        "                        //case 160: LAUNCH_TINYGEMM_KERNEL_VNNI(160); break;\n"
        "                        case 128: LAUNCH_TINYGEMM_KERNEL_VNNI(128); break;\n"
        "                        case 96: LAUNCH_TINYGEMM_KERNEL_VNNI(96); break;\n"
        "                        case 64: LAUNCH_TINYGEMM_KERNEL_VNNI(64); break;\n"
        "                        case 32: LAUNCH_TINYGEMM_KERNEL_VNNI(32); break;\n"
        "                        default: fprintf(stderr, \"Unexpected n block size!\\n\");\n"
        "                    }\n",
        "                    int nb_start = nb * BLOCK_N;\n"
        "                    int nb_size = std::min(BLOCK_N, N - nb_start); // 32, 64, 96\n"
        "\n"
        "                    // specgate patch: 2-8 rows share each weight tile (amx_vnni_rows.cpp), the others\n"
        "                    // take the one-row kernel once per row\n"
        "                    if (M > 1 && specgate_vnni_rows_any<type>(M, KB, (const char *)wdata + batch_idx * M * row_size_A, "
        "row_size_A,\n"
        "                            (const char *)src0->data + src0_offset + PACKED_INDEX(nb * kTilesN, 0, KB, TILE_SIZE), TILE_SIZE,\n"
        "                            nb_size / TILE_N, (float *) dst->data + ggml_batch_offset(dst, batch_idx, ne2) + nb_start, ldc)) {\n"
        "                        continue;\n"
        "                    }\n"
        "                    for (int m = 0; m < M; ++m) {\n"
        "                    const int64_t dst_offset = ggml_batch_offset(dst, batch_idx, ne2) + m * ldc;\n"
        "                    const char * wdata_batch = (const char *)wdata + (batch_idx * M + m) * row_size_A;\n"
        "                    switch (nb_size) {\n"
        "                        //case 160: LAUNCH_TINYGEMM_KERNEL_VNNI(160); break;\n"
        "                        case 128: LAUNCH_TINYGEMM_KERNEL_VNNI(128); break;\n"
        "                        case 96: LAUNCH_TINYGEMM_KERNEL_VNNI(96); break;\n"
        "                        case 64: LAUNCH_TINYGEMM_KERNEL_VNNI(64); break;\n"
        "                        case 32: LAUNCH_TINYGEMM_KERNEL_VNNI(32); break;\n"
        "                        default: fprintf(stderr, \"Unexpected n block size!\\n\");\n"
        "                    }\n"
        "                    }\n",
    ),
    (
        "ggml/src/ggml-cpu/amx/mmq.cpp",
        "    _tile_loadconfig(&tc);\n    done = true;\n}\n",
        "    // specgate patch: GCC 12's _tile_loadconfig declares an 8-byte read of the config, so the stores of\n"
        "    // rows and colsb were dropped and the first tile load raised SIGILL; this asm reads all 64 bytes\n"
        '    __asm__ volatile("ldtilecfg %0" : : "m"(tc));\n}\n',
    ),
    (
        "ggml/src/ggml-cpu/amx/mmq.cpp",
        "inline void ggml_tile_config_init(void) {\n"
        "    static thread_local bool done = false;\n\n"
        "    if (done) {\n"
        "        return;\n"
        "    }\n",
        "inline void ggml_tile_config_init(void) {\n"
        "    // specgate patch: configured at every call, not once per thread: another AMX user on the same\n"
        "    // thread (PyTorch's oneDNN running the EAGLE head in bf16 between decodes) reconfigures the\n"
        "    // tiles, and the next tile load under its configuration raised SIGILL\n",
    ),
    (
        "src/llama-context.h",
        "    llm_graph_result * gf_res_prev_active = nullptr;\n",
        "    llm_graph_result * gf_res_prev_active = nullptr;\n"
        "\n"
        "    // specgate patch: the graphs of recent decode shapes, each with its scheduler (kept_graphs.cpp)\n"
        "    struct specgate_kept_graph {\n"
        "        llm_graph_result_ptr   res;\n"
        "        ggml_backend_sched_ptr sched;\n"
        "    };\n"
        "    std::vector<specgate_kept_graph> specgate_graphs;\n"
        "    specgate_kept_graph specgate_home; // the context's own, while a kept one is in use\n"
        "    bool specgate_switch_graph(const llm_graph_params & gparams);\n",
    ),
    ("src/llama-context.cpp", *_insert_before("llm_graph_result * llama_context::process_ubatch(", "kept_graphs.cpp")),
    (
        "src/llama-context.cpp",
        "    auto * res = get_gf_res_prev();\n"
        "    auto * gf  = res->get_gf();\n"
        "\n"
        "    // the new graph parameters\n",
        "    auto * res = get_gf_res_prev();\n"
        "    // specgate patch: another shape than the last decode's takes the graph kept for it, or a graph of\n"
        "    // its own while the last one is kept (kept_graphs.cpp)\n"
        "    if (!graph_reuse_disable && specgate_switch_graph(graph_params(res, ubatch, mctx, gtype))) {\n"
        "        res = get_gf_res_prev();\n"
        "    }\n"
        "    auto * gf  = res->get_gf();\n"
        "\n"
        "    // the new graph parameters\n",
    ),
    (
        "src/llama-context.cpp",
        "    // wait for any pending asynchronous copies into the output buffers before they are freed\n    synchronize();\n",
        "    // wait for any pending asynchronous copies into the output buffers before they are freed\n    synchronize();\n"
        "    if (specgate_home.sched) { // specgate patch: the context's own scheduler, whose size is checked below\n"
        "        sched = std::move(specgate_home.sched);\n"
        "    }\n",
    ),
    # wherever upstream stops reusing graphs, the kept ones go too
    (
        "src/llama-context.cpp",
        "    for (auto & res : gf_res_prev) {\n        res.reset();\n    }\n",
        "    for (auto & res : gf_res_prev) {\n        res.reset();\n    }\n"
        "    specgate_graphs.clear(); specgate_home = {}; // specgate patch\n",
    ),
    (
        "src/llama-context.cpp",
        "        // reset the previous graph results to make sure that they won't be reused\n",
        "        // reset the previous graph results to make sure that they won't be reused\n"
        "        specgate_graphs.clear(); specgate_home = {}; // specgate patch\n",
    ),
    (
        "src/llama-context.cpp",
        "    // when the scheduler is reset, we cannot reuse old graphs, so we reset the previous graph results\n",
        "    // when the scheduler is reset, we cannot reuse old graphs, so we reset the previous graph results\n"
        "    specgate_graphs.clear(); specgate_home = {}; // specgate patch\n",
    ),
    (
        "src/llama-context.cpp",
        "            // the optimizer graph is allocated outside sched, so the next decode must rebuild\n",
        "            // the optimizer graph is allocated outside sched, so the next decode must rebuild\n"
        "            specgate_graphs.clear(); specgate_home = {}; // specgate patch\n",
    ),
)


def fingerprint() -> str:
    """Changes whenever the patch does (the kernel files included): part of the wheel cache key."""
    return hashlib.sha256(repr(EDITS).encode()).hexdigest()[:12]


def apply(llama_cpp_root: Path) -> None:
    """Apply every edit to an unpacked llama.cpp source tree (vendor/llama.cpp of the sdist)."""
    for rel, old, new in EDITS:
        path = llama_cpp_root / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"[setup] error: the batch-invariance patch no longer fits {path} "
                             f"(expected one occurrence of {old.strip()!r})")
        path.write_text(text.replace(old, new))
