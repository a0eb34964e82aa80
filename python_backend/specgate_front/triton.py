"""The front's only way to the model: the `llm` ensemble over gRPC streaming, with tritonclient's
asyncio client, plus the tokenizer the served repository names (for the chat template and usage).

The request is built by `specgate_client.grpc_inputs`, so the front sends exactly what every other
client sends; the tenant and mode travel as gRPC headers, which Triton forwards to the gate.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
import tritonclient.grpc.aio as grpcaio
from starlette.concurrency import run_in_threadpool
from tritonclient.utils import InferenceServerException

from specgate.text.tokenizer import PromptTokenizer
from specgate_client import Chunk, GenerateParams, grpc_inputs, result_chunk

log = logging.getLogger("specgate_front")

LLM_MODEL = "llm"
PREPROCESSING_MODEL = "preprocessing"  # its config names the tokenizer
GATE_MODEL = "spec_gate"  # its config names spec_engine's published calibration

# How the models' errors reach a gRPC stream client: Triton 2.51 sends only the message (prefixed with
# the ensemble), not the status code. Every model answers a client mistake with INVALID_ARG; the
# others are told apart by how the gate words them. The status says who may retry: 502 is this
# replica's fault, which HAProxy retries once on another replica (deploy/local/haproxy.cfg.j2); 503
# is overload, which a retry elsewhere would only add to, so the client backs off (Retry-After).
# - "overloaded: ...; retry later": the gate's admission refused it (gate/admission.py): 503 and
#   Retry-After, which OpenAI's SDKs retry (they do not retry a 400);
# - "<engine> is not answering: ...": an engine process is gone or hung, and the gate could not
#   serve the request on the other one either (serving/engine_client.py): 502;
# - Triton unreachable, or `llm` not loaded or not ready: 502;
# - "gate error: ...", "<engine>: ...": our own faults: 500.
# Anything else is the client's (400).
_OVERLOADED = re.compile(r"overloaded:")
_ENGINE_GONE = re.compile(r"(spec_engine|target_engine) is not answering\b")
_SERVER_FAULT = re.compile(r"(gate error|spec_engine|target_engine):")
# Triton's own answers while `llm` is not loaded or not ready
_UNAVAILABLE_MARKERS = ("unknown model", "is not ready", "unavailable")
RETRY_AFTER_S = 1  # the gate frees slots as fast as requests finish; a client retries soon


@dataclass
class BackendError(Exception):
    """A failure to report to the HTTP client: the status and OpenAI error type follow from `status`;
    `retry_after_s` becomes a Retry-After header."""

    status: int
    message: str
    retry_after_s: int | None = None

    def __str__(self) -> str:
        return self.message


def classify(message: str, model: str = LLM_MODEL) -> BackendError:
    """A Triton stream error as the HTTP status it deserves (see _OVERLOADED and below)."""
    text = message.removeprefix(f"in ensemble '{model}', ")
    if _OVERLOADED.match(text):
        return BackendError(503, text, retry_after_s=RETRY_AFTER_S)
    if _ENGINE_GONE.match(text):
        return BackendError(502, text)
    if any(m in text.lower() for m in _UNAVAILABLE_MARKERS):
        return BackendError(502, f"model {model!r} is not available: {text}")
    if _SERVER_FAULT.match(text):
        return BackendError(500, text)
    return BackendError(400, text)


def _rpc_error(exc: grpc.aio.AioRpcError, url: str) -> BackendError:
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return BackendError(502, f"Triton at {url} is unavailable: {exc.details()}")
    return BackendError(502, f"Triton at {url}: {exc.code().name}: {exc.details()}")


class Triton:
    """One gRPC channel to Triton, shared by every request, and the served model's tokenizer."""

    def __init__(self, url: str, model: str = LLM_MODEL, http_url: str | None = None) -> None:
        self.url, self.model, self.http_url = url, model, http_url
        self.client = grpcaio.InferenceServerClient(url)
        self._tokenizer: PromptTokenizer | None = None
        self._tokenizer_lock = asyncio.Lock()

    async def close(self) -> None:
        await self.client.close()

    async def tokenizer(self) -> PromptTokenizer:
        """The tokenizer `preprocessing` uses, loaded once from the directory its config names (the
        front and Triton share a file system); 502 while Triton cannot say which."""
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                try:
                    config = await self.client.get_model_config(PREPROCESSING_MODEL, as_json=True)
                except InferenceServerException as exc:  # tritonclient's wrapping of every gRPC error here
                    raise BackendError(
                        502, f"Triton at {self.url} is unavailable ({PREPROCESSING_MODEL} config): {exc.message()}"
                    ) from None
                params = config["config"]["parameters"]
                path, max_input_len = params["tokenizer_dir"]["string_value"], int(params["max_input_len"]["string_value"])
                self._tokenizer = await run_in_threadpool(PromptTokenizer, path, max_input_len)
                log.info("tokenizer from %s", path)
        return self._tokenizer

    async def not_ready(self) -> str | None:
        """Why this server should take no traffic yet, or None: tritonserver not ready (loading, or
        draining after SIGTERM), the model not ready, or no calibration published by spec_engine, which
        measures the machine after it loads and would measure the traffic too (a pinned calibration is
        published at once). The file is the one the gate reads, on the file system the front shares.

        Triton's readiness is asked over HTTP where the front knows the port: a draining tritonserver
        closes its HTTP port at once, while its gRPC ServerReady answers true until it exits (seen on
        2.51: 10 s into a drain)."""
        if self.http_url is not None and not await run_in_threadpool(self._http_ready):
            return f"tritonserver at {self.http_url} is not ready"
        try:
            if not await self.client.is_server_ready():
                return f"tritonserver at {self.url} is not ready"
            if not await self.client.is_model_ready(self.model):
                return f"model {self.model!r} is not ready"
            config = await self.client.get_model_config(GATE_MODEL, as_json=True)
        except InferenceServerException as exc:
            return f"Triton at {self.url} is unavailable: {exc.message()}"
        path = config["config"]["parameters"].get("calibration_path", {}).get("string_value")  # none on tensorrtllm engines
        if path and not Path(path).exists():
            return f"spec_engine has published no calibration yet ({path})"
        return None

    def _http_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:  # refused, reset, timed out, or an HTTP error status
            return False

    async def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[str, int]:
        """The model's chat template over `messages`, ending with the assistant's turn, and its length
        in tokens. (`llm` itself wraps a prompt as a single user turn only.) InvalidInput for a prompt
        longer than the model's context, found before a huge one costs the tokenizer its size."""
        tok = await self.tokenizer()

        def render() -> tuple[str, int]:
            text = tok.render_chat(messages)
            return text, len(tok.encode_within_limit(text))

        return await run_in_threadpool(render)

    async def count_tokens(self, text: str) -> int:
        """`text`'s length in tokens; InvalidInput as `chat_prompt`."""
        tok = await self.tokenizer()
        return await run_in_threadpool(lambda: len(tok.encode_within_limit(text)))

    async def generate(self, prompt: str, p: GenerateParams, headers: dict[str, str], stream: bool) -> AsyncIterator[Chunk]:
        """The `llm` responses for one request, as Chunks, until the final one. With `stream` false,
        `llm` sends one response that holds the whole output.

        Closing this generator early (the HTTP client went away) cancels the gRPC call, which ends the
        request's stream at Triton."""
        inputs = grpc_inputs(prompt, p, stream)

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.model, "inputs": inputs}

        t0 = time.perf_counter()
        call = self.client.stream_infer(one_request(), headers=headers)
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    raise classify(error.message(), self.model)
                response = result.get_response()
                if response.outputs:
                    yield result_chunk(result, time.perf_counter() - t0)
                final = response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    finished = True
                    return
            finished = True  # Triton closed the stream without a final flag: nothing left to cancel
        except grpc.aio.AioRpcError as exc:
            finished = True
            raise _rpc_error(exc, self.url) from None
        finally:
            if not finished:
                call.cancel()
                log.info("client went away: cancelled the Triton stream after %.2f s", time.perf_counter() - t0)
