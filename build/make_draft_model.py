"""Derive the CPU default draft model from the target: its first N decoder layers + final norm + tied head.

Written twice, for the two engines: as a GGUF (`make_draft_gguf`, the target's quantized tensors
copied as they are, for llama.cpp) and as an HF-style checkpoint (`make_draft`, for the PyTorch
engine's `load_llama`). Any other draft with the target's tokenizer can replace either.
Idempotent: skips the write when the output already holds N layers.

Why N = 4. Measured on 2 busy cores (10 prompts x 32 greedy tokens, fp32 teacher forcing for the
agreement; bf16 single-token forward for the cost, relative to the 30-layer target):

    layers                     2      4      6      8     12     16     20     24
    top-1 agreement         0.027  0.049  0.046  0.038  0.057  0.087  0.13   0.27
    cost per draft token     0.20   0.28   ~0.33  0.37   0.47    -      -    ~0.8

4 layers give the most agreement per unit cost. Without training, the early layers of this model do
not predict the next token, so every N is a net slowdown on CPU (build/bench_drafters.py); the
draft-model path is here to be exercised and for a trained or distilled draft checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from build import hf_config

DEFAULT_LAYERS = 4


def _log(msg: str) -> None:
    print(f"[make-draft-model] {msg}", flush=True)


def make_draft(target_dir: Path, out_dir: Path, layers: int) -> None:
    config = hf_config.read(target_dir)
    if not 1 <= layers < config.num_hidden_layers:
        raise SystemExit(f"[make-draft-model] error: --layers must be in [1, {config.num_hidden_layers - 1}]")
    if (out_dir / "model.safetensors").exists() and (out_dir / "config.json").exists():
        if hf_config.read(out_dir).num_hidden_layers == layers:
            _log(f"draft model present: {out_dir} ({layers} layers)")
            if hf_config.ensure_classic(out_dir):  # written by an older version of this step
                _log(f"rewrote {out_dir / 'config.json'} in the classic Llama layout")
            return
    from safetensors.torch import load_file, save_file  # torch: only when a draft is written

    _log(f"reading {target_dir}")
    state = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    keep = {
        k: v.contiguous()
        for k, v in state.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.model_copy(update={"num_hidden_layers": layers}).write(out_dir)
    _log(f"wrote {out_dir} ({layers} of {len({k.split('.')[2] for k in state if k.startswith('model.layers.')})} layers)")


def _gguf_layers(path: Path) -> int | None:
    """A GGUF's block count as llama.cpp reads it, vocabulary only (a fraction of a second); None if
    it cannot. gguf's Python reader builds a numpy view of every metadata element first: about 3 s
    for this model's 49k-token vocabulary, paid by every render of a model repository (each test
    server's too)."""
    import ctypes

    import llama_cpp as L

    from specgate.decoding.llamacpp_native import quiet_logs

    quiet_logs(L)
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        return None
    try:
        def meta(key: str) -> str | None:
            buf = ctypes.create_string_buffer(128)
            return buf.value.decode() if L.llama_model_meta_val_str(model, key.encode(), buf, len(buf)) >= 0 else None

        count = meta(f"{meta('general.architecture')}.block_count")
        return int(count) if count else None
    finally:
        L.llama_model_free(model)


def make_draft_gguf(target: Path, out: Path, layers: int) -> None:
    """The first `layers` blocks of the GGUF `target`, with its metadata (block count changed)."""
    import gguf

    if out.exists() and _gguf_layers(out) == layers:
        _log(f"draft GGUF present: {out} ({layers} layers)")
        return
    reader = gguf.GGUFReader(target)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    block_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = reader.fields[block_key].contents()
    if not 1 <= layers < total:
        raise SystemExit(f"[make-draft-model] error: --layers must be in [1, {total - 1}]")
    keep = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, arch=arch)
    for field in reader.fields.values():  # as gguf's own gguf_new_metadata script copies them
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == block_key else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in keep:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in keep:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    _log(f"wrote {out} ({layers} of {total} layers)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", type=Path, default=Path("artifacts/checkpoints/smollm2-135m-instruct"))
    ap.add_argument("--out", type=Path, default=Path("artifacts/checkpoints/smollm2-135m-draft"))
    ap.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    args = ap.parse_args()
    make_draft(args.target, args.out, args.layers)


if __name__ == "__main__":
    main()
