"""The tensor contracts, in one place.

`ENGINE_INPUTS` / `ENGINE_OUTPUTS` are what `spec_gate` sends to and reads from either engine. They are
a subset of the TensorRT-LLM backend's own `tensorrt_llm` model (same names, dtypes and dims), so a
`tensorrtllm`-backend engine plugs in unchanged. `ENGINE_EXTENSIONS` are optional extras that only the
CPU reference engines produce; the gate treats them as optional.

`LLM_INPUTS` / `LLM_OUTPUTS` are the public entry point (`llm` ensemble): README's request-API table and
the llm, preprocessing and spec_gate configs are made from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel

from specgate.algorithms import EAGLE_HEAD_ALGORITHMS, SPEC_ALGORITHMS, SpecAlgorithm  # noqa: F401 (the request's algorithm values)


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # Triton config dtype, e.g. "TYPE_INT32"
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def np_dtype(self) -> str:
        return _NP[self.dtype]


_NP = {
    "TYPE_INT32": "int32",
    "TYPE_INT64": "int64",
    "TYPE_UINT64": "uint64",
    "TYPE_FP32": "float32",
    "TYPE_BOOL": "bool",
    "TYPE_STRING": "object",
}

ENGINE_INPUTS: tuple[Tensor, ...] = (
    Tensor("input_ids", "TYPE_INT32", (-1,)),
    Tensor("input_lengths", "TYPE_INT32", (1,)),
    Tensor("request_output_len", "TYPE_INT32", (1,)),
    Tensor("end_id", "TYPE_INT32", (1,), optional=True),
    Tensor("pad_id", "TYPE_INT32", (1,), optional=True),
    Tensor("stop_words_list", "TYPE_INT32", (2, -1), optional=True),
    Tensor("temperature", "TYPE_FP32", (1,), optional=True),
    Tensor("runtime_top_k", "TYPE_INT32", (1,), optional=True),
    Tensor("runtime_top_p", "TYPE_FP32", (1,), optional=True),
    Tensor("seed", "TYPE_UINT64", (1,), optional=True),  # the backend renamed random_seed to seed
    Tensor("streaming", "TYPE_BOOL", (1,), optional=True),
    Tensor("return_perf_metrics", "TYPE_BOOL", (1,), optional=True),
)

ENGINE_OUTPUTS: tuple[Tensor, ...] = (
    Tensor("output_ids", "TYPE_INT32", (-1, -1)),
    Tensor("sequence_length", "TYPE_INT32", (-1,)),
    Tensor("acceptance_rate", "TYPE_FP32", (1,)),
    Tensor("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
    Tensor("total_draft_tokens", "TYPE_INT32", (1,)),
)

# CPU-engine extras (not produced by tensorrtllm): per-request draft count and accepted tokens per
# draft position, which feed spec_decode_num_drafts_total and ..._per_pos_total; `draft_budget`, the
# budget the engine's goodput controller chose at the latest step (0: drafting does not pay here, so
# it decodes plainly; -1: no step yet or not speculative); `modelled_speedup`, what the request's steps
# bought over plain decoding on the engine's cost curve (the gate's breaker reads it); and `handed_over`,
# set on the final response of a speculative request that stopped early because the gate asked
# spec_engine to hand its requests over to the batched baseline (PARAM_HAND_OVER).
ENGINE_EXTENSIONS: tuple[Tensor, ...] = (
    Tensor("num_drafts", "TYPE_INT32", (1,)),
    Tensor("accepted_per_position", "TYPE_INT32", (-1,)),
    Tensor("draft_budget", "TYPE_INT32", (1,)),
    Tensor("modelled_speedup", "TYPE_FP32", (1,)),  # SpecStats.modelled_speedup; 0: none
    Tensor("handed_over", "TYPE_BOOL", (1,)),
)

def engine_inputs(
    ids: list[int],
    max_tokens: int,
    end_id: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    streaming: bool = True,
    stop_words: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """One engine request as named arrays (batch of 1) in the contract's dtypes; callers wrap them
    as `pb_utils.Tensor` (the gate, over BLS) or `InferInput` (benchmarks and smoke tests)."""
    values: dict[str, object] = {
        "input_ids": [ids],
        "input_lengths": [[len(ids)]],
        "request_output_len": [[max_tokens]],
        "end_id": [[end_id]],
        "pad_id": [[end_id]],
        "temperature": [[temperature]],
        "runtime_top_k": [[top_k]],
        "runtime_top_p": [[top_p]],
        "streaming": [[streaming]],
        "return_perf_metrics": [[True]],
    }
    if seed is not None:
        values["seed"] = [[seed & (2**64 - 1)]]
    if stop_words is not None:
        values["stop_words_list"] = stop_words.reshape(1, 2, -1)
    dtypes = {t.name: t.np_dtype for t in ENGINE_INPUTS}
    return {name: np.asarray(v, dtype=dtypes[name]) for name, v in values.items()}


# Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`, the same value). Dividing logits by a
# tiny positive temperature overflows float32, the softmax becomes NaN and sampling fails; the gate's
# request model and the engines' SamplingParams both read this one constant.
SAMPLING_EPS = 1e-5

# Per-request speculative knobs travel to spec_engine as request *parameters*, not tensors, so the
# tensor contract stays the TensorRT-LLM one (which fixes the algorithm at engine build time).
PARAM_ALGORITHM = "speculative_algorithm"
# Its values, their k limits and defaults: specgate.algorithms.
PARAM_NUM_SPEC_TOKENS = "num_speculative_tokens"
# How many of input_ids' last tokens are output the client already has (CPU engines): the gate
# continues a request on the other engine from prompt + output, and a stop word may span the two.
PARAM_CONTINUED = "specgate_continued"
# A request carrying this parameter is a control message, not a generation: spec_engine ends every
# request submitted before it at the next step, with `handed_over` set, and answers at once.
PARAM_HAND_OVER = "specgate_hand_over"
# Control message for spec_engine: measure the machine again (value "" or true), or pin some
# measurements (a JSON specgate.cost_model.calibration.CalibrationOverride); answered once it is in force.
PARAM_CALIBRATE = "specgate_calibrate"
# spec_engine's gauge of its measured verification cost curve, label `tokens`.
VERIFY_COST_METRIC = "spec_decode_verification_cost_seconds"

# Cancellation and liveness, CPU engines only (docs/robustness.md). Triton 2.51 cannot cancel a BLS
# request (the gate learns of its own client's cancellation through GATE_TICK, below), so:
# - the gate tags each engine request with a random key, in this parameter;
PARAM_REQUEST_KEY = "specgate_request_key"
# - a control message with this parameter set to a key stops that request at the engine's next step;
PARAM_CANCEL = "specgate_cancel"
# - a live engine answers a control message with this parameter at once: the gate sends one when an
#   engine request has been silent a while, to tell a slow engine from a dead process.
PARAM_PING = "specgate_ping"
# The engine control channel's secret (specgate.serving.engine_key): every request to an engine model,
# generation or control message, carries it in this parameter; an engine refuses any that does not,
# so only the server's own gate can steer the engines.
PARAM_ENGINE_KEY = "specgate_engine_key"
# Each engine's series, label `model`: requests accepted and not finished; tokens in its KV cache
# when the latest request ended (0 when idle); tokens generated; requests stopped by a cancellation.
ENGINE_ACTIVE_METRIC = "specgate_engine_active_requests"
ENGINE_KV_METRIC = "specgate_engine_kv_cache_tokens"
ENGINE_TOKENS_METRIC = "specgate_engine_generated_tokens_total"
ENGINE_CANCELLED_METRIC = "specgate_engine_cancelled_total"
# ... and its streaming (cost_model/stream_pacer.py): the interval it streams at, and what one streamed
# response was measured to cost its decode (absent until measured, and with a fixed interval).
ENGINE_STREAM_INTERVAL_METRIC = "specgate_engine_stream_interval_seconds"
ENGINE_RESPONSE_COST_METRIC = "specgate_engine_response_cost_seconds"


# Stop strings are matched at every new token of every sequence, on the batch's one decode thread:
# about 100k short ones added ~5 ms to every batched sequence's step (issue 49). OpenAI allows 4.
MAX_STOP_WORDS = 16
MAX_STOP_BYTES = 256  # one stop string, UTF-8
MAX_STOP_TOKENS = MAX_STOP_BYTES  # one stop sequence as token ids: a token holds at least a byte


@dataclass(frozen=True)
class ApiTensor(Tensor):
    """An input or output of the `llm` entry point: the model that reads it in the ensemble (every
    output is spec_gate's), and what it means to a client (README's request-API table is made from
    these)."""

    step: str = "spec_gate"  # preprocessing | spec_gate
    meaning: str = ""


LLM_INPUTS: tuple[ApiTensor, ...] = (
    # Optional in the ensemble only so that a request without it reaches preprocessing and gets a
    # clear INVALID_ARG ("text_input is required"); Triton 2.51 would otherwise drop such a gRPC
    # stream request without an answer.
    ApiTensor("text_input", "TYPE_STRING", (1,), True, "preprocessing", "the prompt (UTF-8), required"),
    ApiTensor("max_tokens", "TYPE_INT32", (1,), True, meaning="new tokens at most; default 128, 1..max_output_len (1024)"),
    ApiTensor("temperature", "TYPE_FP32", (1,), True, meaning="0 (or below 1e-5) = greedy; >= 0"),
    ApiTensor("top_p", "TYPE_FP32", (1,), True, meaning="nucleus mass, (0, 1]; 1 = off"),
    ApiTensor("top_k", "TYPE_INT32", (1,), True, meaning="0 = off"),
    ApiTensor("seed", "TYPE_INT64", (1,), True, meaning="sampling seed; none = random"),
    ApiTensor("stream", "TYPE_BOOL", (1,), True, meaning="a response per new text (true) or one at the end"),
    ApiTensor("stop", "TYPE_STRING", (-1,), True, "preprocessing",
              "stop strings, at most 16 of at most 256 bytes each; the matched one is included in the output"),
    ApiTensor("apply_chat_template", "TYPE_BOOL", (1,), True, "preprocessing", "default true; false sends the prompt as raw text"),
    ApiTensor("use_speculative_decoding", "TYPE_BOOL", (1,), True, meaning="true = prod, false = off (a request override: allow_override)"),
    ApiTensor("speculative_algorithm", "TYPE_STRING", (1,), True,
              meaning="eagle, eagle2, hybrid, draft_model or ngram; default: the policy's (auto)"),
    ApiTensor("num_speculative_tokens", "TYPE_INT32", (1,), True,
              meaning="the most draft nodes per step, 1..the algorithm's max; default: the algorithm's"),
)

LLM_OUTPUTS: tuple[ApiTensor, ...] = (
    ApiTensor("text_output", "TYPE_STRING", (-1,), meaning="the new text of this response"),
    ApiTensor("route", "TYPE_STRING", (1,), meaning="speculative or baseline"),
    ApiTensor("gate_reason", "TYPE_STRING", (1,), meaning="why (docs/gate.md, reason codes)"),
    ApiTensor("num_draft_tokens", "TYPE_INT32", (1,), meaning="draft nodes verified so far"),
    ApiTensor("num_accepted_tokens", "TYPE_INT32", (1,), meaning="of which accepted"),
    ApiTensor("acceptance_rate", "TYPE_FP32", (1,), meaning="accepted / drafted"),
    ApiTensor("num_output_tokens", "TYPE_INT32", (1,), meaning="tokens generated so far (for tokens/s and TPOT)"),
    ApiTensor("draft_budget", "TYPE_INT32", (1,),
              meaning="spec_engine's per-step draft budget now; 0 = decoding plainly (drafting does not pay here); -1 on baseline"),
)

# What preprocessing hands spec_gate (ensemble internals). Optional as spec_gate's inputs: its serving
# step (GATE_TICK) maps none of them; the gate refuses a request without a prompt itself.
PREPROCESSED: tuple[Tensor, ...] = (
    Tensor("input_ids", "TYPE_INT32", (-1,), optional=True),
    Tensor("input_lengths", "TYPE_INT32", (1,), optional=True),
    Tensor("stop_words_list", "TYPE_INT32", (2, -1), optional=True),
)
# spec_gate runs in two steps of the `llm` ensemble, both in its one process (docs/request-flow.md).
# The intake step reads the request and answers with this tensor, [request key, n]: n = 0 schedules the
# serving step, whose responses are the client's; then, while the request lives, n = 1, 2, ... schedule
# one short step each (a tick) and nothing else. Why: Triton 2.51 tells a running ensemble step nothing
# of its client's cancellation, but marks every step it schedules after one as cancelled, so a tick
# finds out whether the client is still there. The ticks cost the gate a step every so often, not one
# per streamed response (a step after the gate would see every response, and each costs a round trip
# through the Python backend: docs/engines.md, "Streaming").
GATE_TICK = Tensor("gate_tick", "TYPE_INT64", (2,), optional=True)


class GateDecision(BaseModel):
    """The `llm` outputs beside `text_output`, as values: what the gate decided and counted."""

    route: str
    gate_reason: str
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float
    num_output_tokens: int
    draft_budget: int


def api_table() -> str:
    """README's request-API table, from the contract (a test checks README holds exactly this)."""
    rows = ["| | name | type | meaning |", "|---|---|---|---|"]
    rows += [f"| input | `{t.name}` | {t.dtype.removeprefix('TYPE_')}{'[]' if t.dims == (-1,) else ''} | {t.meaning} |" for t in LLM_INPUTS]
    rows += [f"| output | `{t.name}` | {t.dtype.removeprefix('TYPE_')} | {t.meaning} |" for t in LLM_OUTPUTS]
    return "\n".join(rows)


# Request parameters that Triton fills from headers (gRPC) or body fields (HTTP generate).
HEADER_API_KEY = "x-api-key"
HEADER_SPEC_MODE = "x-speculative-decoding"
