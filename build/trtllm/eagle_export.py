"""Export the project's EAGLE head as the EAGLE-1 checkpoint TensorRT-LLM's EAGLE conversion reads.

`examples/eagle/convert_checkpoint.py --eagle_model_dir DIR` (NVIDIA/TensorRT-LLM, read at 65b31db1b401d3752b8ebe7c29093cbfb6af04b7)
reads `DIR/config.json` with transformers' `LlamaConfig.from_pretrained` (heads, sizes, `num_hidden_layers`,
`rms_norm_eps`, `max_position_embeddings`, `head_dim`; the RoPE base and vocabulary come from the target's config),
and every EagleNet parameter except `lm_head` from `DIR/*.safetensors`, named by `ModelWeightsLoader`
(tensorrt_llm/models/model_weights_loader.py): an EagleNet is a Llama model with `fc` after the embedding, no input
norm in its first layer and no final norm (tensorrt_llm/models/eagle/model.py), and its `fc` has a bias
(tensorrt_llm/models/llama/model.py, `fc_after_embed`). So the file holds

    embed_tokens.weight [V, D]      fc.weight [D, 2D], fc.bias [D]      lm_head.weight [V, D]
    layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
    layers.0.post_attention_layernorm.weight

Our head drafts over a top-k draft vocabulary and stores only fc, its layer and `d2t`. The export is the
full-vocabulary head: the same fc (a zero bias: ours has none) and layer, with the target's embedding and its
lm_head, which for a tied target are the same table. Over the draft vocabulary its logits are exactly the shipped
head's. Tensors are written in float32, which holds both the bf16 head and the fp32 target exactly.

    python -m build.trtllm.eagle_export --head heads/smollm2-135m-eagle \\
        --target artifacts/checkpoints/smollm2-135m-instruct --out DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from build import hf_config
from specgate.decoding.model import HF_LAYER_NAMES, Llama, load_llama
from specgate.speculative.eagle_head import EagleHead, EagleHeadConfig, load_eagle_head

WEIGHTS = "model.safetensors"
LAYER = "layers.0."  # the head's one layer


def _part_sizes(cfg: EagleHeadConfig) -> dict[str, list[int]]:
    """Row sizes of the HF tensors fused into one of our parameters (HF_LAYER_NAMES order)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"qkv": [q, kv, kv], "gate_up": [cfg.intermediate_size] * 2}


def head_config(cfg: EagleHeadConfig, target: Llama) -> hf_config.HFLlamaConfig:
    """The one-layer Llama config of the exported head, over the target's full vocabulary."""
    return hf_config.HFLlamaConfig(
        vocab_size=cfg.target_vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=target.cfg.tie_word_embeddings,
        eos_token_id=target.cfg.eos_token_id,
    )


def upstream_state(head: EagleHead, target: Llama) -> dict[str, Tensor]:
    """The EAGLE-1 tensors (names above) of the full-vocabulary head, in float32."""
    ours = head.layer.state_dict()
    sizes = _part_sizes(head.cfg)
    out = {
        "embed_tokens.weight": target.embed.weight,
        "lm_head.weight": target.lm_head.weight,
        "fc.weight": head.fc.weight,
        "fc.bias": torch.zeros(head.cfg.hidden_size),
    }
    for name, parts in HF_LAYER_NAMES.items():
        if f"{name}.weight" not in ours:  # the head's layer has no input norm
            continue
        w = ours[f"{name}.weight"]
        for part, piece in zip(parts, w.split(sizes.get(name, [w.shape[0]]))):
            out[f"{LAYER}{part}.weight"] = piece
    # copies: a tied target's embed and lm_head are one tensor, which safetensors will not store twice
    return {k: v.detach().to(torch.float32, copy=True).contiguous() for k, v in out.items()}


def export(head: EagleHead, target: Llama, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(upstream_state(head, target), str(out / WEIGHTS), metadata={"format": "pt"})
    head_config(head.cfg, target).write(out)


def load_exported(path: Path, target: Llama, dtype: torch.dtype) -> EagleHead:
    """The inverse of `export`: the exported head as our EagleHead, drafting over the full vocabulary."""
    c = hf_config.read(path)
    sd = load_file(str(path / WEIGHTS))
    if c.num_hidden_layers != 1 or sd["fc.bias"].any():
        raise ValueError(f"{path} is not a one-layer EAGLE-1 head without an fc bias")
    for name, table in (("embed_tokens.weight", target.embed.weight), ("lm_head.weight", target.lm_head.weight)):
        if not torch.equal(sd[name].to(table.dtype), table.detach()):
            raise ValueError(f"{path}: {name} is not the target's")
    V = c.vocab_size
    cfg = EagleHeadConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, draft_vocab_size=V, target_vocab_size=V, max_position_embeddings=c.max_position_embeddings,
    )  # fmt: skip
    head = EagleHead(cfg, target.embed.weight, target.lm_head.weight, torch.arange(V))
    state = {"fc.weight": sd["fc.weight"], "d2t": head.d2t}
    for name, parts in HF_LAYER_NAMES.items():
        if all(f"{LAYER}{p}.weight" in sd for p in parts):
            state[f"layer.{name}.weight"] = torch.cat([sd[f"{LAYER}{p}.weight"] for p in parts])
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.startswith("lm_head.")]:
        raise ValueError(f"bad head file {path / WEIGHTS}: missing {missing}, unexpected {unexpected}")
    return head.to(dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, required=True, help="the project's EAGLE head (eagle_head.safetensors + config.json)")
    ap.add_argument("--target", type=Path, required=True, help="the target's converted HF checkpoint")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    target = load_llama(args.target, torch.float32, max_len=1)  # no forward: only its tables are used
    head = load_eagle_head(args.head, target.embed.weight, target.lm_head.weight, torch.float32)
    export(head, target, args.out)
    print(f"[eagle-export] {args.head} -> {args.out} (full vocabulary {head.cfg.target_vocab_size})", flush=True)


if __name__ == "__main__":
    main()
