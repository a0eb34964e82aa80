"""Client for the `llm` entry point over HTTP generate / generate_stream and gRPC streaming.

Used by the CLI (`clients/generate.py`), the tests, the benchmarks and the load tests, so every caller
speaks to the server the same way. gRPC goes through `tritonclient`. tritonclient has no support for
Triton's HTTP generate extension, so that path is a small `requests` + SSE reader written here.

Headers: gRPC sends `x-api-key` / `x-speculative-decoding` as real headers (forwarded by
`--grpc-header-forward-pattern`). Triton 2.51 does not forward headers on HTTP generate, so there
they travel as body fields of the same name, which Triton turns into request parameters.
"""

from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import requests

from specgate.contract import LLM_INPUTS, LLM_OUTPUTS

META = tuple(t.name for t in LLM_OUTPUTS if t.name != "text_output")  # per-request metadata of every response


class ServerError(RuntimeError):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ServerUnreachable(ServerError):
    """Nothing answers at `address`: the server is not started, still loading, or on another port."""

    def __init__(self, address: str, cause: str) -> None:
        super().__init__(f"cannot reach {address}: {cause}")
        self.address = address


@dataclass
class Chunk:
    text: str
    meta: dict[str, Any]
    t: float  # seconds since the request was sent


@dataclass
class Result:
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def meta(self) -> dict[str, Any]:
        return self.chunks[-1].meta if self.chunks else {}

    @property
    def ttft(self) -> float:
        return next((c.t for c in self.chunks if c.text), float("nan"))


@dataclass
class GenerateParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    apply_chat_template: bool = True
    use_speculative_decoding: bool | None = None
    speculative_algorithm: str | None = None
    num_speculative_tokens: int | None = None

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def gate_headers(api_key: str | None, spec_mode: str | None) -> dict[str, str]:
    """The gate's headers (gRPC) or body fields (HTTP generate) for a tenant key and a mode."""
    h = {}
    if api_key is not None:
        h["x-api-key"] = api_key
    if spec_mode is not None:
        h["x-speculative-decoding"] = spec_mode
    return h


def grpc_inputs(prompt: str | bytes, p: GenerateParams, stream: bool) -> list[Any]:
    """The `llm` request as tritonclient gRPC inputs, one per input it sets, typed as specgate.contract
    declares it (the same class serves the sync and asyncio clients)."""
    import tritonclient.grpc as grpcclient

    values = {**p.fields(), "text_input": prompt if isinstance(prompt, bytes) else prompt.encode(), "stream": stream}
    inputs = []
    for t in LLM_INPUTS:
        value = values.get(t.name)
        if value is None or value == []:
            continue
        items = value if t.dims == (-1,) else [value]
        if np.issubdtype(t.np_dtype, np.integer) and not all(np.iinfo(t.np_dtype).min <= v <= np.iinfo(t.np_dtype).max for v in items):
            # numpy 1.x would wrap it (max_tokens 2**32 + 1 became 1), numpy 2 raise OverflowError
            raise ValueError(f"{t.name}: {value} does not fit its type ({t.dtype.removeprefix('TYPE_')})")
        arr = np.array([v.encode() if isinstance(v, str) else v for v in items], dtype=t.np_dtype)
        inp = grpcclient.InferInput(t.name, list(arr.shape), t.dtype.removeprefix("TYPE_").replace("STRING", "BYTES"))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


def result_chunk(result: Any, t: float) -> Chunk:
    """One tritonclient gRPC result of `llm` (with outputs) as a Chunk: its text delta and the gate's `META`."""
    out = result.as_numpy("text_output")
    return Chunk(b"".join(out.reshape(-1)).decode(), {k: _scalar(result.as_numpy(k)) for k in META}, t)


class HttpClient:
    def __init__(self, url: str = "localhost:8000", model: str = "llm", timeout_s: float = 600) -> None:
        self.base = url if url.startswith("http") else f"http://{url}"
        self.model, self.timeout_s = model, timeout_s
        self.session = requests.Session()

    def close(self) -> None:
        """Close the pooled keep-alive connections: a stopping tritonserver waits for open HTTP
        connections (up to its exit timeout) before it drains and unloads its models."""
        self.session.close()

    def _body(self, prompt: str, p: GenerateParams, stream: bool, api_key: str | None, spec_mode: str | None) -> dict:
        return {"text_input": prompt, "stream": stream, **p.fields(), **gate_headers(api_key, spec_mode)}

    def _post(self, endpoint: str, body: dict, stream: bool = False) -> requests.Response:
        try:
            return self.session.post(f"{self.base}/v2/models/{self.model}/{endpoint}", json=body, stream=stream, timeout=self.timeout_s)
        except requests.ConnectionError as exc:
            raise ServerUnreachable(self.base, _root_cause(exc)) from None

    def generate(self, prompt: str, p: GenerateParams, api_key: str | None = None, spec_mode: str | None = None) -> Result:
        t0 = time.perf_counter()
        r = self._post("generate", self._body(prompt, p, False, api_key, spec_mode))
        if r.status_code != 200:
            raise ServerError(_error_text(r.text), r.status_code)
        d = r.json()
        return Result([Chunk(_as_text(d["text_output"]), {k: _scalar(d.get(k)) for k in META}, time.perf_counter() - t0)])

    def stream(self, prompt: str, p: GenerateParams, api_key: str | None = None, spec_mode: str | None = None) -> Iterator[Chunk]:
        t0 = time.perf_counter()
        with self._post("generate_stream", self._body(prompt, p, True, api_key, spec_mode), stream=True) as r:
            for line in r.iter_lines(decode_unicode=False):
                if not line.startswith(b"data:"):
                    continue
                d = json.loads(line[5:])
                if "error" in d:
                    raise ServerError(d["error"], r.status_code)
                yield Chunk(_as_text(d["text_output"]), {k: _scalar(d.get(k)) for k in META}, time.perf_counter() - t0)
            if r.status_code != 200:
                raise ServerError(f"HTTP {r.status_code}", r.status_code)


class GrpcClient:
    def __init__(self, url: str = "localhost:8001", model: str = "llm", timeout_s: float = 600) -> None:
        self.url, self.model, self.timeout_s = url, model, timeout_s

    def stream(
        self,
        prompt: str | bytes,
        p: GenerateParams,
        api_key: str | None = None,
        spec_mode: str | None = None,
        stream: bool = True,
        raw_inputs: list[Any] | None = None,
    ) -> Iterator[Chunk]:
        """gRPC bidirectional streaming (the only way to call a decoupled model over gRPC)."""
        inputs = raw_inputs if raw_inputs is not None else grpc_inputs(prompt, p, stream)
        t0 = time.perf_counter()
        for result in _grpc_responses(self.url, self.model, inputs, self.timeout_s, headers=gate_headers(api_key, spec_mode)):
            if result.get_response().outputs:
                yield result_chunk(result, time.perf_counter() - t0)

    def generate(
        self, prompt: str | bytes, p: GenerateParams, api_key: str | None = None, spec_mode: str | None = None, stream: bool = True
    ) -> Result:
        return Result(list(self.stream(prompt, p, api_key, spec_mode, stream=stream)))


def stream_engine(
    url: str,
    model: str,
    arrays: dict[str, np.ndarray],
    parameters: dict[str, Any] | None = None,
    outputs: list[str] | None = None,
    timeout_s: float = 600,
    engine_key: str | None = None,
) -> Iterator[tuple[float, Any]]:
    """Call an engine model (`target_engine` / `spec_engine`) directly over gRPC streaming, bypassing
    the gate: yields (perf_counter time, tritonclient result) per response until the final one.
    `arrays` come from `specgate.contract.engine_inputs`. The CPU engines answer only a caller with
    the server's engine key (`specgate_launcher.engine_key()`; tensorrtllm engines check none)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    from specgate.contract import PARAM_ENGINE_KEY

    if engine_key is not None:
        parameters = {**(parameters or {}), PARAM_ENGINE_KEY: engine_key}

    inputs = []
    for name, arr in arrays.items():
        t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        inputs.append(t)
    try:
        for result in _grpc_responses(url, model, inputs, timeout_s, parameters=parameters, outputs=outputs):
            yield time.perf_counter(), result
    except ServerError as exc:
        raise ServerError(f"{model}: {exc}") from None


def calibrate(url: str, override: dict[str, Any] | None = None, *, engine_key: str, timeout_s: float = 600) -> None:
    """Ask spec_engine to measure its machine again (a CalibrationOverride as `override` pins some
    measurements); returns once the new calibration is in force. ServerError if it failed (also
    without the server's engine key)."""
    from specgate.contract import PARAM_CALIBRATE, engine_inputs

    arrays = engine_inputs([0], 1, 0, streaming=False)
    value = json.dumps(override) if override else ""
    for _ in stream_engine(url, "spec_engine", arrays, {PARAM_CALIBRATE: value}, ["output_ids"], timeout_s, engine_key=engine_key):
        pass


def _grpc_responses(
    url: str,
    model: str,
    inputs: list[Any],
    timeout_s: float,
    headers: dict[str, str] | None = None,
    parameters: dict[str, Any] | None = None,
    outputs: list[str] | None = None,
) -> Iterator[Any]:
    """One request on a gRPC bidirectional stream: tritonclient results until the final response.
    ServerError on an error response or when nothing arrives for `timeout_s`."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)), headers=headers)
    finished = False
    try:
        try:
            client.async_stream_infer(
                model, inputs, parameters=parameters,
                outputs=[grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None,
                enable_empty_final_response=True,
            )
        except InferenceServerException:
            # the stream failed before the request went out (e.g. nothing listens at `url`): the
            # callback has the reason, handled below like any other error
            if q.empty():
                raise
        while True:
            try:
                result, error = q.get(timeout=timeout_s)
            except queue.Empty:
                raise ServerError(f"no response for {timeout_s:.0f} s") from None
            if error is not None:
                # a transport failure carries a gRPC status; an error response from a model does not
                if error.status() == "StatusCode.UNAVAILABLE":
                    raise ServerUnreachable(f"grpc://{url}", error.message().split(";")[0])
                raise ServerError(str(error))
            yield result
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                finished = True
                return
    finally:
        # a caller that stops early (error, timeout, closed generator) must not wait for the server
        client.stop_stream(cancel_requests=not finished)
        client.close()


def collect(chunks: Iterator[Chunk]) -> Result:
    return Result(list(chunks))


def _as_text(v: Any) -> str:
    return "".join(v) if isinstance(v, list) else str(v)


def _scalar(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        v = v.reshape(-1)[0] if v.size else None
        return v.decode() if isinstance(v, bytes) else (v.item() if hasattr(v, "item") else v)
    if isinstance(v, list):
        return v[0] if v else None
    return v


def _root_cause(exc: BaseException) -> str:
    """The innermost reason of a requests ConnectionError, e.g. "[Errno 111] Connection refused"."""
    while (inner := exc.__cause__ or exc.__context__) is not None:
        exc = inner
    return str(exc)


def _error_text(body: str) -> str:
    try:
        return json.loads(body).get("error", body)
    except ValueError:
        return body
