"""`make build-engines`: prepare engines and render the model repository.

ENGINE=cpu (default): llama.cpp over the shipped GGUF (and a draft GGUF derived from it), or over
MODEL=path/to/model.gguf, any chat GGUF llama.cpp loads (its own tokenizer, chat template and EOS;
DRAFT=path/to/draft.gguf adds draft_model; the EAGLE drafters need a head trained for that model).
ENGINE=torch: the PyTorch engine over a safetensors checkpoint converted from the shipped GGUF, the
exact fp32 reference (DTYPE=auto by default: bf16 only where the CPU has native bf16).
Both: fetch the model, derive the draft model, write the engine configs and render the repository for
the Python-backend engines. Idempotent; prints what it does. ENGINE=trtllm: build/trtllm.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from build import fetch_model, make_draft_model
from build.render_repository import engine_tensor_values, render
from build.trtllm import build as trtllm
from specgate.algorithms import EAGLE_HEAD_ALGORITHMS
from specgate.decoding.config import EngineConfig
from specgate.text.tokenizer import PromptTokenizer

ROOT = Path(__file__).resolve().parent.parent
HEAD_DIR = ROOT / "heads" / "smollm2-135m-eagle"


def build_cpu(args: argparse.Namespace) -> None:
    art = args.artifacts.resolve()
    gguf = fetch_model.fetch_gguf(art / "downloads")
    ckpt = art / "checkpoints" / "smollm2-135m-instruct"
    # The shipped model's tokenizer, the torch engine's weights and the TensorRT-LLM input: always.
    fetch_model.convert(gguf, ckpt)
    draft_layers = make_draft_model.DEFAULT_LAYERS
    draft_ckpt = art / "checkpoints" / "smollm2-135m-draft"
    make_draft_model.make_draft(ckpt, draft_ckpt, draft_layers)
    tokenizer_dir, head = ckpt, HEAD_DIR if (HEAD_DIR / "eagle_head.safetensors").exists() else None
    if args.model is not None:  # a user's own GGUF
        if args.engine != "cpu":
            raise SystemExit("[build-engines] error: MODEL= is served by the llama.cpp engine (ENGINE=cpu); "
                             "the PyTorch reference serves the shipped model")
        model, draft, head = args.model.resolve(), args.draft, None
        if not model.exists():
            raise SystemExit(f"[build-engines] error: no GGUF at {model}")
        tokenizer_dir = art / "models" / model.stem
        fetch_model.save_tokenizer(model, tokenizer_dir)
        print(f"[build-engines] serving {model.name}: {'/'.join(EAGLE_HEAD_ALGORITHMS)} off "
              "(the shipped EAGLE head is for SmolLM2-135M-Instruct)"
              + ("" if draft else "; draft_model off (DRAFT=path/to/draft.gguf adds it)"), flush=True)
    elif args.engine == "torch":
        model, draft = ckpt, args.draft or draft_ckpt
    else:
        model, draft = gguf, args.draft or art / "downloads" / f"{gguf.stem}.draft-{draft_layers}L.gguf"
        if args.draft is None:
            make_draft_model.make_draft_gguf(gguf, draft, draft_layers)
    out_root = (args.out_dir or art).resolve()
    eng_dir = out_root / "engines" / "cpu"
    eng_dir.mkdir(parents=True, exist_ok=True)
    common = {
        "backend": "llamacpp" if args.engine == "cpu" else "torch",
        "model": str(model),
        "dtype": args.dtype,
        "max_context": args.max_context,
        "max_output_len": args.max_output_len,
        "num_threads": args.threads,
        "exact": args.exact,
        "stream_interval_ms": args.stream_interval_ms,
        "stream_cost_budget": args.stream_cost_budget,
    }
    target_cfg = eng_dir / "target_engine.json"
    target_cfg.write_text(EngineConfig.model_validate({**common, "max_batch_size": args.max_batch_size}).model_dump_json(indent=2))
    if head is None and args.model is None:
        print(f"[build-engines] warning: no EAGLE head in {HEAD_DIR}; {'/'.join(EAGLE_HEAD_ALGORITHMS)} disabled (make train-eagle)",
              flush=True)
    calibration = (args.calibration_path or eng_dir / "calibration.json").resolve()
    calibration.unlink(missing_ok=True)  # another model's: the gate waits for spec_engine to publish this one's
    spec = EngineConfig.model_validate({
        **common,
        "max_batch_size": 1,
        "draft_model": str(draft) if draft else None,
        "eagle_head_dir": str(head) if head else None,
        "calibration_path": str(calibration),
        "calibration_override": json.loads(args.calibration_override) if args.calibration_override else None,
    })
    spec_cfg = eng_dir / "spec_engine.json"
    spec_cfg.write_text(spec.model_dump_json(indent=2))
    print(f"[build-engines] engine configs in {eng_dir} ({common['backend']}, {model.name}, context {args.max_context})", flush=True)
    tokenizer = PromptTokenizer(tokenizer_dir, args.max_context - 1, chat=False)  # what preprocessing serves with; its EOS and vocabulary
    try:
        end_id = tokenizer.eos_id
    except ValueError as exc:
        raise SystemExit(f"[build-engines] error: {tokenizer_dir}: {exc}") from None
    values = {
        "tokenizer_dir": str(tokenizer_dir),
        "max_input_len": str(args.max_context - 1),
        "max_output_len": str(args.max_output_len),
        "end_id": str(end_id),
        "vocab_size": str(tokenizer.vocab_size),  # ids the tokenizer can make; the gate refuses others
        "policy_path": str((args.policy or ROOT / "policy" / "default.yaml").resolve()),
        "calibration_path": str(calibration),
        "text_instances": "2",
        "engine_max_batch_size": str(args.max_batch_size),
        "engine_extra_parameters": "",
        "engine_extensions": "true",
        **engine_tensor_values(with_extensions=True),
    }
    out = out_root / "model_repository"
    per_model = {"target_engine": {"engine_config": str(target_cfg)}, "spec_engine": {"engine_config": str(spec_cfg)}}
    render("cpu", values, out, per_model)
    print(f"[build-engines] rendered model repository: {out}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["cpu", "torch", "trtllm"], default="cpu",
                    help="cpu: llama.cpp (default); torch: the PyTorch reference")
    ap.add_argument("--model", type=Path, default=None, help="serve this chat GGUF instead of the shipped SmolLM2 (llama.cpp engine)")
    ap.add_argument("--draft", type=Path, default=None,
                    help="draft model sharing the target's vocabulary (GGUF for llama.cpp, checkpoint for torch)")
    ap.add_argument("--artifacts", type=Path, default=ROOT / "artifacts")
    ap.add_argument("--out-dir", type=Path, default=None, help="where engine configs + model_repository go (default: --artifacts)")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto", help="torch weights and the EAGLE head")
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0,
                    help="compute threads per engine (0: one per core for llama.cpp, the launcher's setting for torch)")
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                    help="llama.cpp's batch-invariant mode: greedy output identical across routes, budgets and batches "
                         "(docs/engines.md, 'Exact greedy')")
    ap.add_argument("--stream-interval-ms", type=float, default=None,
                    help="a fixed interval: streamed responses at most this often, 0 = one per decode step "
                         "(default: each engine measures what a response costs it and streams within --stream-cost-budget)")
    ap.add_argument("--stream-cost-budget", type=float, default=EngineConfig.model_fields["stream_cost_budget"].default,
                    help="the share of decode time streamed responses may cost, where the interval is measured")
    ap.add_argument("--calibration-path", type=Path, default=None,
                    help="where spec_engine publishes its calibration and the gate reads it (default: beside the engine configs)")
    ap.add_argument("--calibration-override", default=None,
                    help="JSON of specgate.decoding.config.CalibrationOverride: measurements spec_engine pins (tests)")
    ap.add_argument("--policy", type=Path, default=None, help="gate policy file (default policy/default.yaml)")
    trtllm.add_arguments(ap)
    args = ap.parse_args()
    if args.engine == "trtllm":
        trtllm.run_from_args(args)
    else:
        build_cpu(args)


if __name__ == "__main__":
    main()
