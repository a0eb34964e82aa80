"""Triton adapter for `preprocessing`: chat template, tokenization, stop strings as token ids."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from pydantic import BaseModel

from specgate.errors import InvalidInput
from specgate.serving.parent_watch import watch_parent
from specgate.serving.triton_io import error_response, model_parameters, optional_array, optional_scalar, tensor
from specgate.text.stop_words import check_stop_strings
from specgate.text.tokenizer import PromptTokenizer


class PreprocessingParameters(BaseModel):
    """preprocessing's config.pbtxt parameters."""

    tokenizer_dir: str
    max_input_len: int


class PreprocessingModel:
    def initialize(self, args: dict[str, str]) -> None:
        watch_parent()
        p = model_parameters(args, PreprocessingParameters)
        self.tok = PromptTokenizer(p.tokenizer_dir, p.max_input_len)

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
