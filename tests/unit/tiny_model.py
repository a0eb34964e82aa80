"""A tiny random Llama for tests that need a target's shapes, not its knowledge."""

from __future__ import annotations

import torch

from specgate.decoding.model import Llama, LlamaConfig

TINY = LlamaConfig(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
    eos_token_id=2, max_position_embeddings=256,
)  # fmt: skip


def tiny_target(dtype: torch.dtype = torch.float32) -> Llama:
    torch.manual_seed(0)
    return Llama(TINY, max_len=256).to(dtype).eval()
