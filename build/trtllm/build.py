"""`make build-engines ENGINE=trtllm`: compile the engines with TensorRT-LLM and render the repository.

With --dry-run it only prints every command and every rendered config.pbtxt, so it runs anywhere
(no GPU, no TensorRT-LLM). Without it, each command runs in turn (a step whose output directory
already exists is skipped, so a failed build resumes), then the repository is rendered.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from build.render_repository import render
from build.trtllm.commands import Layout, Step, plan
from build.trtllm.pins import NGC_IMAGE, TRTLLM_TAG, TRTLLM_VERSION
from build.trtllm.render import render_values
from build.trtllm.spec import BuildSpec, SpecError, load_spec

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(ap: argparse.ArgumentParser, default_spec: Path = ROOT / "build" / "specs" / "smollm2-eagle.yaml") -> None:
    g = ap.add_argument_group("ENGINE=trtllm")
    g.add_argument("--spec", type=Path, default=default_spec, help="build spec (YAML)")
    g.add_argument("--dry-run", action="store_true", help="print the commands and rendered configs; run nothing")
    g.add_argument(
        "--trtllm-examples", type=Path, default=Path(os.environ.get("TRTLLM_EXAMPLES", ROOT / "artifacts" / "TensorRT-LLM" / "examples")),
        help=f"examples/ of a TensorRT-LLM {TRTLLM_TAG} checkout (conversion scripts); default $TRTLLM_EXAMPLES",
    )
    g.add_argument(
        "--trtllm-python", default=os.environ.get("TRTLLM_PYTHON", "python3"),
        help="interpreter with tensorrt_llm installed, for the conversion scripts (default $TRTLLM_PYTHON or python3; "
        "the image's system Python, not the project venv)",
    )


def _show(step: Step) -> str:
    return f"# {step.name}\n{shlex.join(step.argv)}"


def _run(step: Step) -> None:
    if step.output.exists():
        print(f"[trtllm] skip {step.name}: {step.output} exists", flush=True)
        return
    print(f"[trtllm] {step.name} ...\n  {shlex.join(step.argv)}", flush=True)
    t0 = time.monotonic()
    tmp = step.output.with_name(step.output.name + ".partial")
    argv = [str(tmp) if a == str(step.output) else a for a in step.argv]  # publish only complete outputs
    try:
        subprocess.run(argv, check=True, cwd=ROOT)  # ROOT: `python -m build...` steps import the repository
    except FileNotFoundError as exc:
        raise SystemExit(f"[trtllm] {step.name}: {exc.filename} not found (run inside {NGC_IMAGE})") from None
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"[trtllm] {step.name} failed with exit code {exc.returncode}") from None
    tmp.rename(step.output)
    print(f"[trtllm] {step.name} done in {time.monotonic() - t0:.0f}s", flush=True)


def _check_tools(python: str) -> None:
    """Fail before the first (long) step when TensorRT-LLM is not where the commands expect it."""
    if shutil.which("trtllm-build") is None:
        raise SystemExit(f"[trtllm] trtllm-build is not on PATH: run inside {NGC_IMAGE}")
    probe = [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('tensorrt_llm') is None)"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        raise SystemExit(f"[trtllm] {python} cannot import tensorrt_llm: pass --trtllm-python (the image's /usr/bin/python3)")


def _check_inputs(spec: BuildSpec, examples: Path) -> None:
    """Fail before the first (long) step when an input is missing."""
    sp = spec.speculative
    needed = [spec.target_hf_dir, spec.tokenizer, examples]
    needed += [sp.eagle.head_dir] if sp.eagle and sp.eagle.head_dir else []
    needed += [sp.draft_hf_dir] if sp.draft_hf_dir else []
    missing = [str(p) for p in needed if not Path(p).exists()]
    if missing:
        raise SystemExit(
            "[trtllm] missing inputs:\n  " + "\n  ".join(missing) + "\n(SmolLM2 is fetched and converted by "
            f"`make build-engines` (ENGINE=cpu); the conversion scripts come from a TensorRT-LLM {TRTLLM_TAG} checkout, "
            "see docs/trtllm.md)"
        )


def _stamp(spec: BuildSpec, layout: Layout) -> None:
    """Existing outputs are reused, so refuse to mix them with a different spec under the same name."""
    stamp = layout.root / "spec.json"
    current = spec.model_dump_json(indent=2)
    if stamp.exists() and stamp.read_text() != current:
        raise SystemExit(f"[trtllm] {layout.root} was built from a different spec named {spec.name!r}: "
                         f"remove it or give the spec a new name")  # fmt: skip
    layout.root.mkdir(parents=True, exist_ok=True)
    stamp.write_text(current)


def build(
    spec: BuildSpec, artifacts: Path, out_dir: Path, policy: Path, examples: Path, python: str, dry_run: bool
) -> list[Path]:
    layout = Layout(artifacts.resolve() / "trtllm" / spec.name)
    steps = plan(spec, layout, examples.resolve(), python)
    values, per_model = render_values(spec, layout, policy.resolve())
    print(f"[trtllm] spec {spec.name}: method {spec.speculative.method}, TensorRT-LLM {TRTLLM_VERSION}, "
          f"tp {spec.parallel.tp_size} x pp {spec.parallel.pp_size}", flush=True)  # fmt: skip
    if spec.speculative.method == "draft_model":
        print("[trtllm] note: draft_model needs draft_input_ids from an orchestrator; the gate sends none, so "
              "spec_engine decodes without drafts (see docs/trtllm.md)", flush=True)  # fmt: skip
    if dry_run:
        print("\n".join(_show(s) for s in steps))
        with tempfile.TemporaryDirectory() as tmp:
            for cfg in render("trtllm", values, Path(tmp) / "model_repository", per_model):
                print(f"# ---- {out_dir / 'model_repository' / cfg.parent.name / 'config.pbtxt'}\n{cfg.read_text()}")
        return []
    _check_tools(python)
    _check_inputs(spec, examples)
    _stamp(spec, layout)
    for step in steps:
        _run(step)
    written = render("trtllm", values, out_dir / "model_repository", per_model)
    print(f"[trtllm] rendered model repository: {out_dir / 'model_repository'}", flush=True)
    return written


def run_from_args(args: argparse.Namespace) -> None:
    """Entry from build/build_engines.py (--engine trtllm)."""
    try:
        spec = load_spec(args.spec, ROOT)
    except SpecError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
    artifacts: Path = args.artifacts
    out_dir = getattr(args, "out_dir", None) or artifacts  # --out-dir belongs to the CPU parser, when present
    policy = args.policy or ROOT / "policy" / "default.yaml"
    build(spec, artifacts, out_dir, policy, args.trtllm_examples, args.trtllm_python, args.dry_run)
