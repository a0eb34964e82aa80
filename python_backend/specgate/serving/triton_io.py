"""Small helpers for reading and writing Triton Python-backend tensors (only importable in the stub)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import numpy as np
import triton_python_backend_utils as pb_utils
from pydantic import BaseModel

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

Parameters = TypeVar("Parameters", bound=BaseModel)


def model_parameters(args: dict[str, str], schema: type[Parameters]) -> Parameters:
    """The `parameters` of the model's config.pbtxt (what `initialize` gets in args["model_config"]),
    validated into `schema`: a repository rendered without one fails at load, naming it."""
    raw = json.loads(args["model_config"]).get("parameters", {})
    return schema.model_validate({k: v["string_value"] for k, v in raw.items()})


def optional_array(request: Any, name: str) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def optional_scalar(request: Any, name: str) -> Any:
    """First element of an optional input as a Python value (bytes are decoded later by the caller)."""
    arr = optional_array(request, name)
    if arr is None or arr.size == 0:
        return None
    v = arr.reshape(-1)[0]
    return v if isinstance(v, bytes) else v.item()


def request_parameters(request: Any) -> dict[str, Any]:
    raw = request.parameters()
    return json.loads(raw) if raw else {}


# Error codes by name: pb_utils' TritonError names, lower-cased (read when used: the stub defines
# TritonError after this import).
ERROR_CODES = ("invalid_arg", "internal", "unavailable", "cancelled")


def coded_error_response(code: str, message: str) -> Any:
    """The error response for one of ERROR_CODES."""
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}")
    error = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code.upper()))
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def error_response(message: str, invalid_arg: bool = True) -> Any:
    """INVALID_ARG: the client's mistake (HTTP 400); else INTERNAL, ours (HTTP 500)."""
    return coded_error_response("invalid_arg" if invalid_arg else "internal", message)


def unavailable_response(message: str) -> Any:
    """UNAVAILABLE: try again later (HTTP 503)."""
    return coded_error_response("unavailable", message)


def tensor(name: str, value: Any, dtype: Any) -> Any:
    return pb_utils.Tensor(name, np.asarray(value, dtype=dtype))


class RequestedOutputsSender:
    """A request's response sender that sends only the outputs its caller asked for.

    Why: Triton 2.51's Python backend removes an output the caller did not request from a decoupled
    response in `ResponseSender::Send` after it released the GIL, so that output's numpy array is
    freed off the GIL (fixed upstream in python_backend PR 390, Triton 24.12+). That corrupts the
    stub's heap: direct spec_gate streams asking for `output_ids` alone hung spec_gate's stub after
    32 requests, a stale repository whose ensemble did not map one gate output crashed it
    (`malloc_consolidate(): unaligned fastbin chunk detected`), and the engines' answers to control
    messages, which ask for `output_ids` alone, did the same on every answer. Dropped here, the
    unrequested tensors are freed by Python, under the GIL.
    """

    def __init__(self, request: Any) -> None:
        self.sender = request.get_response_sender()
        self.wanted = frozenset(request.requested_output_names())

    def send(self, response: Any = None, flags: int = 0) -> None:
        if response is not None and not response.has_error():
            tensors = response.output_tensors()
            kept = [t for t in tensors if t.name() in self.wanted]
            if len(kept) < len(tensors):
                response = pb_utils.InferenceResponse(output_tensors=kept)
        self.sender.send(response, flags=flags)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()
