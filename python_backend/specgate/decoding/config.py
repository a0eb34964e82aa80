"""Engine configuration: written by `make build-engines`, read by both engine models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specgate.machine import machine

if TYPE_CHECKING:  # torch is imported where a dtype is resolved: rendering a repository needs none of it
    import torch

Backend = Literal["llamacpp", "torch"]
DType = Literal["auto", "bfloat16", "float32"]
HeadDType = Literal["auto", "kernel", "int8", "bfloat16", "float32"]


class CalibrationOverride(BaseModel):
    """Pinned measurements, for tests or an operator who distrusts a measurement: the curve's shape
    as cost ratios {tokens: cost(T)/cost(1)}, its scale `base_ms` (the one-token time; measured unless
    pinned, since drafting times are real milliseconds), and drafting times by algorithm. With all
    three pinned nothing is measured, so the engine does not wait for a quiet machine either."""

    model_config = ConfigDict(extra="forbid")

    cost_ratios: dict[int, float] | None = None
    base_ms: float | None = Field(None, gt=0)
    draft_ms: dict[str, float] = {}

    @model_validator(mode="after")
    def _scale_of_a_shape(self) -> "CalibrationOverride":
        if self.base_ms is not None and not self.cost_ratios:
            raise ValueError("base_ms scales the pinned cost_ratios: pin cost_ratios too")
        return self


class EngineConfig(BaseModel):
    backend: Backend = "llamacpp"
    model: Path = Field(description="llamacpp: the GGUF file; torch: an HF-style checkpoint directory")
    dtype: DType = Field("auto", description="torch weights and the EAGLE head; auto = bf16 only where the CPU has native bf16")
    max_context: int = Field(2048, ge=16, description="prompt + generated tokens per sequence")
    max_output_len: int = Field(1024, ge=1, description="upper bound for max_tokens")
    max_batch_size: int = Field(8, ge=1, description="sequences decoded together (in-flight batching)")
    max_queue_size: int = Field(64, ge=1, description="waiting requests beyond the batch")
    queue_timeout_s: float = Field(60.0, gt=0, description="how long a request may wait for a slot")
    num_threads: int = Field(0, ge=0, description="compute threads; 0 = one per core (llamacpp) / torch's setting (torch)")
    # llama.cpp only (the fp32 PyTorch engine is exact as it is): a token's logits do not depend on
    # what else its decode holds, so greedy output is one answer whatever the route, the draft
    # budget or the batch (docs/engines.md, "Exact greedy", with what it costs)
    exact: bool = Field(True, description="llamacpp: batch-invariant kernels (greedy output identical across routes, budgets and batches)")
    # each streamed response costs work in the gate and Triton on the cores llama.cpp
    # may decode on; what that costs depends on the machine, so by default the engine measures it and
    # streams as finely as the budget allows (cost_model/stream_pacer.py, docs/engines.md, "Streaming")
    stream_interval_ms: float | None = Field(
        None, ge=0, description="a fixed interval: streamed responses at most this often (0 = one per step); unset = measured, "
                                "within stream_cost_budget"
    )
    stream_cost_budget: float = Field(
        0.05, gt=0, lt=1, description="the share of decode time streamed responses may cost (a measured interval)"
    )
    # spec_engine only: which drafters to load (n-gram needs no weights). The default algorithm lives
    # in the gate's policy only; a direct engine call names its algorithm.
    draft_model: Path | None = Field(None, description="draft GGUF (llamacpp) or checkpoint (torch) sharing the vocabulary")
    eagle_head_dir: Path | None = None
    # A drafted node is one row through the head's products; in PyTorch its ~60 operators cost a fifth
    # to a third of a decode, the fused kernel a few percent (docs/speculative.md, "The EAGLE head's
    # weights"). Drafts are proposals: output is unchanged.
    eagle_head_dtype: HeadDType = Field(
        "auto", description="how the EAGLE head runs: kernel = llama.cpp's fused int8 layer (the patched build, "
                            "backend llamacpp); int8 = PyTorch's int8 products; bfloat16 / float32 = PyTorch in that dtype; "
                            "auto = kernel where the build has it, else int8 where torch has x86's int8 kernels, else `dtype`"
    )
    # Measurements spec_engine pins instead of taking (tests, or an operator): specgate.cost_model.calibration.
    calibration_override: CalibrationOverride | None = None
    # Where spec_engine writes its calibration (cost curve, break-even rates) for the gate to read.
    calibration_path: Path | None = None

    @model_validator(mode="after")
    def _model_kind(self) -> "EngineConfig":
        if self.backend == "llamacpp" and self.model.suffix != ".gguf":
            raise ValueError(f"the llamacpp backend serves a .gguf file, got {self.model}")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        """The resolved dtype: bf16 is emulated (and slower than fp32) on CPUs without native bf16."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if machine().native_bf16 else torch.float32
        return getattr(torch, self.dtype)

    @property
    def threads(self) -> int:
        return self.num_threads or machine().cores

    @classmethod
    def load(cls, path: str | Path) -> "EngineConfig":
        return cls.model_validate(json.loads(Path(path).read_text()))
