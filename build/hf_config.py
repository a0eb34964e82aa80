"""`config.json` of the project's Llama checkpoints, in the classic (transformers 4.x) layout.

transformers 5.x writes `"architectures": null` and moves `rope_theta` into `rope_parameters`. TensorRT-LLM
pins transformers 4.x and reads the classic keys: `LLaMAConfig.from_hugging_face` takes
`hf_config.architectures[0]` and `getattr(hf_config, "rope_theta", 10000.0)`
(tensorrt_llm/models/llama/config.py), and examples/eagle/convert_checkpoint.py takes
`LlamaConfig.from_pretrained(...).rope_theta`. A 5.x config would fail the first and silently get the wrong
RoPE base from the others. transformers 5.x still reads the classic layout (it moves `rope_theta` into
`rope_parameters` itself), and so does `specgate.decoding.model.LlamaConfig.from_hf`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

CONFIG = "config.json"


class HFLlamaConfig(BaseModel):
    """The keys of transformers 4.x's LlamaConfig, plus `architectures` / `model_type` / `torch_dtype`."""

    model_config = ConfigDict(extra="forbid")

    architectures: list[str] = ["LlamaForCausalLM"]
    model_type: Literal["llama"] = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str = "silu"
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    initializer_range: float = 0.02
    pretraining_tp: int = 1
    use_cache: bool = True
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> "HFLlamaConfig":
        """From a config dict in either layout (transformers 5.x `to_dict()` or classic)."""
        if raw.get("model_type", "llama") != "llama":
            raise ValueError(f"not a Llama config: model_type {raw['model_type']!r}")
        rope = dict(raw.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", raw.get("rope_theta"))
        if theta is None:
            raise ValueError("config has neither rope_parameters.rope_theta nor rope_theta")
        # 4.x spells a non-default RoPE as rope_scaling {"rope_type": ..., factor, ...}; default RoPE is null
        scaling = rope if rope.get("rope_type", "default") != "default" else raw.get("rope_scaling")
        keep = {k: raw[k] for k in cls.model_fields if raw.get(k) is not None}
        return cls.model_validate(
            {
                **keep,
                "architectures": raw.get("architectures") or ["LlamaForCausalLM"],
                "head_dim": raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
                "rope_theta": theta,
                "rope_scaling": scaling,
                "torch_dtype": str(raw.get("torch_dtype") or raw.get("dtype") or "float32").removeprefix("torch."),
            }
        )

    def write(self, checkpoint_dir: Path) -> None:
        (checkpoint_dir / CONFIG).write_text(self.model_dump_json(indent=2) + "\n")


def read(checkpoint_dir: Path) -> HFLlamaConfig:
    return HFLlamaConfig.from_raw(json.loads((checkpoint_dir / CONFIG).read_text()))


def ensure_classic(checkpoint_dir: Path) -> bool:
    """Rewrite a checkpoint's config.json in the classic layout if it is not already; True when rewritten."""
    path = checkpoint_dir / CONFIG
    raw = json.loads(path.read_text())
    classic = HFLlamaConfig.from_raw(raw)
    if raw == classic.model_dump(mode="json"):
        return False
    classic.write(checkpoint_dir)
    return True
