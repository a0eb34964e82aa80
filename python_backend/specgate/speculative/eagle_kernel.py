"""The EAGLE head through the fused layer that `make setup` patches into llama.cpp's CPU backend.

In PyTorch a drafted node is about 60 operators beside its five products, and their per-call costs
made a node cost a fifth to a third of a decode on 2-core CPUs (docs/speculative.md, "The EAGLE
head: one call a node"). `ggml_cpu_specgate_eagle_layer` (build/llamacpp_kernels/eagle_layer.c)
runs the layer for up to 64 new pairs in one call: int8 weights with a scale per output row,
activations quantized per row, `fc` in bf16 (the head file's dtype) with fp32 inputs. Longer blocks
(a prompt's catch-up) take the PyTorch head, whose int8 products are blocked for many rows. Both
write the same K/V cache.

`KernelEagleHead` offers what the drafters use of `EagleHead`: calling it, `draft_logits`,
`draft_token`, `d2t`, `dtype` and `new_cache`. Drafts are only proposals: this changes which tokens
are proposed, never the output.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from specgate.decoding.model import KVCache
from specgate.decoding.sampling import greedy_tokens
from specgate.speculative.eagle_head import EagleHead, int8_supported, quantize_int8

MAX_ROWS = 64  # the kernel's limit on new pairs per call (its stack of row scales)

_F = ctypes.POINTER(ctypes.c_float)
_I8 = ctypes.POINTER(ctypes.c_int8)


class EagleWeights(ctypes.Structure):
    """`struct specgate_eagle_weights` (eagle_layer.c)."""

    _fields_ = [
        *[(name, ctypes.c_int32) for name in
          ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "draft_vocab", "vocab", "max_len", "rope_len",
           "threads")],
        ("eps", ctypes.c_float),
        ("embed", _F),
        ("fc", ctypes.POINTER(ctypes.c_uint16)),
        ("qkv", _I8), ("qkv_scale", _F),
        ("o", _I8), ("o_scale", _F),
        ("gate_up", _I8), ("gate_up_scale", _F),
        ("down", _I8), ("down_scale", _F),
        ("post_norm", _F),
        ("lm_head", _I8), ("lm_head_scale", _F),
        ("rope_cos", _F), ("rope_sin", _F),
    ]


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """int8 weights [N, K] and one fp32 scale per row (symmetric: max |w| / 127)."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.where(scale[:, None] > 0, w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None], 0)
    return q.round().to(torch.int8).contiguous(), scale.contiguous()


class KernelFunctions:
    """The fused layer's two entry points, looked up by name in the loaded libggml-cpu
    (`Native.cpu_function`); None where the build lacks them."""

    def __init__(self, lookup: Callable[[str], Any]) -> None:
        self.layer = lookup("ggml_cpu_specgate_eagle_layer")
        self.logits = lookup("ggml_cpu_specgate_eagle_logits")
        if self.layer is not None:
            self.layer.argtypes = [ctypes.POINTER(EagleWeights), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                   ctypes.c_void_p]
            self.layer.restype = ctypes.c_int
        if self.logits is not None:
            self.logits.argtypes = [ctypes.POINTER(EagleWeights), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
            self.logits.restype = None

    @property
    def available(self) -> bool:
        return self.layer is not None and self.logits is not None


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


class KernelEagleHead:
    """An fp32 `EagleHead` run through the fused kernel, with K/V caches of `max_len` cells; `threads`
    2 splits each product's rows between the caller and one helper thread (eagle_layer.c). It takes
    the head over: blocks of more than MAX_ROWS pairs go through it, in int8 (`quantize_int8`) where
    torch has x86's int8 kernels."""

    def __init__(self, head: EagleHead, kernel: KernelFunctions, max_len: int, threads: int = 1) -> None:
        if not kernel.available:
            raise RuntimeError("this llama-cpp-python build lacks the fused EAGLE layer; reinstall it with `make setup`")
        if head.dtype != torch.float32:
            raise ValueError(f"the kernel quantizes an fp32 head, not {head.dtype}")
        cfg, layer = head.cfg, head.layer
        self.cfg, self.d2t, self._kernel = cfg, head.d2t, kernel
        # Everything the struct points at is kept here: the kernel reads it at every call.
        self._keep: dict[str, Tensor] = {
            "embed": head.embed.detach().float().contiguous(),
            # bf16: the head file's own dtype (a float head's weights were bf16 on disk), half fp32's bytes
            "fc": head.fc.weight.detach().to(torch.bfloat16).contiguous().view(torch.int16),
            "post_norm": layer.post_norm.weight.detach().float().contiguous(),
            "rope_cos": head.rotary.cos.contiguous(),
            "rope_sin": head.rotary.sin.contiguous(),
        }
        for name, lin in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up), ("down", layer.down),
                          ("lm_head", head.lm_head)):
            self._keep[name], self._keep[name + "_scale"] = quantize_rows(lin.weight)
        k = self._keep
        self._w = EagleWeights(
            hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size, draft_vocab=cfg.draft_vocab_size, vocab=k["embed"].shape[0],
            max_len=max_len, rope_len=k["rope_cos"].shape[0], threads=min(threads, 2), eps=cfg.rms_norm_eps,
            **{name: ctypes.cast(_ptr(t), dict(EagleWeights._fields_)[name]) for name, t in k.items()},
        )
        self.max_len = max_len
        # After the copies above: quantize_int8 replaces the head's products in place (`fc` stays fp32).
        self.fallback = quantize_int8(head) if int8_supported() else head

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def new_cache(self, max_len: int, dtype: torch.dtype) -> KVCache:
        if max_len != self.max_len:
            raise ValueError(f"the kernel's cache holds {self.max_len} cells, not {max_len}")
        return self.fallback.new_cache(max_len, torch.float32)

    def __call__(self, features: Tensor, input_ids: Tensor, cache: KVCache, cache_len: int,
                 positions: Tensor | None = None, tree_mask: Tensor | None = None) -> Tensor:
        """As `EagleHead.forward`: pairs (features[:, t], input_ids[:, t]) -> predicted features [1, T, D]."""
        T = input_ids.shape[1]
        if cache.max_len != self.max_len or cache.k.dtype != torch.float32:  # the kernel writes cells by its own sizes
            raise ValueError(f"not this head's cache: {cache.max_len} cells of {cache.k.dtype}, "
                             f"the kernel's are {self.max_len} of torch.float32 (new_cache)")
        if T > MAX_ROWS:
            with torch.inference_mode():
                return self.fallback(features, input_ids, cache, cache_len, positions, tree_mask)
        feats = features.reshape(T, -1).float().contiguous()
        tokens = np.ascontiguousarray(input_ids.reshape(T), dtype=np.int32)
        pos = np.arange(cache_len, cache_len + T, dtype=np.int32) if positions is None else \
            np.ascontiguousarray(positions.reshape(T), dtype=np.int32)
        visible = None if tree_mask is None else np.ascontiguousarray(tree_mask, dtype=np.uint8)
        out = torch.empty(1, T, self.cfg.hidden_size)
        rc = self._kernel.layer(ctypes.byref(self._w), T, tokens.ctypes.data, _ptr(feats), pos.ctypes.data,
                                None if visible is None else visible.ctypes.data, _ptr(cache.k[0, 0]), _ptr(cache.v[0, 0]),
                                cache_len, _ptr(out))
        if rc != 0:
            raise ValueError(f"EAGLE kernel: {T} pairs at cache cell {cache_len} (of {self.max_len}), "
                             f"tokens {tokens.min()}..{tokens.max()}, positions {pos.min()}..{pos.max()} out of range")
        return out

    def draft_logits(self, hidden: Tensor) -> Tensor:
        rows = hidden.reshape(-1, self.cfg.hidden_size).float().contiguous()
        out = torch.empty(rows.shape[0], self.cfg.draft_vocab_size)
        self._kernel.logits(ctypes.byref(self._w), rows.shape[0], _ptr(rows), _ptr(out))
        return out.reshape(*hidden.shape[:-1], -1)

    def draft_token(self, logits: Tensor) -> int:
        """The greedy draft of a [Vd] draft-logits row, as a target token id."""
        return int(self.d2t[greedy_tokens(logits)[0]])
