"""Command construction against the pinned TensorRT-LLM flags (build/trtllm/pins.py cites each source)."""

from __future__ import annotations

from pathlib import Path

from build.trtllm.commands import Layout, plan
from build.trtllm.spec import BuildSpec, load_spec

ROOT = Path(__file__).resolve().parents[2]
EX = Path("/tllm/examples")
LAYOUT = Layout(Path("/out"))


def _spec(name: str, **over) -> BuildSpec:
    spec = load_spec(ROOT / "build" / "specs" / f"smollm2-{name}.yaml", ROOT)
    return spec.model_copy(update=over)


def _flags(argv: list[str]) -> dict[str, str]:
    """--flag value pairs of an argv."""
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--") and not argv[i + 1].startswith("--")}


def test_baseline_engine_is_always_built_first() -> None:
    for name in ("eagle", "draft", "ngram"):
        convert, build = plan(_spec(name), LAYOUT, EX)[:2]
        assert convert.argv[:2] == ["python3", "/tllm/examples/models/core/llama/convert_checkpoint.py"]
        assert build.argv[0] == "trtllm-build" and "--speculative_decoding_mode" not in build.argv
        f = _flags(build.argv)
        assert f["--checkpoint_dir"] == "/out/checkpoints/target" and f["--output_dir"] == "/out/engines/target"
        assert (f["--max_batch_size"], f["--max_input_len"], f["--max_seq_len"]) == ("8", "2047", "3071")


def test_eagle_export_conversion_and_build() -> None:
    steps = plan(_spec("eagle"), LAYOUT, EX)
    assert [s.name for s in steps][2:] == ["export EAGLE head", "convert target + EAGLE head", "build spec_engine (EAGLE)"]
    export, conv, build = steps[2].argv, steps[3].argv, steps[4].argv
    assert export[1:3] == ["-m", "build.trtllm.eagle_export"]  # the project's interpreter: it imports specgate
    e = _flags(export)
    assert e["--head"] == str(ROOT / "heads/smollm2-135m-eagle") and e["--out"] == "/out/checkpoints/eagle-head"
    assert e["--target"] == str(ROOT / "artifacts/checkpoints/smollm2-135m-instruct")
    assert conv[1] == "/tllm/examples/eagle/convert_checkpoint.py"
    f = _flags(conv)
    assert f["--eagle_model_dir"] == "/out/checkpoints/eagle-head" == str(steps[2].output)  # the exported head
    assert f["--model_dir"] == str(ROOT / "artifacts/checkpoints/smollm2-135m-instruct")
    assert (f["--max_draft_len"], f["--num_eagle_layers"], f["--max_non_leaves_per_layer"]) == ("14", "3", "10")
    assert _flags(build)["--speculative_decoding_mode"] == "eagle"
    assert _flags(build)["--checkpoint_dir"] == "/out/checkpoints/eagle" and _flags(build)["--output_dir"] == "/out/engines/spec"
    assert steps[4].output == Path("/out/engines/spec")


def test_draft_target_builds_a_draft_engine_and_an_external_draft_target() -> None:
    steps = plan(_spec("draft"), LAYOUT, EX)
    names = [s.name for s in steps]
    assert names[2:] == ["convert draft model", "build draft engine", "build spec_engine (target, draft tokens external)"]
    assert _flags(steps[2].argv)["--model_dir"] == str(ROOT / "artifacts/checkpoints/smollm2-135m-draft")
    assert "--speculative_decoding_mode" not in steps[3].argv
    f = _flags(steps[4].argv)
    assert f["--speculative_decoding_mode"] == "draft_tokens_external" and f["--max_draft_len"] == "4"
    assert f["--checkpoint_dir"] == "/out/checkpoints/target"


def test_ngram_is_lookahead_on_the_target_checkpoint() -> None:
    steps = plan(_spec("ngram"), LAYOUT, EX)
    assert len(steps) == 3
    f = _flags(steps[2].argv)
    assert f["--speculative_decoding_mode"] == "lookahead_decoding" and f["--max_draft_len"] == "15"
    assert f["--checkpoint_dir"] == "/out/checkpoints/target"


def test_tensor_and_pipeline_parallel_go_into_every_conversion() -> None:
    base = _spec("draft")
    spec = base.model_copy(update={"parallel": base.parallel.model_copy(update={"tp_size": 2, "pp_size": 2, "gpus": 4})})
    for step in plan(spec, LAYOUT, EX):
        if "convert" in step.name:
            assert (_flags(step.argv)["--tp_size"], _flags(step.argv)["--pp_size"]) == ("2", "2")
        else:  # trtllm-build takes the mapping from the checkpoint; it has no tp/pp flags
            assert "--tp_size" not in step.argv and "--pp_size" not in step.argv
    assert spec.parallel.world_size == 4
