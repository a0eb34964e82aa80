"""Render the Triton model repository from `model_repository/` templates.

One renderer for every engine kind: each model directory holds `config.pbtxt` (a `string.Template`)
and, for Python-backend models, `1/model.py`. An engine kind may override a model's template with
`config.<engine>.pbtxt` (e.g. `config.trtllm.pbtxt` for the tensorrtllm backend); a model whose
override sets `backend: "tensorrtllm"` gets no model.py copied.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from string import Template
from typing import Iterable

from specgate.contract import ENGINE_EXTENSIONS, ENGINE_INPUTS, ENGINE_OUTPUTS, Tensor

TEMPLATES = Path(__file__).resolve().parent.parent / "model_repository"
MODELS = ("llm", "preprocessing", "spec_gate", "target_engine", "spec_engine", "postprocessing")


def tensor_block(tensors: Iterable[Tensor]) -> str:
    """Config entries for the engine contract, generated from specgate.contract (one source of truth)."""
    lines = []
    for t in tensors:
        opt = " optional: true" if t.optional else ""
        dims = ", ".join(str(d) for d in t.dims)
        lines.append(f'  {{ name: "{t.name}" data_type: {t.dtype} dims: [ {dims} ]{opt} }}')
    return ",\n".join(lines)


def engine_tensor_values(with_extensions: bool) -> dict[str, str]:
    outputs = ENGINE_OUTPUTS + (ENGINE_EXTENSIONS if with_extensions else ())
    return {"engine_inputs": tensor_block(ENGINE_INPUTS), "engine_outputs": tensor_block(outputs)}


def render(
    engine: str,
    values: dict[str, str],
    out_dir: Path,
    per_model: dict[str, dict[str, str]] | None = None,
    templates: Path = TEMPLATES,
) -> list[Path]:
    """Render every model into `out_dir` (replacing it) and return the written config paths.

    `per_model` overrides values for one model (e.g. each engine's own config path).
    """
    if out_dir.exists():
        shutil.rmtree(out_dir)
    written = []
    for model in MODELS:
        src = templates / model
        tmpl = src / f"config.{engine}.pbtxt"
        if not tmpl.exists():
            tmpl = src / "config.pbtxt"
        try:
            text = Template(tmpl.read_text()).substitute({**values, **(per_model or {}).get(model, {})})
        except KeyError as exc:
            raise SystemExit(f"[render] {tmpl}: no value for template variable {exc}") from None
        dst = out_dir / model
        (dst / "1").mkdir(parents=True)
        (dst / "config.pbtxt").write_text(text)
        if 'backend: "python"' in text:
            shutil.copy(src / "1" / "model.py", dst / "1" / "model.py")
        written.append(dst / "config.pbtxt")
    return written
