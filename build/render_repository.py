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

from specgate.contract import ENGINE_EXTENSIONS, ENGINE_INPUTS, ENGINE_OUTPUTS, GATE_TICK, LLM_INPUTS, LLM_OUTPUTS, PREPROCESSED, Tensor

TEMPLATES = Path(__file__).resolve().parent.parent / "model_repository"
MODELS = ("llm", "preprocessing", "spec_gate", "target_engine", "spec_engine")


def tensor_block(tensors: Iterable[Tensor], inputs: bool = True) -> str:
    """Config entries for tensors of specgate.contract (one source of truth); `optional` on inputs only."""
    lines = []
    for t in tensors:
        opt = " optional: true" if t.optional and inputs else ""
        dims = ", ".join(str(d) for d in t.dims)
        lines.append(f'  {{ name: "{t.name}" data_type: {t.dtype} dims: [ {dims} ]{opt} }}')
    return ",\n".join(lines)


def engine_tensor_values(with_extensions: bool) -> dict[str, str]:
    outputs = ENGINE_OUTPUTS + (ENGINE_EXTENSIONS if with_extensions else ())
    return {"engine_inputs": tensor_block(ENGINE_INPUTS), "engine_outputs": tensor_block(outputs)}


def llm_tensor_values() -> dict[str, str]:
    """The `llm` ensemble and the configs of the models it chains, from the contract's API tensors:
    a knob added to specgate.contract reaches every config it passes through. spec_gate runs in two
    steps: its intake reads the request, its serving step answers the client (contract.GATE_TICK)."""
    pre_in = [t for t in LLM_INPUTS if t.step == "preprocessing"]
    gate_in = [t for t in LLM_INPUTS if t.step == "spec_gate"]

    def step(model: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]]) -> str:
        maps = [f'      input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs]
        maps += [f'      output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs]
        return "    {\n" + f'      model_name: "{model}"\n      model_version: -1\n' + "\n".join(maps) + "\n    }"

    internal = lambda ts: [(t.name, f"_{t.name}") for t in ts]  # noqa: E731
    own = lambda ts: [(t.name, t.name) for t in ts]  # noqa: E731
    steps = [
        step("preprocessing", own(pre_in), internal(PREPROCESSED)),
        step("spec_gate", internal(PREPROCESSED) + own(gate_in), internal([GATE_TICK])),
        step("spec_gate", internal([GATE_TICK]), own(LLM_OUTPUTS)),
    ]
    return {
        "llm_inputs": tensor_block(LLM_INPUTS),
        "llm_outputs": tensor_block(LLM_OUTPUTS, inputs=False),
        "llm_steps": ",\n".join(steps),
        "preprocessing_inputs": tensor_block(pre_in),
        "preprocessing_outputs": tensor_block(PREPROCESSED, inputs=False),
        "gate_inputs": tensor_block([*PREPROCESSED, *gate_in, GATE_TICK]),
        "gate_outputs": tensor_block([*LLM_OUTPUTS, GATE_TICK], inputs=False),
    }


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
            text = Template(tmpl.read_text()).substitute({**values, **llm_tensor_values(), **(per_model or {}).get(model, {})})
        except KeyError as exc:
            raise SystemExit(f"[render] {tmpl}: no value for template variable {exc}") from None
        dst = out_dir / model
        (dst / "1").mkdir(parents=True)
        (dst / "config.pbtxt").write_text(text)
        if 'backend: "python"' in text:
            shutil.copy(src / "1" / "model.py", dst / "1" / "model.py")
        written.append(dst / "config.pbtxt")
    return written
