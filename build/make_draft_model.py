"""Derive the CPU default draft model from the target: its first N decoder layers + final norm + tied head.

Written as an HF-style checkpoint (config.json + model.safetensors, the target's key names) so that
`load_llama` loads it like any other Llama. N = 8 by `build/bench_drafters.py --draft-layers`: on
2 cores in bf16 it gave the best tokens/s of the layer counts tried (see the README numbers).
Idempotent: skips the write when the output already holds N layers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.torch import load_file, save_file

DEFAULT_LAYERS = 8


def _log(msg: str) -> None:
    print(f"[make-draft-model] {msg}", flush=True)


def make_draft(target_dir: Path, out_dir: Path, layers: int) -> None:
    config = json.loads((target_dir / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise SystemExit(f"[make-draft-model] error: --layers must be in [1, {config['num_hidden_layers'] - 1}]")
    if (out_dir / "model.safetensors").exists() and (out_dir / "config.json").exists():
        if json.loads((out_dir / "config.json").read_text())["num_hidden_layers"] == layers:
            _log(f"draft model present: {out_dir} ({layers} layers)")
            return
    _log(f"reading {target_dir}")
    state = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    keep = {
        k: v.contiguous()
        for k, v in state.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    config["num_hidden_layers"] = layers
    config["_name_or_path"] = f"{target_dir.name} first {layers} layers"
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    _log(f"wrote {out_dir} ({layers} of {len({k.split('.')[2] for k in state if k.startswith('model.layers.')})} layers)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", type=Path, default=Path("artifacts/checkpoints/smollm2-135m-instruct"))
    ap.add_argument("--out", type=Path, default=Path("artifacts/checkpoints/smollm2-135m-draft"))
    ap.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    args = ap.parse_args()
    make_draft(args.target, args.out, args.layers)


if __name__ == "__main__":
    main()
