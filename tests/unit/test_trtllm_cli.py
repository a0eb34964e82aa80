"""`python -m build.build_engines --engine trtllm`: --dry-run runs without a GPU or TensorRT-LLM; real runs
resume from complete step outputs and refuse outputs of a different spec."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from build.trtllm.build import _run, _stamp
from build.trtllm.commands import Layout, Step
from build.trtllm.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "build" / "specs").glob("*.yaml"))


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "build.build_engines", "--engine", "trtllm", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_dry_run_prints_every_command_and_config(tmp_path: Path) -> None:
    r = _cli("--spec", "build/specs/smollm2-eagle.yaml", "--dry-run", "--artifacts", str(tmp_path), "--trtllm-examples", "/tllm/examples")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    eng = tmp_path / "trtllm" / "smollm2-eagle"
    assert (f"python3 /tllm/examples/models/core/llama/convert_checkpoint.py "
            f"--model_dir {ROOT}/artifacts/checkpoints/smollm2-135m-instruct") in out
    assert f"trtllm-build --checkpoint_dir {eng}/checkpoints/target --output_dir {eng}/engines/target" in out
    assert f"-m build.trtllm.eagle_export --head {ROOT}/heads/smollm2-135m-eagle" in out
    assert f"python3 /tllm/examples/eagle/convert_checkpoint.py --model_dir {ROOT}/artifacts/checkpoints/smollm2-135m-instruct " \
           f"--eagle_model_dir {eng}/checkpoints/eagle-head" in out  # fmt: skip
    assert "--max_draft_len 14 --num_eagle_layers 3 --max_non_leaves_per_layer 10" in out
    assert f"--output_dir {eng}/engines/spec" in out and "--speculative_decoding_mode eagle" in out
    for model in ("llm", "preprocessing", "spec_gate", "target_engine", "spec_engine"):
        assert f"model_repository/{model}/config.pbtxt" in out
    assert out.count('backend: "tensorrtllm"') == 2
    assert f'key: "gpt_model_path" value: {{ string_value: "{eng}/engines/spec" }}' in out
    assert not eng.exists()  # a dry run writes nothing


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.stem)
def test_every_example_spec_dry_runs(tmp_path: Path, spec: Path) -> None:
    """`make build-engines ENGINE=trtllm DRY_RUN=1 SPEC=...` for each spec in build/specs/."""
    r = _cli("--spec", str(spec), "--dry-run", "--artifacts", str(tmp_path), "--trtllm-examples", "/tllm/examples")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("trtllm-build --checkpoint_dir") >= 2 and r.stdout.count('backend: "tensorrtllm"') == 2
    exports = [line for line in r.stdout.splitlines() if "-m build.trtllm.eagle_export" in line]
    if "--eagle_model_dir" in r.stdout:  # every EAGLE conversion reads the head this build exported
        assert len(exports) == 1 and f"--out {tmp_path}/trtllm/" in exports[0]
        assert f"--eagle_model_dir {exports[0].split('--out ')[1]}" in r.stdout
    else:
        assert not exports


def test_invalid_spec_fails_before_any_command(tmp_path: Path) -> None:
    raw = yaml.safe_load((ROOT / "build" / "specs" / "smollm2-eagle.yaml").read_text())
    del raw["speculative"]["eagle"]["head_dir"]
    raw["parallel"] = {"tp_size": 2, "pp_size": 1, "gpus": 1}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    r = _cli("--spec", str(bad), "--dry-run")
    assert r.returncode == 2
    assert "needs speculative.eagle.head_dir" in r.stderr and "exceeds the 1 GPU(s)" in r.stderr
    assert "trtllm-build" not in r.stdout


def test_steps_publish_complete_outputs_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "engine"
    make = Step("make", [sys.executable, "-c", "import os, sys; os.makedirs(sys.argv[1])", str(out)], out)
    _run(make)
    assert out.is_dir() and not (tmp_path / "engine.partial").exists()
    _run(Step("fail", [sys.executable, "-c", "raise SystemExit(3)"], out))  # skipped: output exists


def test_spec_stamp_refuses_a_changed_spec(tmp_path: Path) -> None:
    spec = load_spec(ROOT / "build" / "specs" / "smollm2-ngram.yaml", ROOT)
    layout = Layout(tmp_path / "smollm2-ngram")
    _stamp(spec, layout)
    _stamp(spec, layout)  # same spec: fine
    with pytest.raises(SystemExit, match="different spec"):
        _stamp(spec.model_copy(update={"max_batch_size": 4}), layout)
