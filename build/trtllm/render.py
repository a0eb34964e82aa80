"""Template values for the tensorrtllm variant of the ONE model repository (build/render_repository.py).

Only `target_engine` and `spec_engine` change (their `config.trtllm.pbtxt`); llm, preprocessing and
spec_gate render from the same templates and values as on the CPU.
"""

from __future__ import annotations

from pathlib import Path

from build.render_repository import tensor_block
from build.trtllm.commands import Layout
from build.trtllm.spec import BuildSpec
from specgate.contract import ENGINE_INPUTS, ENGINE_OUTPUTS, Tensor

# Per-tensor attributes of the backend's own tensorrt_llm config.pbtxt: scalars are reshaped to [] and
# token lists are ragged. Names, dtypes and dims stay exactly the contract's.
_UPSTREAM_ATTRS = {"input_ids": "allow_ragged_batch: true", "stop_words_list": "allow_ragged_batch: true"}
_RESHAPE_SCALAR = "reshape: { shape: [ ] }"

# The backend writes ten perf-metric outputs on EVERY response of a request that sets return_perf_metrics
# (the gate always does), without checking which outputs the config declares
# (triton_backend/inflight_batcher_llm/src/model_instance_state.cc, fillTritonResponse). Triton core rejects an
# undeclared output ("unexpected inference output", src/model.cc Model::GetOutput), and the backend then fails
# the whole response. Three of the ten are contract outputs; these are the other seven, with the dtypes and dims
# of the backend's own all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt.
PERF_OUTPUTS: tuple[Tensor, ...] = (
    Tensor("kv_cache_alloc_new_blocks", "TYPE_INT32", (1,)),
    Tensor("kv_cache_reused_blocks", "TYPE_INT32", (1,)),
    Tensor("kv_cache_alloc_total_blocks", "TYPE_INT32", (1,)),
    Tensor("arrival_time_ns", "TYPE_INT64", (1,)),
    Tensor("first_scheduled_time_ns", "TYPE_INT64", (1,)),
    Tensor("first_token_time_ns", "TYPE_INT64", (1,)),
    Tensor("last_token_time_ns", "TYPE_INT64", (1,)),
)

# backend's decoding_mode values (model_instance_state.cc): eagle | lookahead | top_k_top_p | ...
_DECODING_MODE = {"eagle": "eagle", "eagle2": "eagle", "ngram": "lookahead", "draft_model": "top_k_top_p"}


def trtllm_input_block(tensors: tuple[Tensor, ...] = ENGINE_INPUTS) -> str:
    lines = []
    for t in tensors:
        attrs = _UPSTREAM_ATTRS.get(t.name, _RESHAPE_SCALAR if t.dims == (1,) else "")
        opt = " optional: true" if t.optional else ""
        dims = ", ".join(str(d) for d in t.dims)
        lines.append(f'  {{ name: "{t.name}" data_type: {t.dtype} dims: [ {dims} ]{opt}{" " + attrs if attrs else ""} }}')
    return ",\n".join(lines)


def _params(params: dict[str, str]) -> str:
    return "\n".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())


def eagle_choices_param(choices: list[list[int]]) -> str:
    """The backend's format (docs/model_config.md): "{0, 0, 0}, {0, 1}"."""
    return ", ".join("{" + ", ".join(str(i) for i in c) + "}" for c in choices)


def engine_parameters(spec: BuildSpec, engine_dir: Path, gpu_device_ids: str, speculative: bool) -> str:
    """tensorrt_llm model parameters; names from the backend's config.pbtxt / model_instance_state.cc."""
    p = {
        "gpt_model_path": str(engine_dir),
        "gpt_model_type": "inflight_fused_batching",  # ${batching_strategy} in the upstream template
        "max_beam_width": "1",
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "batch_scheduler_policy": spec.serving.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": str(spec.serving.kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": "false",
        "enable_chunked_context": "false",  # EAGLE's TRT path does not support chunked context
        # the gate accumulates generated tokens only, as the CPU engines return them
        "exclude_input_in_output": "true",
        "gpu_device_ids": gpu_device_ids,
        # orchestrator mode (two tensorrtllm models) spawns its workers from this binary
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
    }
    if speculative:
        sp = spec.speculative
        p["decoding_mode"] = _DECODING_MODE[sp.method]
        if sp.eagle is not None and sp.eagle.eagle_choices is not None:
            p["eagle_choices"] = eagle_choices_param(sp.eagle.eagle_choices)
        if sp.method == "ngram" and sp.ngram is not None:
            p["lookahead_window_size"] = str(sp.ngram.window_size)
            p["lookahead_ngram_size"] = str(sp.ngram.ngram_size)
            p["lookahead_verification_set_size"] = str(sp.ngram.verification_set_size)
    else:
        p["decoding_mode"] = "top_k_top_p"
    return _params(p)


def render_values(spec: BuildSpec, layout: Layout, policy_path: Path) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """(values, per_model) for build.render_repository.render("trtllm", ...)."""
    values = {
        "tokenizer_dir": str(spec.tokenizer),
        "max_input_len": str(spec.max_input_len),
        "max_output_len": str(spec.max_output_len),
        "end_id": str(spec.end_id),
        "vocab_size": "",  # the gate then refuses only negative ids; tensorrtllm checks the rest
        "policy_path": str(policy_path),
        "calibration_path": "",  # the tensorrtllm engines publish no cost curve: the gate uses the policy's thresholds
        "text_instances": "2",
        "engine_max_batch_size": str(spec.max_batch_size),
        "max_queue_delay_microseconds": str(spec.serving.max_queue_delay_microseconds),
        "engine_inputs": trtllm_input_block(),
        "engine_outputs": tensor_block(ENGINE_OUTPUTS + PERF_OUTPUTS),  # no CPU-only extensions
        "engine_extensions": "false",
    }
    per_model = {
        "target_engine": {
            "trtllm_parameters": engine_parameters(spec, layout.engine("target"), spec.serving.target_gpu_device_ids, False)
        },
        "spec_engine": {
            "trtllm_parameters": engine_parameters(spec, layout.engine("spec"), spec.serving.spec_gpu_device_ids, True)
        },
    }
    return values, per_model
