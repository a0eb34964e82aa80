"""A tiny random Llama GGUF with the shipped model's tokenizer: a "user's own model" for tests.

Written with gguf-py from random F32 tensors (2 layers, hidden 64); every tokenizer field (tokens,
merges, special ids, chat template) is copied from the shipped GGUF, so llama.cpp and transformers
load it like any chat GGUF. Its text is nonsense, which is all the tests need.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2


def write_tiny_gguf(shipped: Path, out: Path, seed: int = 0) -> Path:
    reader = gguf.GGUFReader(shipped)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(out, arch="llama")
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            writer.add_key_value(field.name, field.contents(), vtype,
                                 sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_name("tiny-random")
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    rng = np.random.default_rng(seed)

    def add(name: str, *shape: int) -> None:  # numpy order: gguf-py reverses it into ggml's
        data = np.ones(shape, np.float32) if name.endswith("norm.weight") else rng.normal(0, 0.1, shape).astype(np.float32)
        writer.add_tensor(name, data)

    add("token_embd.weight", vocab, HIDDEN)
    add("output_norm.weight", HIDDEN)
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", HIDDEN)
        add(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        add(f"blk.{i}.attn_k.weight", kv, HIDDEN)
        add(f"blk.{i}.attn_v.weight", kv, HIDDEN)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        add(f"blk.{i}.ffn_norm.weight", HIDDEN)
        add(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
