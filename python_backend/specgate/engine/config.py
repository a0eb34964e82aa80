"""Engine configuration: written by `make build-engines`, read by both engine models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, Field

DType = Literal["bfloat16", "float32"]


class EngineConfig(BaseModel):
    checkpoint_dir: Path
    dtype: DType = "bfloat16"
    max_context: int = Field(2048, ge=16, description="prompt + generated tokens per sequence")
    max_output_len: int = Field(1024, ge=1, description="upper bound for max_tokens")
    max_batch_size: int = Field(8, ge=1, description="sequences decoded together (in-flight batching)")
    max_queue_size: int = Field(64, ge=1, description="waiting requests beyond the batch")
    queue_timeout_s: float = Field(60.0, gt=0, description="how long a request may wait for a slot")
    num_threads: int = Field(0, ge=0, description="torch intra-op threads; 0 = torch default")
    # spec_engine only: which drafters to load (n-gram needs no weights) and the default one
    draft_model_dir: Path | None = None
    eagle_head_dir: Path | None = None
    default_algorithm: str = "ngram"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @classmethod
    def load(cls, path: str | Path) -> "EngineConfig":
        return cls.model_validate(json.loads(Path(path).read_text()))
