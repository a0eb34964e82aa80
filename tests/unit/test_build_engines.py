"""`python -m build.build_engines` over artifacts that are already there only renders, and rendering
imports neither torch nor transformers: every server start renders its repository (this suite's five
of them, `make serve`, each replica), and torch with transformers was 4.7 of its 6.3 s (1.6 s without
torch, 1.1-1.3 without either, on a 2-core EPYC)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_rendering_a_built_repository_imports_no_torch_or_transformers(checkpoint: Path, gguf: Path, tmp_path: Path) -> None:
    shutil.copy(ROOT / "tests" / "integration" / "policy.yaml", tmp_path / "policy.yaml")
    args = ["--dtype", "float32", "--out-dir", str(tmp_path), "--policy", str(tmp_path / "policy.yaml")]
    code = (f"import runpy, sys; sys.argv = ['build_engines', *{args!r}]; runpy.run_module('build.build_engines', run_name='__main__'); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert (tmp_path / "model_repository" / "spec_gate" / "config.pbtxt").exists(), out.stdout
    assert out.stdout.splitlines()[-1] == "False False", out.stdout
