"""Triton adapters for `preprocessing` and `postprocessing`."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from specgate.contract import PARAM_CANCEL, REQUEST_KEY_TENSOR
from specgate.serving.bls import KEEPALIVE
from specgate.serving.cpu_priority import yield_to_engines
from specgate.serving.triton_io import error_response, optional_array, optional_scalar, tensor
from specgate.text.detokenizer import delta_text
from specgate.errors import InvalidInput
from specgate.text.tokenizer import PromptTokenizer

import triton_python_backend_utils as pb_utils

log = logging.getLogger(__name__)


def _params(args: dict[str, str]) -> dict[str, str]:
    return {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}


class PreprocessingModel:
    def initialize(self, args: dict[str, str]) -> None:
        yield_to_engines()
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
    """Detokenizes each of the gate's responses. It is also the one step of the `llm` ensemble that
    learns of a client's cancellation: Triton 2.51 marks the steps it schedules after one as
    cancelled, not the gate's running step, so this model passes it on (`_cancel_gate`)."""

    def initialize(self, args: dict[str, str]) -> None:
        logging.basicConfig(level=logging.INFO)
        yield_to_engines()
        self.tok = PromptTokenizer(_params(args)["tokenizer_dir"], 1).tok

    def execute(self, requests: list[Any]) -> list[Any]:
        out = []
        for r in requests:
            ids = [int(i) for i in optional_array(r, "output_ids").reshape(-1)]
            prev = int(optional_scalar(r, "prev_output_length"))
            final = bool(optional_scalar(r, "is_final"))
            key = optional_scalar(r, REQUEST_KEY_TENSOR)
            if key is not None and not final and r.is_cancelled():  # is_cancelled is an IPC: last
                self._cancel_gate(key)
            text = delta_text(self.tok, ids, prev, final)
            out.append(pb_utils.InferenceResponse(output_tensors=[tensor("text_output", [text.encode()], np.object_)]))
        return out

    @staticmethod
    def _cancel_gate(key: int) -> None:
        """Tell spec_gate that the client of its request `key` cancelled (GateModel._cancel)."""
        ids = pb_utils.Tensor("input_ids", np.zeros(1, np.int32))
        lengths = pb_utils.Tensor("input_lengths", np.ones(1, np.int32))
        req = pb_utils.InferenceRequest(
            model_name="spec_gate", inputs=[ids, lengths], requested_output_names=["output_ids"], parameters={PARAM_CANCEL: str(key)}
        )
        it = None
        try:
            it = req.exec(decoupled=True)
            for resp in it:
                if resp.has_error():
                    log.warning("spec_gate refused a cancellation: %s", resp.error().message())
        except Exception as exc:  # the request then runs to its end
            log.warning("could not pass a cancellation on to spec_gate: %s", exc)
        finally:
            KEEPALIVE.hold(req, it)
