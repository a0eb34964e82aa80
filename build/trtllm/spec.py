"""The TensorRT-LLM build spec (one YAML file, validated with pydantic before anything runs).

Every limit checked here is cited from the pinned TensorRT-LLM sources (see build/trtllm/pins.py and
docs/trtllm.md), so an invalid spec fails in a second instead of after an engine build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Method = Literal["eagle", "eagle2", "draft_model", "ngram"]

# examples/eagle/convert_checkpoint.py: `assert args.max_draft_len <= 256`
MAX_DRAFT_LEN = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EagleSpec(_Strict):
    """EAGLE head + tree. Names follow examples/eagle/convert_checkpoint.py and the backend's `eagle_choices`."""

    head_dir: Path | None = Field(
        None, description="the project's EAGLE head (heads/...); the build exports it to the EAGLE-1 layout --eagle_model_dir reads"
    )
    num_eagle_layers: int = Field(4, ge=1, description="--num_eagle_layers: depth of the tree")
    max_non_leaves_per_layer: int = Field(10, ge=1, description="--max_non_leaves_per_layer")
    eagle_choices: list[list[int]] | None = Field(None, description="static tree (EAGLE-1); None = backend default mc_sim_7b_63")
    # EAGLE-2 names as TensorRT-LLM's EagleConfig spells them (executor EagleConfig / run.py
    # --eagle_use_dynamic_tree --eagle_dynamic_tree_max_top_k).
    use_dynamic_tree: bool = False
    dynamic_tree_max_topK: int | None = Field(None, ge=1)


class NgramSpec(_Strict):
    """Lookahead decoding (W, N, G): the n-gram method the tensorrtllm backend runs natively."""

    window_size: int = Field(4, ge=1)
    ngram_size: int = Field(3, ge=1)
    verification_set_size: int = Field(4, ge=0)

    def max_draft_len(self) -> int:
        # examples/lookahead/README.md: the engine's --max_draft_len must equal this for (W, N, G).
        n, w, g = self.ngram_size, self.window_size, self.verification_set_size
        return (0 if n == 1 else n - 2) + (w - 1 + g) * (n - 1)


class SpeculativeSpec(_Strict):
    method: Method
    max_draft_len: int = Field(..., ge=1)
    eagle: EagleSpec | None = None
    draft_hf_dir: Path | None = Field(None, description="draft_model: the draft's HF checkpoint")
    ngram: NgramSpec | None = None


class ParallelSpec(_Strict):
    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)
    gpus: int = Field(1, ge=1, description="GPUs available on the machine")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


class ServingSpec(_Strict):
    """tensorrt_llm model parameters (docs/model_config.md of the backend)."""

    # Two engines share the GPU(s), so each takes a fraction of what is left after weights.
    kv_cache_free_gpu_mem_fraction: float = Field(0.4, gt=0, le=1)
    batch_scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = "guaranteed_no_evict"
    max_queue_delay_microseconds: int = Field(0, ge=0)
    target_gpu_device_ids: str = Field("0", pattern=r"^\d+(,\d+)*$")
    spec_gpu_device_ids: str = Field("0", pattern=r"^\d+(,\d+)*$")


class BuildSpec(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9._-]+$")
    target_hf_dir: Path
    tokenizer_dir: Path | None = Field(None, description="defaults to target_hf_dir")
    dtype: Literal["float16", "bfloat16"] = "bfloat16"
    max_batch_size: int = Field(8, ge=1)
    max_input_len: int = Field(2048, ge=1)
    max_output_len: int = Field(1024, ge=1)
    speculative: SpeculativeSpec
    parallel: ParallelSpec = ParallelSpec()
    serving: ServingSpec = ServingSpec()
    end_id: int = Field(2, ge=0, description="eos id the gate sends as end_id (SmolLM2: <|im_end|> = 2)")

    @property
    def max_seq_len(self) -> int:
        return self.max_input_len + self.max_output_len

    @property
    def tokenizer(self) -> Path:
        return self.tokenizer_dir or self.target_hf_dir

    @model_validator(mode="after")
    def _check(self) -> "BuildSpec":
        problems = _problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _problems(s: BuildSpec) -> list[str]:
    sp, par = s.speculative, s.parallel
    out: list[str] = []
    if sp.max_draft_len > MAX_DRAFT_LEN:
        out.append(f"max_draft_len {sp.max_draft_len} exceeds {MAX_DRAFT_LEN}, the limit in examples/eagle/convert_checkpoint.py")
    if par.world_size > par.gpus:
        out.append(f"tp_size*pp_size = {par.world_size} exceeds the {par.gpus} GPU(s) available")
    elif par.gpus % par.world_size:
        out.append(f"tp_size*pp_size = {par.world_size} does not divide the {par.gpus} GPU(s) available")
    for field in ("target_gpu_device_ids", "spec_gpu_device_ids"):
        ids = [int(i) for i in getattr(s.serving, field).split(",")]
        if len(ids) != par.world_size or max(ids) >= par.gpus:
            out.append(f"serving.{field} must list {par.world_size} GPU id(s) below {par.gpus}, got {getattr(s.serving, field)!r}")
    if sp.method in ("eagle", "eagle2"):
        out += _eagle_problems(sp, par)
    if sp.method == "draft_model" and sp.draft_hf_dir is None:
        out.append("method draft_model needs speculative.draft_hf_dir (the draft model's HF checkpoint)")
    if sp.method == "ngram":
        if sp.ngram is None:
            out.append("method ngram needs speculative.ngram (window_size, ngram_size, verification_set_size)")
        elif sp.ngram.max_draft_len() != sp.max_draft_len:
            out.append(
                f"method ngram: max_draft_len must equal the lookahead formula for (W={sp.ngram.window_size}, "
                f"N={sp.ngram.ngram_size}, G={sp.ngram.verification_set_size}) = {sp.ngram.max_draft_len()}, "
                f"got {sp.max_draft_len} (examples/lookahead/README.md)"
            )
    return out


def _eagle_problems(sp: SpeculativeSpec, par: ParallelSpec) -> list[str]:
    e = sp.eagle
    if e is None or e.head_dir is None:
        return [f"method {sp.method} needs speculative.eagle.head_dir (the project's EAGLE head, e.g. heads/smollm2-135m-eagle)"]
    out = []
    if par.pp_size > 1:
        out.append("EAGLE does not support pipeline parallelism (examples/eagle/README.md, Limitations): use pp_size 1")
    if sp.method == "eagle2":
        # The pinned backend builds EagleConfig(eagle_choices) only (model_instance_state.cc); it has no
        # parameter for use_dynamic_tree / dynamic_tree_max_topK, so EAGLE-2 cannot be served from Triton.
        out.append(
            "method eagle2 (dynamic tree) cannot be served by the pinned tensorrtllm backend: its tensorrt_llm model "
            "reads only `eagle_choices` (model_instance_state.cc) and has no use_dynamic_tree/dynamic_tree_max_topK "
            "parameter; use method eagle with a static eagle_choices tree"
        )
    if e.use_dynamic_tree != (sp.method == "eagle2"):
        out.append("speculative.eagle.use_dynamic_tree is true exactly for method eagle2")
    if e.eagle_choices is not None:
        if sp.method == "eagle2":
            out.append("EAGLE-2 builds its tree at run time: eagle_choices must not be set (examples/eagle/README.md)")
        depth = max((len(c) for c in e.eagle_choices), default=0)
        if depth != e.num_eagle_layers:
            out.append(f"eagle_choices depth {depth} must equal num_eagle_layers {e.num_eagle_layers} (examples/eagle/README.md)")
        if len(e.eagle_choices) > sp.max_draft_len:
            out.append(f"eagle_choices has {len(e.eagle_choices)} nodes, more than max_draft_len {sp.max_draft_len}")
        widest = max(_non_leaves_per_layer(e.eagle_choices).values(), default=0)
        if widest > e.max_non_leaves_per_layer:
            out.append(f"eagle_choices has {widest} non-leaf nodes in one layer, "
                       f"more than max_non_leaves_per_layer {e.max_non_leaves_per_layer}")
    return out


def _non_leaves_per_layer(choices: list[list[int]]) -> dict[int, int]:
    """Non-leaf nodes per depth: a path is a non-leaf when another path extends it by one step."""
    paths = {tuple(c) for c in choices}
    parents = {p[:-1] for p in paths if len(p) > 1}
    counts: dict[int, int] = {}
    for p in parents:
        counts[len(p)] = counts.get(len(p), 0) + 1
    return counts


class SpecError(SystemExit):
    """A spec that cannot be built: the message says what to change."""


def _resolve(spec: BuildSpec, base: Path) -> BuildSpec:
    """Relative paths in a spec are relative to the repository root, so commands work from any cwd."""

    def r(p: Path | None) -> Path | None:
        return None if p is None else (p if p.is_absolute() else base / p)

    sp = spec.speculative
    eagle = sp.eagle.model_copy(update={"head_dir": r(sp.eagle.head_dir)}) if sp.eagle else None
    sp = sp.model_copy(update={"draft_hf_dir": r(sp.draft_hf_dir), "eagle": eagle})
    return spec.model_copy(update={"target_hf_dir": r(spec.target_hf_dir), "tokenizer_dir": r(spec.tokenizer_dir), "speculative": sp})


def load_spec(path: Path, base: Path) -> BuildSpec:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"[trtllm] cannot read build spec {path}: {exc}") from None
    try:
        return _resolve(BuildSpec.model_validate(raw), base)
    except ValidationError as exc:
        msgs = "\n".join(f"  - {'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors())
        raise SpecError(f"[trtllm] invalid build spec {path}:\n{msgs}") from None
