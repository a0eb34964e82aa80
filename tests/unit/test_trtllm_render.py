"""Both repository variants render from the ONE renderer, parse with Triton's own protobuf, and expose
the identical engine contract to spec_gate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import triton_to_np_dtype

from build.render_repository import MODELS, engine_tensor_values, render
from build.trtllm.commands import Layout
from build.trtllm.render import eagle_choices_param, render_values
from build.trtllm.spec import load_spec
from specgate.contract import ENGINE_INPUTS, ENGINE_OUTPUTS, engine_inputs

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("target_engine", "spec_engine")
SPEC_NAMES = ("eagle", "draft", "ngram")


def _parse(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def _render_cpu(out: Path) -> dict[str, model_config_pb2.ModelConfig]:
    values = {
        "tokenizer_dir": "/tok", "max_input_len": "2047", "max_output_len": "1024", "end_id": "2", "vocab_size": "49152",
        "policy_path": "/policy.yaml", "calibration_path": "/calibration.json", "text_instances": "2", "engine_max_batch_size": "8",
        "engine_extra_parameters": "", "engine_extensions": "true", **engine_tensor_values(with_extensions=True),
    }  # fmt: skip
    per_model = {e: {"engine_config": f"/{e}.json"} for e in ENGINES}
    return {p.parent.name: _parse(p) for p in render("cpu", values, out, per_model)}


def _render_trtllm(out: Path, name: str = "eagle") -> dict[str, model_config_pb2.ModelConfig]:
    spec = load_spec(ROOT / "build" / "specs" / f"smollm2-{name}.yaml", ROOT)
    values, per_model = render_values(spec, Layout(Path("/art/trtllm") / spec.name), Path("/policy.yaml"))
    return {p.parent.name: _parse(p) for p in render("trtllm", values, out, per_model)}


def _params(cfg: model_config_pb2.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


@pytest.fixture(scope="module")
def cpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, model_config_pb2.ModelConfig]:
    return _render_cpu(tmp_path_factory.mktemp("cpu") / "repo")


@pytest.fixture(scope="module")
def trt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, model_config_pb2.ModelConfig]:
    return _render_trtllm(tmp_path_factory.mktemp("trt") / "repo")


def test_every_model_renders_and_parses(cpu, trt) -> None:
    assert set(cpu) == set(trt) == set(MODELS)
    assert {cpu[e].backend for e in ENGINES} == {"python"}
    assert {trt[e].backend for e in ENGINES} == {"tensorrtllm"}


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_each_example_spec_renders(tmp_path: Path, name: str) -> None:
    configs = _render_trtllm(tmp_path / "repo", name)
    assert all(configs[e].model_transaction_policy.decoupled for e in ENGINES)  # streaming needs decoupled
    assert not (tmp_path / "repo" / "spec_engine" / "1" / "model.py").exists()


# Every output the tensorrtllm backend writes when a request sets return_perf_metrics, pinned from upstream
# (names: OutputFieldsNames in triton_backend/inflight_batcher_llm/src/utils.h; written unconditionally by
# ModelInstanceState::fillTritonResponse in model_instance_state.cc; dtypes as its processStats writes them, dims
# as the backend's all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt declares them). Read at
# NVIDIA/TensorRT-LLM 0c8de69a1ca6213eebb20a51873890ff128666c2 and, identical, at the last tensorrtllm_backend
# revision that held the backend, c2e65b88d85255be30cf50440a91662abeb497dd. Triton core rejects any undeclared one.
BACKEND_PERF_OUTPUTS = {
    "kv_cache_alloc_new_blocks": "TYPE_INT32",
    "kv_cache_reused_blocks": "TYPE_INT32",
    "kv_cache_alloc_total_blocks": "TYPE_INT32",
    "arrival_time_ns": "TYPE_INT64",
    "first_scheduled_time_ns": "TYPE_INT64",
    "first_token_time_ns": "TYPE_INT64",
    "last_token_time_ns": "TYPE_INT64",
    "acceptance_rate": "TYPE_FP32",
    "total_accepted_draft_tokens": "TYPE_INT32",
    "total_draft_tokens": "TYPE_INT32",
}


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_every_perf_output_the_backend_writes_is_declared(tmp_path: Path, name: str) -> None:
    """The gate always sends return_perf_metrics=True; one undeclared output fails every response."""
    configs = _render_trtllm(tmp_path / "repo", name)
    for engine in ENGINES:
        declared = {t.name: (model_config_pb2.DataType.Name(t.data_type), tuple(t.dims)) for t in configs[engine].output}
        missing = sorted(set(BACKEND_PERF_OUTPUTS) - set(declared))
        assert not missing, f"{engine} ({name}) does not declare {missing}"
        for out, dtype in BACKEND_PERF_OUTPUTS.items():
            assert declared[out] == (dtype, (1,)), f"{engine} ({name}): {out} is {declared[out]}"


def _contract(cfg: model_config_pb2.ModelConfig) -> tuple[dict, dict]:
    def sig(ts) -> dict:
        # outputs have no `optional` field in ModelOutput
        return {t.name: (model_config_pb2.DataType.Name(t.data_type), tuple(t.dims), getattr(t, "optional", False)) for t in ts}

    return sig(cfg.input), sig(cfg.output)


@pytest.mark.parametrize("engine", ENGINES)
def test_identical_engine_contract(cpu, trt, engine: str) -> None:
    cpu_in, cpu_out = _contract(cpu[engine])
    trt_in, trt_out = _contract(trt[engine])
    assert cpu_in == trt_in
    assert set(trt_in) == {t.name for t in ENGINE_INPUTS}
    used = {t.name for t in ENGINE_OUTPUTS}  # what the gate reads; the CPU adds optional extensions
    assert {k: cpu_out[k] for k in used} == {k: trt_out[k] for k in used}
    assert cpu[engine].max_batch_size == trt[engine].max_batch_size
    assert cpu[engine].model_transaction_policy.decoupled == trt[engine].model_transaction_policy.decoupled


def test_unchanged_models_are_identical_across_variants(cpu, trt) -> None:
    for model in ("llm", "spec_gate", "preprocessing"):
        assert cpu[model].backend == trt[model].backend
        assert _contract(cpu[model]) == _contract(trt[model])


def test_tensorrtllm_parameters(trt) -> None:
    target, spec = _params(trt["target_engine"]), _params(trt["spec_engine"])
    for p in (target, spec):
        assert p["gpt_model_type"] == "inflight_fused_batching" and p["max_beam_width"] == "1"
        assert p["exclude_input_in_output"] == "true" and p["kv_cache_free_gpu_mem_fraction"] == "0.4"
    assert target["gpt_model_path"] == "/art/trtllm/smollm2-eagle/engines/target"
    assert spec["gpt_model_path"] == "/art/trtllm/smollm2-eagle/engines/spec"
    assert target["decoding_mode"] == "top_k_top_p" and spec["decoding_mode"] == "eagle"
    assert spec["eagle_choices"].startswith("{0}, {1}, {2}, {3}, {0, 0}") and "eagle_choices" not in target


def test_lookahead_parameters(tmp_path: Path) -> None:
    p = _params(_render_trtllm(tmp_path / "repo", "ngram")["spec_engine"])
    assert p["decoding_mode"] == "lookahead"
    assert (p["lookahead_window_size"], p["lookahead_ngram_size"], p["lookahead_verification_set_size"]) == ("4", "3", "4")


def _backend_parse(text: str) -> list[list[int]]:
    """A port of the backend's utils::csvStrToVecVecInt (split on '}', drop one leading '{', then ',')."""
    out, rest = [], text
    while "}" in rest:
        item, rest = rest.split("}", 1)
        item = item.strip().lstrip(",").strip()
        out.append([int(x) for x in item.removeprefix("{").split(",")])
    return out


def test_eagle_choices_format() -> None:
    assert eagle_choices_param([[0, 0, 0], [0, 1]]) == "{0, 0, 0}, {0, 1}"  # docs/model_config.md
    spec = load_spec(ROOT / "build" / "specs" / "smollm2-eagle.yaml", ROOT)
    choices = spec.speculative.eagle.eagle_choices
    assert _backend_parse(eagle_choices_param(choices)) == choices  # no outer braces: the parser drops only one


def test_engine_request_builder_matches_the_engine_config(trt) -> None:
    """The one builder the gate, bench-gate and gpu-smoke use sends what the tensorrtllm model accepts:
    every tensor declared, in its dtype, with the batch dimension in front of the declared dims."""
    declared = {t.name: t for t in trt["spec_engine"].input}
    arrays = engine_inputs([5, 6, 7], 16, 2, temperature=0.5, top_k=3, seed=-1, stop_words=np.array([[9, 10], [2, -1]]))
    assert {t.name for t in ENGINE_INPUTS} == set(arrays)  # with seed and stop words, all of them
    for name, arr in arrays.items():
        t = declared[name]
        assert arr.dtype == np.dtype(triton_to_np_dtype(model_config_pb2.DataType.Name(t.data_type).removeprefix("TYPE_"))), name
        assert arr.ndim == len(t.dims) + 1 and arr.shape[0] == 1, name
        assert all(d == -1 or d == n for d, n in zip(t.dims, arr.shape[1:])), name
    assert int(arrays["seed"][0, 0]) == 2**64 - 1  # a negative client seed wraps like the gate's
    assert set(engine_inputs([1], 1, 2)) == set(arrays) - {"seed", "stop_words_list"}
