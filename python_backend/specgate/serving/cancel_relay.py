"""Postprocessing's relay of client cancellations to spec_gate, off the response path.

Every `llm` response passes through the one postprocessing instance. Its call to spec_gate (a BLS
request) used to run inside `execute`, with no timeout: a gate that did not answer stalled every
response of every request. Here one thread sends the cancel messages, each bounded by a timeout,
and `execute` only queues a key; a key already relayed is not sent again (a request's heartbeats
keep arriving cancelled until the gate has stopped it), unless its message failed (no answer in
time, or the BLS call raised): then the next cancelled response of that request sends it again.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from specgate.contract import PARAM_CANCEL
from specgate.serving.bls import responses
from specgate.serving.engine_key import EngineKey

log = logging.getLogger(__name__)

TIMEOUT_S = 10.0  # the gate answers a cancel at once; silence this long: give up on this one
BACKLOG = 1024  # keys waiting to be relayed; beyond this (a gate hung for a long time) they are dropped
REMEMBER = 1024  # recently relayed keys, not sent twice


class CancelRelay:
    def __init__(self, key: EngineKey, model: str = "spec_gate") -> None:
        self.key, self.model = key, model
        self._q: queue.Queue[int] = queue.Queue(BACKLOG)
        self._seen: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        threading.Thread(target=self._loop, name="cancel-relay", daemon=True).start()

    def cancel(self, request_key: int) -> None:
        """Queue a cancel for the gate's request `request_key`; returns at once."""
        with self._lock:
            if request_key in self._seen:
                return
            self._seen[request_key] = None
            if len(self._seen) > REMEMBER:
                self._seen.popitem(last=False)
        try:
            self._q.put_nowait(request_key)
        except queue.Full:
            log.warning("cancel relay backlog full: spec_gate is not taking cancellations; dropping one")

    def _loop(self) -> None:
        while True:
            self._send(self._q.get())

    def _send(self, request_key: int) -> None:
        ids = pb_utils.Tensor("input_ids", np.zeros(1, np.int32))
        lengths = pb_utils.Tensor("input_lengths", np.ones(1, np.int32))
        params = self.key.stamp({PARAM_CANCEL: str(request_key)})
        req = pb_utils.InferenceRequest(model_name=self.model, inputs=[ids, lengths], requested_output_names=["output_ids"], parameters=params)
        try:
            for batch in responses(req, self.model, TIMEOUT_S):
                for resp in batch:
                    if resp.has_error():
                        log.warning("spec_gate refused a cancellation: %s", resp.error().message())
        except Exception as exc:  # EngineFailure (no answer in time) or the BLS call failed
            log.warning("could not pass a cancellation on to spec_gate (sent again with the request's next response): %s", exc)
            with self._lock:
                self._seen.pop(request_key, None)
