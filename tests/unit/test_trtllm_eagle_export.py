"""The EAGLE head exporter: the layout TensorRT-LLM's EAGLE conversion reads, and a round trip that drafts
what the shipped head drafts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaModel

from build.trtllm.eagle_export import WEIGHTS, export, load_exported
from specgate.decoding.model import KVCache, Llama, load_llama
from specgate.speculative.eagle_head import EagleHead, EagleHeadConfig, greedy_chain, load_eagle_head
from specgate.text.tokenizer import PromptTokenizer
from tests.unit.tiny_model import TINY, tiny_target

HEAD = Path(__file__).resolve().parents[2] / "heads" / "smollm2-135m-eagle"


def upstream_names(V: int, D: int, H: int, Hkv: int, hd: int, inter: int) -> dict[str, tuple[int, ...]]:
    """What examples/eagle/convert_checkpoint.py loads from --eagle_model_dir, with shapes.

    Read at NVIDIA/TensorRT-LLM 65b31db1b401d3752b8ebe7c29093cbfb6af04b7 (convert_and_save_hf, "Double checkpoint
    for HF"): every parameter of model.eagle_nets except lm_head, through ModelWeightsLoader.translate_to_external_key
    (tensorrt_llm/models/model_weights_loader.py at 7eb710fae6ea0014028f22d791d49b46c15472af) with `eagle_nets.{i}`
    and `drafter` mapped to "" and the drafter's `fc` to "fc". An EagleNet's drafter is LLaMAModel with
    fc_after_embed (ColumnLinear(2D, D, bias=True)), use_input_layernorm_in_first_layer=False and
    use_last_layernorm=False (tensorrt_llm/models/eagle/model.py at 06255cb759835a9797b656aa5d1dc8f7e75fdca6;
    tensorrt_llm/models/llama/model.py at 89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0). Plus lm_head.weight, the
    EAGLE-1 head's output table (that converter takes the EagleNets' lm_head from --model_dir instead).
    """
    p = "layers.0."
    return {
        "embed_tokens.weight": (V, D),
        "lm_head.weight": (V, D),
        "fc.weight": (D, 2 * D),
        "fc.bias": (D,),
        p + "self_attn.q_proj.weight": (H * hd, D),
        p + "self_attn.k_proj.weight": (Hkv * hd, D),
        p + "self_attn.v_proj.weight": (Hkv * hd, D),
        p + "self_attn.o_proj.weight": (D, H * hd),
        p + "mlp.gate_proj.weight": (inter, D),
        p + "mlp.up_proj.weight": (inter, D),
        p + "mlp.down_proj.weight": (D, inter),
        p + "post_attention_layernorm.weight": (D,),
    }


def _tiny_head(target: Llama, draft_vocab: int = 150) -> EagleHead:
    torch.manual_seed(1)
    d2t = torch.randperm(target.cfg.vocab_size)[:draft_vocab]
    head = EagleHead(EagleHeadConfig.from_target(target.cfg, draft_vocab), target.embed.weight, target.lm_head.weight, d2t).eval()
    with torch.no_grad():  # a trained layer's norm is not all ones: make a wrong name mapping show
        head.layer.post_norm.weight.uniform_(0.5, 1.5)
    return head


def _features(target: Llama, ids: torch.Tensor) -> torch.Tensor:
    return target(ids, KVCache(target.cfg, 1, ids.shape[1], torch.float32), torch.tensor([0]), torch.tensor([0]))


def _agree(shipped: EagleHead, full: EagleHead, feats: torch.Tensor, ids: torch.Tensor, k: int) -> int:
    """Both heads over one prompt: teacher-forced at every position, then a greedy chain of k from its end.

    The exported head must draft the shipped head's token wherever the draft vocabulary holds its own.
    Returns how many tokens were compared."""
    in_vocab = set(shipped.d2t.tolist())
    compared = 0
    T = ids.shape[1]
    with torch.no_grad():
        hs = shipped(feats[:, :-1], ids[:, 1:], shipped.new_cache(T + k, torch.float32), 0)
        hf = full(feats[:, :-1], ids[:, 1:], full.new_cache(T + k, torch.float32), 0)
        torch.testing.assert_close(hf, hs, rtol=0, atol=0)  # the same fc and layer: the same features
        for t in range(T - 1):
            tok = int(full.draft_logits(hf[0, t]).argmax())
            if tok in in_vocab:
                assert tok == int(shipped.d2t[shipped.draft_logits(hs[0, t]).argmax()]), f"position {t}"
                compared += 1
    last, x = feats[:, -1:], int(ids[0, -1])
    a = greedy_chain(shipped, last, x, shipped.new_cache(T + k, torch.float32), 0, k)
    b = greedy_chain(full, last, x, full.new_cache(T + k, torch.float32), 0, k)
    for tok_a, tok_b in zip(a, b):
        if tok_b not in in_vocab:
            break  # the shipped head cannot draft it; the chains part here
        assert tok_a == tok_b
        compared += 1
    return compared


def test_export_has_the_names_and_shapes_the_upstream_converter_reads(tmp_path: Path) -> None:
    target = tiny_target()
    export(_tiny_head(target), target, tmp_path)
    c = TINY
    expected = upstream_names(c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size)
    with safe_open(str(tmp_path / WEIGHTS), "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == expected
    # examples/eagle/convert_checkpoint.py reads these through LlamaConfig.from_pretrained(--eagle_model_dir)
    hf = LlamaConfig.from_pretrained(tmp_path)
    assert (hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size) == (1, c.hidden_size, c.intermediate_size)
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert (hf.rms_norm_eps, hf.max_position_embeddings, hf.vocab_size) == (c.rms_norm_eps, c.max_position_embeddings, c.vocab_size)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_export_read_as_hf_llama_computes_the_head(tmp_path: Path) -> None:
    """The names mean what the upstream loader assumes (HF Llama's): an EagleNet built from the file with
    transformers' Llama layer computes our head. EagleNet: fc(cat(embedding, feature)) with a bias, then the
    layer without its input norm and no final norm (tensorrt_llm/models/llama/model.py, LLaMAModel.forward)."""
    target = tiny_target()
    head = _tiny_head(target)
    export(head, target, tmp_path)
    cfg = LlamaConfig.from_pretrained(tmp_path)
    net = LlamaModel(cfg).eval()
    sd = load_file(str(tmp_path / WEIGHTS))
    missing, _ = net.load_state_dict({k: v for k, v in sd.items() if not k.startswith(("fc.", "lm_head."))}, strict=False)
    assert set(missing) == {"layers.0.input_layernorm.weight", "norm.weight"}
    net.layers[0].input_layernorm, net.norm = torch.nn.Identity(), torch.nn.Identity()
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size)
    fc.load_state_dict({"weight": sd["fc.weight"], "bias": sd["fc.bias"]})
    torch.manual_seed(3)
    feats, ids = torch.randn(1, 12, TINY.hidden_size), torch.randint(0, TINY.vocab_size, (1, 12))
    with torch.no_grad():
        x = fc(torch.cat([net.embed_tokens(ids), feats], dim=-1))
        torch.testing.assert_close(net(inputs_embeds=x).last_hidden_state, head.forward_train(feats, ids), rtol=1e-5, atol=1e-5)


def test_round_trip_drafts_like_the_head(tmp_path: Path) -> None:
    target = tiny_target()
    head = _tiny_head(target)
    export(head, target, tmp_path)
    full = load_exported(tmp_path, target, torch.float32)
    assert full.cfg.draft_vocab_size == TINY.vocab_size
    torch.manual_seed(2)
    compared = 0
    for _ in range(3):
        ids = torch.randint(0, TINY.vocab_size, (1, 24))
        compared += _agree(head, full, _features(target, ids), ids, k=4)
    assert compared >= 10  # not vacuous: the draft vocabulary is half of the target's


def test_shipped_head_round_trip(tmp_path: Path, checkpoint: Path) -> None:
    """The shipped head on the real target: the export drafts its tokens, over SmolLM2's full vocabulary."""
    target = load_llama(checkpoint, torch.float32, max_len=256)
    shipped = load_eagle_head(HEAD, target.embed.weight, target.lm_head.weight, torch.float32)
    export(shipped, target, tmp_path)
    full = load_exported(tmp_path, target, torch.float32)
    tok = PromptTokenizer(checkpoint, max_input_len=200)
    prompts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "Explain recursion in two sentences."]
    compared = 0
    for text in prompts:
        ids = torch.tensor([tok.encode_prompt(text)])
        compared += _agree(shipped, full, _features(target, ids), ids, k=5)
    assert compared >= 30
