"""Triton adapter for `spec_gate`: decide the route, forward over BLS, stream back, record metrics.

Every request is served on a worker thread so the decoupled `execute` returns at once and many
requests stream concurrently.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from specgate.contract import HEADER_API_KEY, HEADER_SPEC_MODE, PARAM_ALGORITHM, PARAM_NUM_SPEC_TOKENS
from specgate.engine.request import SpecStats
from specgate.llm_request import LLMRequest, parse_llm_request
from specgate.serving.triton_io import FINAL, error_response, optional_array, optional_scalar, request_parameters, tensor
from specgate.text.tokenizer import InvalidInput

import triton_python_backend_utils as pb_utils

log = logging.getLogger(__name__)

ENGINE_OUTPUT_NAMES = [
    "output_ids",
    "sequence_length",
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
]
_LLM_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "use_speculative_decoding", "num_speculative_tokens")


def _out(resp: Any, name: str) -> np.ndarray | None:
    t = pb_utils.get_output_tensor_by_name(resp, name)
    return None if t is None else t.as_numpy()


class GateModel:
    def initialize(self, args: dict[str, str]) -> None:
        logging.basicConfig(level=logging.INFO)
        p = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.max_output_len = int(p["max_output_len"])
        self.end_id = int(p["end_id"])
        self.pool = ThreadPoolExecutor(max_workers=128, thread_name_prefix="gate")

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                llm = self._parse(request)
            except InvalidInput as exc:
                sender.send(error_response(str(exc)), flags=FINAL)
                continue
            self.pool.submit(self._serve, request, sender, llm)
        return None

    def _parse(self, request: Any) -> LLMRequest:
        fields = {name: optional_scalar(request, name) for name in _LLM_FIELDS}
        alg = optional_scalar(request, "speculative_algorithm")
        fields["speculative_algorithm"] = alg.decode(errors="replace") if isinstance(alg, bytes) else alg
        params = request_parameters(request)
        fields["api_key"] = params.get(HEADER_API_KEY)
        fields["spec_header"] = params.get(HEADER_SPEC_MODE)
        fields["request_id"] = request.request_id() or ""
        return parse_llm_request(fields, self.max_output_len)

    # -- serving ---------------------------------------------------------------------------------
    def _serve(self, request: Any, sender: Any, llm: LLMRequest) -> None:
        try:
            route, reason = "baseline", "passthrough"
            engine = "target_engine" if route == "baseline" else "spec_engine"
            self._forward(request, sender, llm, engine, route, reason)
        except Exception as exc:  # never leave a client without a final response
            log.exception("gate failed")
            sender.send(error_response(f"gate error: {exc}", invalid_arg=False), flags=FINAL)

    def _engine_request(self, request: Any, llm: LLMRequest, engine: str) -> Any:
        ids = optional_array(request, "input_ids").reshape(1, -1).astype(np.int32)
        inputs = [
            tensor("input_ids", ids, np.int32),
            tensor("input_lengths", [[ids.shape[1]]], np.int32),
            tensor("request_output_len", [[llm.max_tokens]], np.int32),
            tensor("end_id", [[self.end_id]], np.int32),
            tensor("pad_id", [[self.end_id]], np.int32),
            tensor("temperature", [[llm.temperature]], np.float32),
            tensor("runtime_top_k", [[llm.top_k]], np.int32),
            tensor("runtime_top_p", [[llm.top_p]], np.float32),
            tensor("streaming", [[llm.stream]], np.bool_),
            tensor("return_perf_metrics", [[True]], np.bool_),
        ]
        if llm.seed is not None:
            inputs.append(tensor("random_seed", [[llm.seed & (2**64 - 1)]], np.uint64))
        stops = optional_array(request, "stop_words_list")
        if stops is not None and stops.size and (stops[1] >= 0).any():
            inputs.append(tensor("stop_words_list", stops.reshape(1, 2, -1), np.int32))
        params = {}
        if llm.speculative_algorithm:
            params[PARAM_ALGORITHM] = llm.speculative_algorithm
        if llm.num_speculative_tokens is not None:
            params[PARAM_NUM_SPEC_TOKENS] = int(llm.num_speculative_tokens)
        return pb_utils.InferenceRequest(
            model_name=engine,
            inputs=inputs,
            requested_output_names=ENGINE_OUTPUT_NAMES,
            parameters=params,
        )

    def _forward(self, request: Any, sender: Any, llm: LLMRequest, engine: str, route: str, reason: str) -> SpecStats:
        """Stream one engine's responses to the client; returns the request's final statistics."""
        ids: list[int] = []
        prev = 0
        stats = SpecStats()
        for resp in self._engine_request(request, llm, engine).exec(decoupled=True):
            if resp.has_error():
                sender.send(error_response(resp.error().message(), invalid_arg=False), flags=FINAL)
                return stats
            out = _out(resp, "output_ids")
            if out is None:  # the flag-only final response
                continue
            ids += [int(t) for t in out.reshape(-1)]
            stats = SpecStats(
                draft_tokens=int(_out(resp, "total_draft_tokens").reshape(-1)[0]),
                accepted_tokens=int(_out(resp, "total_accepted_draft_tokens").reshape(-1)[0]),
            )
            if llm.stream and len(ids) > prev:
                sender.send(self._response(ids, prev, False, route, reason, stats))
                prev = len(ids)
        sender.send(self._response(ids, prev, True, route, reason, stats), flags=FINAL)
        return stats

    @staticmethod
    def _response(ids: list[int], prev: int, final: bool, route: str, reason: str, s: SpecStats) -> Any:
        return pb_utils.InferenceResponse(
            output_tensors=[
                tensor("output_ids", ids, np.int32),
                tensor("prev_output_length", [prev], np.int32),
                tensor("is_final", [final], np.bool_),
                tensor("route", [route.encode()], np.object_),
                tensor("gate_reason", [reason.encode()], np.object_),
                tensor("num_draft_tokens", [s.draft_tokens], np.int32),
                tensor("num_accepted_tokens", [s.accepted_tokens], np.int32),
                tensor("acceptance_rate", [s.acceptance_rate], np.float32),
                tensor("num_output_tokens", [len(ids)], np.int32),
            ]
        )
