"""A stand-in for `triton_python_backend_utils`, which exists only inside a Python-backend stub (the
file the wheel ships holds none of Tensor, InferenceRequest, ...). Enough of it for the serving
modules' own logic to run in a unit test: tensors, responses, errors, and BLS requests whose `exec`
calls the test's `handler`.

`install()` puts it in sys.modules before a serving module is imported.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    pass


class Tensor:
    def __init__(self, name: str, array: Any) -> None:
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor], error: TritonError | None = None) -> None:
        self._tensors, self._error = output_tensors, error

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class ResponseSender:
    """A request's response sender that records what is sent (the real one has no constructor)."""

    def __init__(self) -> None:
        self.sent: list[tuple[InferenceResponse | None, int]] = []

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return False


class InferenceRequest:
    """A BLS request: `exec` returns `handler(self)` (an iterator of responses) for the class-wide
    handler a test sets."""

    handler: Callable[["InferenceRequest"], Any] | None = None

    def __init__(self, model_name: str, inputs: list[Tensor], requested_output_names: list[str], parameters: dict | None = None) -> None:
        self.model_name, self.inputs, self.parameters = model_name, inputs, dict(parameters or {})

    def exec(self, decoupled: bool = False) -> Any:  # noqa: A003 (pb_utils' name)
        assert InferenceRequest.handler is not None, "the test set no handler"
        return InferenceRequest.handler(self)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_tensor_by_name(request: Any, name: str) -> Tensor | None:
    return next((t for t in request.inputs if t.name() == name), None)


def install() -> types.ModuleType:
    """This module as `triton_python_backend_utils` (unless a real one is there)."""
    return sys.modules.setdefault("triton_python_backend_utils", sys.modules[__name__])
