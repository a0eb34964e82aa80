"""Llama-architecture forward pass with a preallocated, slotted KV cache.

One `forward` serves every caller:
- prefill and single-token decode of one sequence,
- batched decode of several sequences at different lengths (in-flight batching), and
- verification of a draft chain or tree (`tree_mask` + explicit `positions`).

Each sequence owns a cache *slot*. New keys/values are written at the slot's current length
(`cache_lens[b]`), which is a storage index; the RoPE position is given separately (`positions`),
because tree nodes at the same depth share a position but not a storage index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    eos_token_id: int
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, path: Path) -> "LlamaConfig":
        c = json.loads((path / "config.json").read_text())
        rope = c.get("rope_parameters") or {}
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            rms_norm_eps=c["rms_norm_eps"],
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            eos_token_id=c["eos_token_id"] if isinstance(c["eos_token_id"], int) else c["eos_token_id"][0],
            max_position_embeddings=c["max_position_embeddings"],
        )


class KVCache:
    """Keys and values for `num_slots` sequences of up to `max_len` tokens each.

    Layout [layers, slots, kv_heads, max_len, head_dim]: a slot's prefix is contiguous, so a single
    sequence attends over a view without copying.
    """

    def __init__(self, cfg: LlamaConfig, num_slots: int, max_len: int, dtype: torch.dtype) -> None:
        shape = (cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.max_len = max_len

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` entries to slot `dst` (keeps a batch's slots contiguous)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def compact(self, slot: int, start: int, keep: Tensor) -> None:
        """Move entries `start + keep[i]` to `start + i`: keeps the accepted path of a verified tree."""
        src = start + keep
        dst = torch.arange(start, start + keep.numel())
        self.k[:, slot, :, dst] = self.k[:, slot, :, src]
        self.v[:, slot, :, dst] = self.v[:, slot, :, src]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Same arithmetic as transformers' LlamaRMSNorm (fp32 variance, cast back before the weight),
        # so bf16 results match the reference as closely as possible.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Rotary:
    def __init__(self, cfg: LlamaConfig, max_len: int) -> None:
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # [B, 1, T, head_dim], broadcast over heads
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """softmax(q k^T / sqrt(D)) v with grouped-query heads (query head h reads KV head h // (H / Hkv)).

    q [B, H, T, D]; keys/values [B, Hkv, L, D]; mask (True = visible) broadcasts to [B, 1, T, L].
    Decode steps (one new token per sequence, padding masked when B > 1) run as two fp32 matmuls
    written out here: PyTorch's CPU flash kernel was several times slower for one query per
    sequence, with the same error against an fp64 reference (docs/batching.md, "Threads"). Blocks of
    several tokens (prefill, verification, drafting) keep the flash kernel: there the matmuls gained
    nothing.
    """
    B, H, T, D = q.shape
    if T > 1 or is_causal:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    Hkv = keys.shape[1]
    scores = torch.matmul(q.reshape(B, Hkv, H // Hkv, D).float(), keys.float().transpose(-1, -2)) * D**-0.5
    if mask is not None:  # [B, 1, 1, L]: the same for every head
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, -1), values.float())
    return out.view(B, H, 1, D).to(q.dtype)


class DecoderLayer(nn.Module):
    """Attention + SwiGLU MLP. q/k/v and gate/up are fused into one matmul each (fewer CPU ops)."""

    def __init__(self, cfg: LlamaConfig, use_input_norm: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=False)
        self.o = nn.Linear(q, cfg.hidden_size, bias=False)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if use_input_norm else nn.Identity()
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache_k: Tensor, cache_v: Tensor, att: "Attn") -> Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        h = self.input_norm(x)
        q, k, v = self.qkv(h).split(
            [cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim],
            dim=-1,
        )
        q = q.view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = v.view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = att.write_and_read(cache_k, cache_v, k, v)
        o = attend(q, keys, values, att.mask, att.is_causal)
        x = x + self.o(o.transpose(1, 2).reshape(B, T, -1))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Attn:
    """Where one forward writes its new K/V and what each new token may attend to.

    Computed once per forward and shared by all layers.
    """

    def __init__(self, slots: Tensor, cache_lens: Tensor, T: int, tree_mask: Tensor | None) -> None:
        self.slots = slots
        self.starts = cache_lens
        self.T = T
        B = slots.numel()
        self.single = B == 1
        lo = int(slots[0])
        # The batch runner keeps its slots packed at 0..n-1 in order, so batched reads are views.
        self.first_slot = lo if torch.equal(slots, torch.arange(lo, lo + B)) else None
        ends = cache_lens + T
        self.kv_len = int(ends.max())
        self.is_causal = False
        self.mask: Tensor | None = None
        if self.single and tree_mask is None:
            start = int(cache_lens[0])
            if T == 1:
                return  # one new token sees the whole prefix: no mask needed
            if start == 0:
                self.is_causal = True  # plain prefill
                return
        # General case: prefix [0, start_b) visible, new block per tree_mask (default causal),
        # and padding beyond each sequence's end hidden.
        idx = torch.arange(self.kv_len)
        prefix = idx.view(1, 1, -1) < cache_lens.view(B, 1, 1)
        block = torch.tril(torch.ones(T, T, dtype=torch.bool)) if tree_mask is None else tree_mask
        block = block.expand(B, T, T) if block.dim() == 2 else block
        rel = idx.view(1, -1) - cache_lens.view(B, 1)  # [B, kv_len] index within the new block
        in_block = (rel >= 0) & (rel < T)
        gathered = torch.gather(block, 2, rel.clamp(0, T - 1).unsqueeze(1).expand(B, T, self.kv_len))
        self.mask = (prefix | (in_block.unsqueeze(1) & gathered)).unsqueeze(1)  # [B, 1, T, kv_len]

    def write_and_read(self, cache_k: Tensor, cache_v: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.single:
            s, start = int(self.slots[0]), int(self.starts[0])
            cache_k[s, :, start : start + self.T] = k[0]
            cache_v[s, :, start : start + self.T] = v[0]
            return cache_k[s : s + 1, :, : start + self.T], cache_v[s : s + 1, :, : start + self.T]
        if self.T == 1:  # batched decode: one scatter per layer, not one copy per sequence
            cache_k[self.slots, :, self.starts] = k[:, :, 0]
            cache_v[self.slots, :, self.starts] = v[:, :, 0]
        else:
            for b in range(self.slots.numel()):
                s, start = int(self.slots[b]), int(self.starts[b])
                cache_k[s, :, start : start + self.T] = k[b]
                cache_v[s, :, start : start + self.T] = v[b]
        if self.first_slot is not None:  # contiguous slots: attend over a view, no gather copy
            lo, hi = self.first_slot, self.first_slot + self.slots.numel()
            return cache_k[lo:hi, :, : self.kv_len], cache_v[lo:hi, :, : self.kv_len]
        return cache_k[self.slots, :, : self.kv_len], cache_v[self.slots, :, : self.kv_len]


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg, max_len)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        cache: KVCache,
        slots: Tensor,
        cache_lens: Tensor,
        positions: Tensor | None = None,
        tree_mask: Tensor | None = None,
    ) -> Tensor:
        """Run `input_ids` [B, T] and return final hidden states [B, T, D] (after the final norm).

        `cache_lens[b]` tokens of slot `slots[b]` are already cached; the new K/V land after them.
        `positions` default to `cache_lens[b] + t`. The caller advances its own lengths.
        """
        B, T = input_ids.shape
        if positions is None:
            positions = cache_lens.view(B, 1) + torch.arange(T).view(1, T)
        x = self.embed(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        att = Attn(slots, cache_lens, T, tree_mask)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], att)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()


# The HF Llama names of a DecoderLayer's parameters. q/k/v and gate/up are fused: stacked on dim 0, in this order.
HF_LAYER_NAMES: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
    "input_norm": ("input_layernorm",),
    "post_norm": ("post_attention_layernorm",),
}


def load_llama(checkpoint_dir: Path, dtype: torch.dtype, max_len: int) -> Llama:
    """Load an HF Llama checkpoint (safetensors) into `Llama`, fusing q/k/v and gate/up."""
    cfg = LlamaConfig.from_hf(checkpoint_dir)
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {checkpoint_dir}; run `make build-engines`")
    sd: dict[str, Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    ours: dict[str, Tensor] = {
        "embed.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "lm_head.weight": sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"],
    }
    for i in range(cfg.num_hidden_layers):
        for name, parts in HF_LAYER_NAMES.items():
            ours[f"layers.{i}.{name}.weight"] = torch.cat([sd[f"model.layers.{i}.{part}.weight"] for part in parts])
    with torch.device("meta"):
        model = Llama(cfg, max_len)
    model.load_state_dict(ours, assign=True)
    model.rotary = Rotary(cfg, max_len)  # rebuilt off the meta device
    model = model.to(dtype).eval()
    if cfg.tie_word_embeddings:  # .to() copied the shared tensor into two parameters; share it again
        model.lm_head.weight = model.embed.weight
    return model
