"""Triton adapters for `preprocessing` and `postprocessing`."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from specgate.serving.triton_io import error_response, optional_array, optional_scalar, tensor
from specgate.text.detokenizer import delta_text
from specgate.errors import InvalidInput
from specgate.text.tokenizer import PromptTokenizer

import triton_python_backend_utils as pb_utils


def _params(args: dict[str, str]) -> dict[str, str]:
    return {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}


class PreprocessingModel:
    def initialize(self, args: dict[str, str]) -> None:
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
            stops = [] if stops_arr is None else [self.tok.decode_utf8(s) for s in stops_arr.reshape(-1)]
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
    def initialize(self, args: dict[str, str]) -> None:
        self.tok = PromptTokenizer(_params(args)["tokenizer_dir"], 1).tok

    def execute(self, requests: list[Any]) -> list[Any]:
        out = []
        for r in requests:
            ids = [int(i) for i in optional_array(r, "output_ids").reshape(-1)]
            prev = int(optional_scalar(r, "prev_output_length"))
            final = bool(optional_scalar(r, "is_final"))
            text = delta_text(self.tok, ids, prev, final)
            out.append(pb_utils.InferenceResponse(output_tensors=[tensor("text_output", [text.encode()], np.object_)]))
        return out
