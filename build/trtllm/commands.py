"""Build commands for a BuildSpec, as pure argv lists (printed by --dry-run, run by build.py).

Flags are the pinned TensorRT-LLM 1.0.0 ones; build/trtllm/pins.py names the source file of each.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from build.trtllm.pins import EAGLE_CONVERT, LLAMA_CONVERT
from build.trtllm.spec import BuildSpec


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    output: Path  # the directory the step creates; a step whose output exists is skipped


@dataclass(frozen=True)
class Layout:
    """Where one spec's checkpoints and engines live (under artifacts/trtllm/<spec name>)."""

    root: Path

    def ckpt(self, which: str) -> Path:
        return self.root / "checkpoints" / which

    def engine(self, which: str) -> Path:
        return self.root / "engines" / which


def convert_llama(spec: BuildSpec, hf_dir: Path, out: Path, examples: Path, python: str) -> list[str]:
    """examples/models/core/llama/convert_checkpoint.py: HF -> TensorRT-LLM checkpoint, sharded tp x pp."""
    return [
        python, str(examples / LLAMA_CONVERT),
        "--model_dir", str(hf_dir),
        "--output_dir", str(out),
        "--dtype", spec.dtype,
        "--tp_size", str(spec.parallel.tp_size),
        "--pp_size", str(spec.parallel.pp_size),
    ]  # fmt: skip


def export_eagle_head(spec: BuildSpec, out: Path) -> list[str]:
    """build/trtllm/eagle_export.py, in the project's interpreter: our head -> the EAGLE-1 layout the conversion reads."""
    e = spec.speculative.eagle
    assert e is not None and e.head_dir is not None  # guaranteed by BuildSpec validation
    return [
        sys.executable, "-m", "build.trtllm.eagle_export",
        "--head", str(e.head_dir),
        "--target", str(spec.target_hf_dir),
        "--out", str(out),
    ]  # fmt: skip


def convert_eagle(spec: BuildSpec, head: Path, out: Path, examples: Path, python: str) -> list[str]:
    """examples/eagle/convert_checkpoint.py: target + exported EAGLE head -> one EagleForCausalLM checkpoint."""
    e = spec.speculative.eagle
    assert e is not None  # guaranteed by BuildSpec validation
    return [
        python, str(examples / EAGLE_CONVERT),
        "--model_dir", str(spec.target_hf_dir),
        "--eagle_model_dir", str(head),
        "--output_dir", str(out),
        "--dtype", spec.dtype,
        "--max_draft_len", str(spec.speculative.max_draft_len),
        "--num_eagle_layers", str(e.num_eagle_layers),
        "--max_non_leaves_per_layer", str(e.max_non_leaves_per_layer),
        "--tp_size", str(spec.parallel.tp_size),
        "--pp_size", str(spec.parallel.pp_size),
    ]  # fmt: skip


def trtllm_build(spec: BuildSpec, ckpt: Path, out: Path, speculative: list[str] | None = None) -> list[str]:
    """`trtllm-build` (tensorrt_llm/commands/build.py); the tp/pp mapping comes from the checkpoint."""
    return [
        "trtllm-build",
        "--checkpoint_dir", str(ckpt),
        "--output_dir", str(out),
        "--gemm_plugin", spec.dtype,
        "--max_batch_size", str(spec.max_batch_size),
        "--max_input_len", str(spec.max_input_len),
        "--max_seq_len", str(spec.max_seq_len),
        # paged context FMHA: used by every speculative example and needed for KV-cache reuse/chunking
        "--use_paged_context_fmha", "enable",
        *(speculative or []),
    ]  # fmt: skip


def plan(spec: BuildSpec, layout: Layout, examples: Path, python: str = "python3") -> list[Step]:
    """Every command, in order: the baseline engine (target_engine), then the speculative engine(s)."""
    sp = spec.speculative
    target_ckpt = layout.ckpt("target")
    steps = [
        Step("convert target", convert_llama(spec, spec.target_hf_dir, target_ckpt, examples, python), target_ckpt),
        Step("build target_engine", trtllm_build(spec, target_ckpt, layout.engine("target")), layout.engine("target")),
    ]
    spec_out = layout.engine("spec")
    if sp.method in ("eagle", "eagle2"):
        head, ckpt = layout.ckpt("eagle-head"), layout.ckpt("eagle")
        steps += [
            Step("export EAGLE head", export_eagle_head(spec, head), head),
            Step("convert target + EAGLE head", convert_eagle(spec, head, ckpt, examples, python), ckpt),
            Step("build spec_engine (EAGLE)", trtllm_build(spec, ckpt, spec_out, ["--speculative_decoding_mode", "eagle"]), spec_out),
        ]
    elif sp.method == "draft_model":
        assert sp.draft_hf_dir is not None
        ckpt, draft_out = layout.ckpt("draft"), layout.engine("draft")
        flags = ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(sp.max_draft_len)]
        steps += [
            Step("convert draft model", convert_llama(spec, sp.draft_hf_dir, ckpt, examples, python), ckpt),
            Step("build draft engine", trtllm_build(spec, ckpt, draft_out), draft_out),
            Step("build spec_engine (target, draft tokens external)", trtllm_build(spec, target_ckpt, spec_out, flags), spec_out),
        ]
    else:  # ngram: lookahead decoding on the target checkpoint
        flags = ["--speculative_decoding_mode", "lookahead_decoding", "--max_draft_len", str(sp.max_draft_len)]
        steps.append(Step("build spec_engine (lookahead)", trtllm_build(spec, target_ckpt, spec_out, flags), spec_out))
    return steps
