"""Triton adapter for the CPU engines: engine-contract tensors in, decoupled responses out.

Like the tensorrtllm backend: with `streaming` true each step's new tokens go out as they are made;
otherwise exactly one response holds the whole output (HTTP `generate` needs exactly one).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from specgate.contract import PARAM_ALGORITHM, PARAM_HAND_OVER, PARAM_NUM_SPEC_TOKENS
from specgate.engine.config import EngineConfig
from specgate.engine.model import Llama, load_llama
from specgate.engine.request import Event, GenerationRequest
from specgate.engine.sampling import SamplingParams
from specgate.stats import SpecStats
from specgate.serving.triton_io import FINAL, error_response, optional_array, optional_scalar, request_parameters, tensor
from specgate.errors import InvalidInput
from specgate.text.tokenizer import parse_stop_words_list

import triton_python_backend_utils as pb_utils

log = logging.getLogger(__name__)


def parse_engine_request(request: Any, cfg: EngineConfig) -> tuple[GenerationRequest, bool]:
    """Contract tensors -> GenerationRequest (+ streaming flag). Raises InvalidInput."""
    ids = optional_array(request, "input_ids")
    if ids is None or ids.size == 0:
        raise InvalidInput("input_ids is empty")
    out_len = optional_scalar(request, "request_output_len")
    if out_len is None or not 1 <= int(out_len) <= cfg.max_output_len:
        raise InvalidInput(f"request_output_len must be between 1 and {cfg.max_output_len}, got {out_len}")
    stops = optional_array(request, "stop_words_list")
    temperature = optional_scalar(request, "temperature")
    top_k = optional_scalar(request, "runtime_top_k")
    top_p = optional_scalar(request, "runtime_top_p")
    seed = optional_scalar(request, "seed")
    try:
        sampling = SamplingParams(
            temperature=0.0 if temperature is None else float(temperature),
            top_k=0 if top_k is None else int(top_k),
            top_p=1.0 if top_p is None else float(top_p),
            seed=None if seed is None else int(seed),
        )
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    end_id = optional_scalar(request, "end_id")
    req = GenerationRequest(
        input_ids=[int(i) for i in ids.reshape(-1)],
        max_new_tokens=int(out_len),
        end_id=None if end_id is None else int(end_id),
        stop_words=[] if stops is None else parse_stop_words_list(stops),
        sampling=sampling,
    )
    return req, bool(optional_scalar(request, "streaming") or False)


class ResponseStream:
    """Turns engine Events into Triton responses for one request (called from the engine thread)."""

    def __init__(self, sender: Any, streaming: bool) -> None:
        self.sender, self.streaming = sender, streaming
        self.tokens: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, ev: Event) -> None:
        with self.lock:
            if ev.error is not None:
                self.sender.send(error_response(ev.error, invalid_arg=False), flags=FINAL)
                return
            self.tokens += ev.tokens
            if self.streaming:
                self.sender.send(self._response(ev.tokens, ev), flags=FINAL if ev.finished else 0)
            elif ev.finished:
                self.sender.send(self._response(self.tokens, ev), flags=FINAL)

    def _response(self, tokens: list[int], ev: Event) -> Any:
        s = ev.stats or SpecStats()
        return pb_utils.InferenceResponse(
            output_tensors=[
                tensor("output_ids", [[tokens]], np.int32),
                tensor("sequence_length", [[len(self.tokens)]], np.int32),
                tensor("acceptance_rate", [[s.acceptance_rate]], np.float32),
                tensor("total_accepted_draft_tokens", [[s.accepted_tokens]], np.int32),
                tensor("total_draft_tokens", [[s.draft_tokens]], np.int32),
                tensor("num_drafts", [[s.num_drafts]], np.int32),
                tensor("accepted_per_position", [s.accepted_per_position or [0]], np.int32),
                tensor("handed_over", [[ev.handed_over]], np.bool_),
            ]
        )


class EngineModel:
    """Base adapter; subclasses choose the runner that owns the model."""

    def initialize(self, args: dict[str, str]) -> None:
        logging.basicConfig(level=logging.INFO)
        params = json.loads(args["model_config"])["parameters"]
        self.cfg = EngineConfig.load(params["engine_config"]["string_value"])
        if self.cfg.num_threads:
            torch.set_num_threads(self.cfg.num_threads)
        model = load_llama(Path(self.cfg.checkpoint_dir), self.cfg.torch_dtype, self.cfg.max_context)
        self.runner = self.make_runner(model, self.cfg)
        log.info("%s ready: dtype=%s max_batch=%d", args["model_name"], self.cfg.dtype, self.cfg.max_batch_size)

    def make_runner(self, model: Llama, cfg: EngineConfig) -> Any:
        raise NotImplementedError

    def submit(self, req: GenerationRequest, emit: Callable[[Event], None], is_cancelled: Callable[[], bool], params: dict) -> None:
        self.runner.submit(req, emit, is_cancelled)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                req, streaming = parse_engine_request(request, self.cfg)
                self.submit(req, ResponseStream(sender, streaming), sender.is_cancelled, request_parameters(request))
            except (InvalidInput, ValueError) as exc:
                sender.send(error_response(str(exc)), flags=FINAL)
            except Exception as exc:  # QueueFull and anything unexpected: answer, never drop
                log.exception("could not queue request")
                sender.send(error_response(str(exc), invalid_arg=False), flags=FINAL)
        return None

    def finalize(self) -> None:
        self.runner.shutdown()


class BaselineEngineModel(EngineModel):
    def make_runner(self, model: Llama, cfg: EngineConfig) -> Any:
        from specgate.engine.runner import BatchRunner

        return BatchRunner(model, cfg)


class SpeculativeEngineModel(EngineModel):
    def make_runner(self, model: Llama, cfg: EngineConfig) -> Any:
        from specgate.speculative.runner import SpeculativeRunner

        return SpeculativeRunner(model, cfg)

    def submit(self, req: GenerationRequest, emit: Callable[[Event], None], is_cancelled: Callable[[], bool], params: dict) -> None:
        if params.get(PARAM_HAND_OVER):  # the gate's control message, not a generation
            self.runner.hand_over_all()
            emit(Event([], finished=True))
            return
        k = params.get(PARAM_NUM_SPEC_TOKENS)
        self.runner.submit(req, emit, is_cancelled, params.get(PARAM_ALGORITHM), None if k is None else int(k))
