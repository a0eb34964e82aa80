"""The checkpoints' config.json is the classic Llama layout TensorRT-LLM reads, and the CPU path and
transformers 5.x still read it to the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from build import hf_config
from build.make_draft_model import make_draft
from specgate.decoding.model import LlamaConfig as OurLlamaConfig

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "artifacts" / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # written by `make build-engines`
THETA = 100000.0  # SmolLM2's RoPE base; the default a 4.x reader falls back to is 10000

# The keys transformers 4.x's LlamaConfig takes (models/llama/configuration_llama.py, __init__), which
# TensorRT-LLM's readers get through it, plus the PretrainedConfig keys they index directly.
CLASSIC_KEYS = {
    "architectures", "model_type", "torch_dtype", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "initializer_range", "rms_norm_eps", "pretraining_tp", "use_cache", "rope_theta",
    "rope_scaling", "attention_bias", "attention_dropout", "mlp_bias", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "pad_token_id",
}  # fmt: skip


def _tiny_hf(tmp_path: Path) -> tuple[Path, LlamaForCausalLM]:
    """A tiny HF Llama saved the way build/fetch_model.py saves SmolLM2 (tied head not stored)."""
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=THETA, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    assert cfg.to_dict()["architectures"] is None and "rope_theta" not in cfg.to_dict()  # what 5.x writes
    out = tmp_path / "ckpt"
    out.mkdir()
    hf_config.HFLlamaConfig.from_raw(model.config.to_dict()).write(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, model


def _check_classic(raw: dict, theta: float) -> None:
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["rope_theta"] == theta and raw["rope_scaling"] is None
    assert CLASSIC_KEYS <= set(raw), f"missing {sorted(CLASSIC_KEYS - set(raw))}"
    assert "rope_parameters" not in raw  # one source of the RoPE base, the one 4.x reads


def test_written_config_is_classic_and_reads_back_as_the_same_model(tmp_path: Path) -> None:
    ckpt, model = _tiny_hf(tmp_path)
    _check_classic(json.loads((ckpt / "config.json").read_text()), THETA)
    loaded = LlamaConfig.from_pretrained(ckpt)  # transformers 5.x, as the CPU tools load it today
    assert loaded.architectures == ["LlamaForCausalLM"] and loaded.rope_parameters["rope_theta"] == THETA
    assert OurLlamaConfig.from_hf(ckpt).rope_theta == THETA
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 100, 7]])
    with torch.no_grad():
        again = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_an_old_config_is_rewritten_once(tmp_path: Path) -> None:
    ckpt, model = _tiny_hf(tmp_path)
    (ckpt / "config.json").write_text(json.dumps(model.config.to_dict()))  # as the previous version wrote it
    assert hf_config.ensure_classic(ckpt)
    _check_classic(json.loads((ckpt / "config.json").read_text()), THETA)
    assert not hf_config.ensure_classic(ckpt)


def test_draft_model_config_stays_classic(tmp_path: Path) -> None:
    ckpt, _ = _tiny_hf(tmp_path)
    make_draft(ckpt, tmp_path / "draft", layers=1)
    raw = json.loads((tmp_path / "draft" / "config.json").read_text())
    _check_classic(raw, THETA)
    assert raw["num_hidden_layers"] == 1


def test_smollm2_checkpoint_config(checkpoint: Path) -> None:
    """The converted SmolLM2 checkpoints, against the RoPE base the GGUF itself records."""
    from gguf import GGUFReader

    if not GGUF.exists():
        pytest.fail(f"no GGUF at {GGUF}: run `make build-engines`")
    field = GGUFReader(GGUF).fields["llama.rope.freq_base"]
    theta = float(field.parts[field.data[0]][0])
    assert theta == THETA
    for ckpt in (checkpoint, checkpoint.parent / "smollm2-135m-draft"):
        _check_classic(json.loads((ckpt / "config.json").read_text()), theta)
        assert LlamaConfig.from_pretrained(ckpt).rope_parameters["rope_theta"] == theta
