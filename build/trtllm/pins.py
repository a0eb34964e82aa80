"""The one pinned TensorRT-LLM release, and where each name used by build/trtllm comes from.

Pinned: TensorRT-LLM 1.0.0, served by `nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3` (Triton's
release compatibility matrix lists TensorRT-LLM 1.0.0 for 25.09 and 25.10; 25.10 is the newer image).
Since 1.0 the Triton backend lives in the TensorRT-LLM repository under `triton_backend/`.

Sources (files of NVIDIA/TensorRT-LLM; docs/trtllm.md has the full table):
- trtllm-build flags: tensorrt_llm/commands/build.py (--speculative_decoding_mode choices
  draft_tokens_external, lookahead_decoding, medusa, explicit_draft_tokens, eagle; --max_draft_len)
- EAGLE conversion + limits: examples/eagle/convert_checkpoint.py, examples/eagle/README.md
- Llama conversion: examples/models/core/llama/convert_checkpoint.py
- lookahead: examples/lookahead/README.md; draft-target: docs/source/advanced/speculative-decoding.md
- tensorrt_llm model parameters: triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt,
  triton_backend/inflight_batcher_llm/src/model_instance_state.cc, model_state.cc
- contract tensor names: triton_backend/inflight_batcher_llm/src/utils.h (InputFieldsNames, OutputFieldsNames)
- multi-model launch: triton_backend/scripts/launch_triton_server.py (--multi-model)
"""

TRTLLM_VERSION = "1.0.0"
NGC_IMAGE = "nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3"

# The conversion scripts are examples, not part of the wheel: they come from a checkout of the pinned tag
# (`git clone -b v1.0.0 https://github.com/NVIDIA/TensorRT-LLM`), found via --trtllm-examples or
# $TRTLLM_EXAMPLES.
TRTLLM_TAG = "v1.0.0"
LLAMA_CONVERT = "models/core/llama/convert_checkpoint.py"  # the 1.0 layout (moved from examples/llama)
EAGLE_CONVERT = "eagle/convert_checkpoint.py"
