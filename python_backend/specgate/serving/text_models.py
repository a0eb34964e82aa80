"""Triton adapters for `preprocessing` and `postprocessing`."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from specgate.contract import GATE_OUTPUTS, GATE_STATE_TENSOR, GateState
from specgate.serving.cancel_relay import CancelRelay
from specgate.serving.engine_key import EngineKey
from specgate.serving.parent_watch import watch_parent
from specgate.serving.triton_io import FINAL, RequestedOutputsSender, coded_error_response, error_response, optional_array, optional_scalar, tensor
from specgate.text.detokenizer import delta_text
from specgate.text.stop_words import check_stop_strings
from specgate.errors import InvalidInput
from specgate.text.tokenizer import PromptTokenizer

import triton_python_backend_utils as pb_utils

log = logging.getLogger(__name__)


def _params(args: dict[str, str]) -> dict[str, str]:
    return {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}


class PreprocessingModel:
    def initialize(self, args: dict[str, str]) -> None:
        watch_parent()
        p = _params(args)
        self.tok = PromptTokenizer(p["tokenizer_dir"], int(p["max_input_len"]))

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._one(r) for r in requests]

    def _one(self, request: Any) -> Any:
        try:
            raw = optional_scalar(request, "text_input")
            if raw is None:
                raise InvalidInput("text_input is required")
            text = self.tok.decode_utf8(raw if isinstance(raw, bytes) else str(raw).encode())
            chat = optional_scalar(request, "apply_chat_template")
            ids = self.tok.encode_prompt(text, chat=True if chat is None else bool(chat))
            stops_arr = optional_array(request, "stop")
            stops = [] if stops_arr is None else [self.tok.decode_utf8(s, "stop") for s in stops_arr.reshape(-1)]
            check_stop_strings(stops)
        except InvalidInput as exc:
            return error_response(str(exc))
        return pb_utils.InferenceResponse(
            output_tensors=[
                tensor("input_ids", ids, np.int32),
                tensor("input_lengths", [len(ids)], np.int32),
                tensor("stop_words_list", self.tok.stop_words_list(stops), np.int32),
            ]
        )


class PostprocessingModel:
    """Detokenizes each of the gate's responses and writes the gate's outputs (from its GateState)
    beside the text. It is also the one step of the `llm` ensemble that learns of a client's
    cancellation: Triton 2.51 marks the steps it schedules after one as cancelled, not the gate's
    running step, so this model passes it on to the gate (through `CancelRelay`, off this thread).
    Decoupled, so that it can swallow the gate's heartbeats, which exist only to be looked at here
    (contract.TO_POSTPROCESSING)."""

    def initialize(self, args: dict[str, str]) -> None:
        logging.basicConfig(level=logging.INFO)
        watch_parent()
        self.tok = PromptTokenizer(_params(args)["tokenizer_dir"], 1, chat=False)  # it only decodes
        self.relay = CancelRelay(EngineKey.from_env())

    def execute(self, requests: list[Any]) -> None:
        for r in requests:
            sender = RequestedOutputsSender(r)
            try:
                response = self._one(r)
            except Exception as exc:  # answer, never drop: the client waits on this response
                log.exception("postprocessing failed")
                sender.send(error_response(f"postprocessing error: {exc}", invalid_arg=False), flags=FINAL)
                continue
            if response is None:
                sender.send(flags=FINAL)
            else:
                sender.send(response, flags=FINAL)
        return None

    def _one(self, r: Any) -> Any | None:
        """The client's response to one gate response; None for a heartbeat; the gate's error if
        the gate ended the request with one (contract.GateState.error)."""
        ids = optional_array(r, "output_ids").reshape(-1).tolist()
        state = GateState.model_validate_json(optional_scalar(r, GATE_STATE_TENSOR))
        final, prev = state.is_final, state.prev_output_length
        if not final and r.is_cancelled():  # is_cancelled is an IPC: last
            self.relay.cancel(state.request_key)
        if not final and len(ids) == prev:  # a heartbeat: nothing for the client
            return None
        if final and state.error[0]:
            return coded_error_response(*state.error)
        text = delta_text(self.tok, ids, prev, final)
        decided = [tensor(t.name, [_encoded(getattr(state, t.name))], t.np_dtype) for t in GATE_OUTPUTS]
        return pb_utils.InferenceResponse(output_tensors=[tensor("text_output", [text.encode()], np.object_), *decided])


def _encoded(value: Any) -> Any:
    """A GateState value as its tensor holds it: a string as bytes."""
    return value.encode() if isinstance(value, str) else value
