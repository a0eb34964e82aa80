"""The one pinned TensorRT-LLM release and where each name used by build/trtllm comes from.

Pinned: TensorRT-LLM 1.0.0, served by `nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3` (Triton's
release compatibility matrix lists TensorRT-LLM 1.0.0 for 25.09 and 25.10; 25.10 is the newer image).
Since 1.0 the Triton backend lives in the TensorRT-LLM repository under `triton_backend/`.
"""

TRTLLM_VERSION = "1.0.0"
NGC_IMAGE = "nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3"

# The conversion scripts are examples, not part of the wheel: they come from a checkout of the pinned tag
# (`git clone -b v1.0.0 https://github.com/NVIDIA/TensorRT-LLM`), found via --trtllm-examples or
# $TRTLLM_EXAMPLES.
TRTLLM_TAG = "v1.0.0"
LLAMA_CONVERT = "models/core/llama/convert_checkpoint.py"  # the 1.0 layout (moved from examples/llama)
EAGLE_CONVERT = "eagle/convert_checkpoint.py"

# Sources (files in NVIDIA/TensorRT-LLM) for every flag and parameter name:
SOURCES = {
    "trtllm-build flags": "tensorrt_llm/commands/build.py (--speculative_decoding_mode choices: "
    "draft_tokens_external, lookahead_decoding, medusa, explicit_draft_tokens, eagle; --max_draft_len)",
    "EAGLE conversion": "examples/eagle/convert_checkpoint.py (--model_dir, --eagle_model_dir, --max_draft_len, "
    "--num_eagle_layers, --max_non_leaves_per_layer, --tp_size, --pp_size, --dtype, --output_dir)",
    "EAGLE build + limits": "examples/eagle/README.md (--speculative_decoding_mode eagle, --use_paged_context_fmha, "
    "no pipeline parallelism, choices depth == num_eagle_layers)",
    "Llama conversion": "examples/models/core/llama/convert_checkpoint.py",
    "lookahead": "examples/lookahead/README.md (--speculative_decoding_mode lookahead_decoding, max_draft_len formula)",
    "draft-target": "docs/source/advanced/speculative-decoding.md and the backend's docs/spec_decode.md "
    "(target built with --speculative_decoding_mode draft_tokens_external --max_draft_len)",
    "tensorrt_llm model": "triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt and "
    "triton_backend/inflight_batcher_llm/src/model_instance_state.cc (parameter names, decoding_mode values)",
    "contract tensor names": "triton_backend/inflight_batcher_llm/src/utils.h (InputFieldsNames, OutputFieldsNames)",
    "eagle_choices format": "triton_backend/inflight_batcher_llm/src/utils.cc (csvStrToVecVecInt)",
    "multi-model launch": "triton_backend/scripts/launch_triton_server.py (--multi-model: TRTLLM_ORCHESTRATOR=1)",
}
