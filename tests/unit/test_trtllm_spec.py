"""Build-spec validation: invalid specs fail early, with a message that says what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from build.trtllm.spec import BuildSpec, SpecError, load_spec

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "build" / "specs").glob("*.yaml"))


def _eagle(**over) -> dict:
    spec = yaml.safe_load((ROOT / "build" / "specs" / "smollm2-eagle.yaml").read_text())
    for key, value in over.items():
        node = spec
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return spec


def _error(raw: dict) -> str:
    with pytest.raises(ValueError) as exc:
        BuildSpec.model_validate(raw)
    return str(exc.value)


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_example_specs_are_valid(path: Path) -> None:
    spec = load_spec(path, ROOT)
    assert spec.target_hf_dir.is_absolute()


def test_eagle_without_head_fails() -> None:
    assert "needs speculative.eagle.head_dir" in _error(_eagle(**{"speculative.eagle.head_dir": None}))


@pytest.mark.parametrize(
    ("tp", "pp", "gpus", "msg"),
    [(2, 1, 1, "exceeds the 1 GPU(s)"), (2, 1, 3, "does not divide the 3 GPU(s)"), (4, 1, 2, "exceeds the 2 GPU(s)")],
)
def test_parallelism_must_fit_the_gpus(tp: int, pp: int, gpus: int, msg: str) -> None:
    assert msg in _error(_eagle(parallel={"tp_size": tp, "pp_size": pp, "gpus": gpus}))


def test_max_draft_len_limit() -> None:
    assert "exceeds 256" in _error(_eagle(**{"speculative.max_draft_len": 300}))


def test_eagle_tree_checks() -> None:
    assert "depth 3 must equal num_eagle_layers 4" in _error(_eagle(**{"speculative.eagle.num_eagle_layers": 4}))
    assert "more than max_draft_len 5" in _error(_eagle(**{"speculative.max_draft_len": 5}))
    assert "more than max_non_leaves_per_layer 2" in _error(_eagle(**{"speculative.eagle.max_non_leaves_per_layer": 2}))


def test_eagle_rejects_pipeline_parallelism() -> None:
    raw = _eagle(parallel={"tp_size": 1, "pp_size": 2, "gpus": 2}, serving={"target_gpu_device_ids": "0,1", "spec_gpu_device_ids": "0,1"})
    assert "pipeline parallelism" in _error(raw)


def test_gpu_device_ids_must_match_world_size() -> None:
    assert "must list 2 GPU id(s)" in _error(_eagle(parallel={"tp_size": 2, "pp_size": 1, "gpus": 2}))


def test_eagle2_is_refused_with_the_reason() -> None:
    raw = _eagle(**{"speculative.method": "eagle2", "speculative.eagle.eagle_choices": None,
                    "speculative.eagle.use_dynamic_tree": True, "speculative.eagle.dynamic_tree_max_topK": 4})  # fmt: skip
    assert "reads only `eagle_choices`" in _error(raw)


def test_draft_and_ngram_need_their_inputs() -> None:
    assert "needs speculative.draft_hf_dir" in _error(_eagle(**{"speculative.method": "draft_model"}))
    raw = _eagle(**{"speculative.method": "ngram", "speculative.eagle": None, "speculative.max_draft_len": 7,
                    "speculative.ngram": {"window_size": 4, "ngram_size": 3, "verification_set_size": 4}})  # fmt: skip
    assert "lookahead formula" in _error(raw) and "= 15" in _error(raw)


def test_unknown_fields_are_rejected() -> None:
    assert "Extra inputs" in _error(_eagle(max_batch=3))


def test_load_spec_reports_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_eagle(**{"speculative.eagle.head_dir": None, "speculative.max_draft_len": 999})))
    with pytest.raises(SpecError) as exc:
        load_spec(bad, ROOT)
    assert "exceeds 256" in str(exc.value) and "head_dir" in str(exc.value)
