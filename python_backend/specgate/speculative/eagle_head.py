"""EAGLE-1 draft head: one Llama layer that extrapolates the target's final features.

Pairing (what the serving drafters rely on). Let `f_t` be the target's final hidden state at
position t (after the final norm, as `Llama.forward` returns it), so `target.lm_head(f_t)` scores
token t+1. The head consumes pairs `(f_t, x_{t+1})` -- a feature and the token that FOLLOWS it --
and predicts `f_{t+1}`:

    h_t = layer(fc(cat(embed(x_{t+1}), f_t)))  ~=  f_{t+1},    draft token = argmax lm_head(h_t)

The pair's K/V live at the head's cache index of position t (RoPE position t by default). After the
target verifies, the drafter feeds every newly known `(f_t, x_{t+1})` pair (true features), then
chains: the last pair predicts `h`, `x' = argmax draft_logits(h)`, and the next step feeds `(h, x')`
at position t+1. Draft logits cover a reduced vocabulary; `d2t` maps draft indices to target ids.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specgate.decoding.model import Attn, DecoderLayer, KVCache, LlamaConfig, Rotary
from specgate.decoding.sampling import greedy_tokens

WEIGHTS = "eagle_head.safetensors"
CONFIG = "config.json"


class EagleHeadConfig(BaseModel):
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    draft_vocab_size: int
    target_vocab_size: int
    max_position_embeddings: int = 8192

    @classmethod
    def from_target(cls, cfg: LlamaConfig, draft_vocab_size: int) -> "EagleHeadConfig":
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            draft_vocab_size=draft_vocab_size,
            target_vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def llama_config(self) -> LlamaConfig:
        """A one-layer LlamaConfig: builds the DecoderLayer, the rotary table and the KVCache."""
        return LlamaConfig(
            vocab_size=self.target_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            tie_word_embeddings=True,
            eos_token_id=-1,
            max_position_embeddings=self.max_position_embeddings,
        )


class _Levels:
    """Attention for teacher-forced draft chains at every position at once (EAGLE-3's training-time
    test). Level 0 is the causal forward over true pairs; level j's query at base p sees the true
    pairs <= p and its own chain's entries at levels 1..j -- exactly what the serving cache holds
    when the chain from p reaches step j. Keys are kept per level, nothing persists."""

    def __init__(self, L: int) -> None:
        self.L = L
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.is_causal, self.mask = True, None

    def write_and_read(self, cache_k: Tensor | None, cache_v: Tensor | None, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.keys.append(k)
        self.values.append(v)
        j = len(self.keys) - 1
        if j:
            eye = torch.eye(self.L, dtype=torch.bool, device=k.device)
            self.is_causal = False
            self.mask = torch.cat([torch.tril(torch.ones(self.L, self.L, dtype=torch.bool, device=k.device))] + [eye] * j, dim=1)
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)


class EagleHead(nn.Module):
    """`embed` and `lm_head` are the target's input and output tables [V, D] (`Target.embeddings()`)."""

    def __init__(self, cfg: EagleHeadConfig, embed: Tensor, lm_head: Tensor, d2t: Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.llama_cfg = cfg.llama_config()
        D = cfg.hidden_size
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.layer = DecoderLayer(self.llama_cfg, use_input_norm=False)
        self.register_buffer("d2t", d2t.long().clone())
        # Frozen pieces of the target. `embed` is the target's own table, kept unregistered so that
        # `head.to(...)` or `head.state_dict()` never touch (or copy) it.
        object.__setattr__(self, "embed", embed)
        self.lm_head = nn.Linear(D, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight = nn.Parameter(lm_head.detach()[self.d2t].clone().to(self.fc.weight.dtype), requires_grad=False)
        self.rotary = Rotary(self.llama_cfg, cfg.max_position_embeddings)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (and the cache's): the weights' own, or float32 once quantized."""
        return self.layer.post_norm.weight.dtype

    def trainable_state(self) -> dict[str, Tensor]:
        """What a head file stores: fc, the layer and d2t (embed / lm_head rows come from the target)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("lm_head.")}

    def new_cache(self, max_len: int, dtype: torch.dtype) -> KVCache:
        return KVCache(self.llama_cfg, num_slots=1, max_len=max_len, dtype=dtype)

    def _inputs(self, features: Tensor, input_ids: Tensor) -> Tensor:
        dtype = self.dtype
        with torch.no_grad():  # the target's table is frozen: no gradient for 49k x D rows
            emb = F.embedding(input_ids, self.embed).to(dtype)
        return self.fc(torch.cat([emb, features.to(dtype)], dim=-1))

    def forward(
        self,
        features: Tensor,
        input_ids: Tensor,
        cache: KVCache,
        cache_len: int,
        positions: Tensor | None = None,
        tree_mask: Tensor | None = None,
    ) -> Tensor:
        """Pairs (features[:, t], input_ids[:, t]) -> predicted next features [1, T, D].

        K/V are written at cache indices cache_len .. cache_len+T-1; positions default to the same.
        """
        T = input_ids.shape[1]
        cache_lens = torch.tensor([cache_len])
        if positions is None:
            positions = cache_len + torch.arange(T).view(1, T)
        x = self._inputs(features, input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        att = Attn(torch.tensor([0]), cache_lens, T, tree_mask)
        return self.layer(x, cos, sin, cache.k[0], cache.v[0], att)

    def forward_train(self, features: Tensor, input_ids: Tensor) -> Tensor:
        """Causal forward without a cache over [B, T] pairs at positions 0..T-1."""
        return self.forward_levels(features, input_ids, 1)[0]

    def forward_levels(self, features: Tensor, input_ids: Tensor, levels: int) -> list[Tensor]:
        """Draft chains from every base pair at once, fed their own features but the true tokens.

        features [B, L, D] = f_0..f_{L-1}; input_ids [B, L + levels - 1] = x_1..x_{L+levels-1}.
        Level j's row p is the chain from pair p after j+1 steps: it predicts f_{p+j+1}, at RoPE
        position p+j, and feeds level j+1 (with token x_{p+j+2}). Level 0 is `forward_train`.
        """
        B, L = features.shape[:2]
        att, h, out = _Levels(L), features, []
        for j in range(levels):
            x = self._inputs(h, input_ids[:, j : j + L])
            cos, sin = self.rotary((torch.arange(L) + j).expand(B, L), x.dtype)
            h = self.layer(x, cos, sin, None, None, att)
            out.append(h)
        return out

    def draft_logits(self, hidden: Tensor) -> Tensor:
        x = hidden.to(self.dtype)  # as rows: the int8 product takes 2-D input only
        return self.lm_head(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1).float()

    def draft_token(self, logits: Tensor) -> int:
        """The greedy draft of a [Vd] draft-logits row, as a target token id."""
        return int(self.d2t[greedy_tokens(logits)[0]])


@torch.inference_mode()
def greedy_chain(head: EagleHead, feature: Tensor, token: int, cache: KVCache, cache_len: int, k: int) -> list[int]:
    """Draft k tokens greedily from the last known pair (feature [1, 1, D] = f_t, token = x_{t+1}).

    Writes k entries at cache_len.. (the caller rolls `cache_len` back to keep only accepted ones).
    """
    out: list[int] = []
    h, x = feature, token
    for i in range(k):
        h = head(h, torch.tensor([[x]]), cache, cache_len + i)
        x = head.draft_token(head.draft_logits(h[0, -1]))
        out.append(x)
    return out


def save_eagle_head(head: EagleHead, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.trainable_state().items()}, str(path / WEIGHTS))
    (path / CONFIG).write_text(head.cfg.model_dump_json(indent=2) + "\n")


def int8_supported() -> bool:
    """Whether torch has a fast int8 kernel for the head's one-row products here (x86's fbgemm)."""
    return "x86" in torch.backends.quantized.supported_engines


def quantize_int8(head: EagleHead) -> EagleHead:
    """The head with int8 weights (one scale per output row; `fc` excepted) and fp32 activations,
    quantized per call. A drafted node is one row through each product, which reads the weights
    once: fbgemm's int8 kernel ran those 2-4x faster than fp32 or bf16 (docs/speculative.md,
    "EAGLE"). Drafts are only proposals, so this changes acceptance, never the output.

    torch.ao's dynamic quantization is deprecated in favour of torchao, whose CPU int8 path was
    slower than fp32 for one row; torch is pinned, and the unit tests hold this path."""
    head = head.float()
    # `fc` stays fp32: its input (a token's embedding beside the target's feature) has outliers, and
    # with one int8 scale for the whole row the head accepted 0.44 at position 1 instead of 0.50
    # (20 held-out prompts); with fc in fp32 it accepted the same as the fp32 head.
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    spec = {name: qconfig for name, m in head.named_modules() if isinstance(m, nn.Linear) and name != "fc"}
    with warnings.catch_warnings():  # the deprecations, known and answered above, once per load
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated", category=UserWarning)
        warnings.filterwarnings("ignore", message="torch.ao.quantization is deprecated", category=DeprecationWarning)
        return torch.ao.quantization.quantize_dynamic(head, spec, inplace=True)


def load_eagle_head(path: Path, embed: Tensor, lm_head: Tensor, dtype: torch.dtype, int8: bool = False) -> EagleHead:
    """The head in `path`, on the target tables `embed` / `lm_head` [V, D]; `int8`: quantized
    (`quantize_int8`), else in `dtype`."""
    cfg = EagleHeadConfig.model_validate(json.loads((path / CONFIG).read_text()))
    if (cfg.target_vocab_size, cfg.hidden_size) != tuple(embed.shape):
        raise ValueError(f"head {path} was trained for another target "
                         f"(vocab x hidden {cfg.target_vocab_size} x {cfg.hidden_size}, target {tuple(embed.shape)})")
    sd = load_file(str(path / WEIGHTS))
    head = EagleHead(cfg, embed, lm_head, sd["d2t"])
    missing, unexpected = head.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if not m.startswith("lm_head.")]:
        raise ValueError(f"bad head file {path / WEIGHTS}: missing {missing}, unexpected {unexpected}")
    return quantize_int8(head.eval()) if int8 else head.to(dtype).eval()
