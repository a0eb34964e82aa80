"""specgate.contract is the one description of the `llm` API and the engine limits: every copy is
derived from it or checked against it here, so a knob added in one place and not the others fails."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2

from specgate.algorithms import ALGORITHMS, check_k
from specgate.contract import GATE_TICK, LLM_INPUTS, LLM_OUTPUTS, PREPROCESSED, GateDecision, api_table
from specgate.decoding.sampling import SamplingParams
from specgate.errors import InvalidInput
from specgate.gate import Gate, RequestInputs
from specgate.gate.policy import PolicyError
from specgate.serving.llm_request import LLMRequest, parse_llm_request
from specgate_client import META, GenerateParams, grpc_inputs
from tests.conftest import ROOT

GATE_KNOBS = {t.name for t in LLM_INPUTS if t.step == "spec_gate"}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, model_config_pb2.ModelConfig]:
    from tests.unit.test_trtllm_render import _render_cpu

    return _render_cpu(tmp_path_factory.mktemp("contract") / "repo")


def _io(cfg: model_config_pb2.ModelConfig, which: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {t.name: (model_config_pb2.DataType.Name(t.data_type), tuple(t.dims)) for t in getattr(cfg, which)}


def _expected(tensors) -> dict[str, tuple[str, tuple[int, ...]]]:  # noqa: ANN001
    return {t.name: (t.dtype, t.dims) for t in tensors}


def test_rendered_configs_carry_the_contract(rendered) -> None:  # noqa: ANN001
    assert _io(rendered["llm"], "input") == _expected(LLM_INPUTS)
    assert _io(rendered["llm"], "output") == _expected(LLM_OUTPUTS)
    assert _io(rendered["preprocessing"], "input") == _expected(t for t in LLM_INPUTS if t.step == "preprocessing")
    assert _io(rendered["preprocessing"], "output") == _expected(PREPROCESSED)
    assert _io(rendered["spec_gate"], "input") == _expected([*PREPROCESSED, *(t for t in LLM_INPUTS if t.step == "spec_gate"), GATE_TICK])
    assert _io(rendered["spec_gate"], "output") == _expected([*LLM_OUTPUTS, GATE_TICK])
    # spec_gate's two steps: the intake reads the request and hands the serving step its key; the
    # serving step writes every llm output (the front's meta is every one but the text)
    steps = [(s.model_name, dict(s.input_map), dict(s.output_map)) for s in rendered["llm"].ensemble_scheduling.step]
    assert [model for model, _, _ in steps] == ["preprocessing", "spec_gate", "spec_gate"]
    (_, _, pre_out), (_, intake_in, intake_out), (_, serve_in, serve_out) = steps
    assert set(intake_in) == {t.name for t in PREPROCESSED} | GATE_KNOBS and set(intake_in.values()) >= set(pre_out.values())
    assert list(intake_out) == [GATE_TICK.name] and serve_in == {GATE_TICK.name: intake_out[GATE_TICK.name]}
    assert serve_out == {t.name: t.name for t in LLM_OUTPUTS}
    assert set(GateDecision.model_fields) == {t.name for t in LLM_OUTPUTS} - {"text_output"}


def test_request_model_client_and_grpc_builder_follow_the_contract() -> None:
    assert GATE_KNOBS <= set(LLMRequest.model_fields)
    client_knobs = {f.name for f in dataclasses.fields(GenerateParams)} | {"text_input", "stream"}
    assert client_knobs == {t.name for t in LLM_INPUTS}
    assert set(META) == {t.name for t in LLM_OUTPUTS} - {"text_output"}
    full = GenerateParams(seed=1, stop=["x"], use_speculative_decoding=True, speculative_algorithm="ngram", num_speculative_tokens=2)
    built = {i.name(): i.datatype() for i in grpc_inputs("hi", full, True)}
    assert built == {t.name: t.dtype.removeprefix("TYPE_").replace("STRING", "BYTES") for t in LLM_INPUTS}


def test_readme_request_table_is_the_contract() -> None:
    assert api_table() in (ROOT / "README.md").read_text(), "README's request-API table differs from contract.api_table()"


# -- the gate refuses exactly what the engine would refuse -------------------------------------------
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_gate_and_engine_agree_on_k(tmp_path: Path, algorithm: str) -> None:
    (tmp_path / "p.yaml").write_text("mode: prod\n")
    gate = Gate(str(tmp_path / "p.yaml"))
    for k in (0, 1, ALGORITHMS[algorithm].max_k, ALGORITHMS[algorithm].max_k + 1, 99):
        try:
            check_k(algorithm, k)
            engine_ok = True
        except ValueError:
            engine_ok = False
        try:
            gate.finish(gate.decide(RequestInputs(speculative_algorithm=algorithm, num_speculative_tokens=k)))
            gate_ok = True
        except PolicyError:
            gate_ok = False
        assert gate_ok == engine_ok, (algorithm, k)


@pytest.mark.parametrize(
    "field, values",
    [("temperature", [-1.0, 0.0, 1e-40, 0.7, 3.0]), ("top_p", [0.0, 1e-3, 0.5, 1.0, 1.5]), ("top_k", [-1, 0, 5])],
)
def test_gate_and_engine_agree_on_sampling_ranges(field: str, values: list[float]) -> None:
    for v in values:
        try:
            parse_llm_request({field: v}, 1024)
            gate_ok = True
        except InvalidInput:
            gate_ok = False
        try:
            SamplingParams(**{field: v})
            engine_ok = True
        except ValueError:
            engine_ok = False
        assert gate_ok == engine_ok, (field, v)


def test_max_tokens_range_is_the_engine_configs() -> None:
    for v, ok in ((0, False), (1, True), (1024, True), (1025, False)):
        try:
            parse_llm_request({"max_tokens": v}, 1024)
            assert ok
        except InvalidInput:
            assert not ok
