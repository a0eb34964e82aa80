"""The engine control channel's secret: only the server's own models know it.

Triton serves every loaded model to anyone who can reach its ports, and the engines obey control
messages (pin a calibration, hand everything over, cancel, ping) and serve generations without the
gate's admission and tenant rules. So each engine request carries this secret in the
`contract.PARAM_ENGINE_KEY` parameter, and an engine refuses any request without it
(docs/robustness.md, "Who may call what").

`make serve` (specgate_launcher) creates the file once, like the label key, and passes its path to
the models in ENGINE_KEY_ENV. Importable without Triton.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Any

from specgate.contract import PARAM_ENGINE_KEY
from specgate.errors import InvalidInput
from specgate.secret_file import read_secret

ENGINE_KEY_ENV = "SPECGATE_ENGINE_KEY_FILE"


class EngineKey:
    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    @classmethod
    def from_env(cls) -> "EngineKey":
        """The key in the file ENGINE_KEY_ENV names. No fallback: a random key per process would
        make the models refuse one another."""
        path = os.environ.get(ENGINE_KEY_ENV)
        if not path:
            raise RuntimeError(f"{ENGINE_KEY_ENV} is not set: start tritonserver with specgate_launcher (make serve), "
                               "which creates the engine key")
        return cls(read_secret(Path(path)))

    def stamp(self, params: dict[str, Any]) -> dict[str, Any]:
        """`params` with the secret added (what the gate sends)."""
        return {**params, PARAM_ENGINE_KEY: self._secret.decode()}

    def check(self, params: dict[str, Any], model: str) -> None:
        """InvalidInput unless `params` carry the secret; removes it from `params` either way, so it
        is never logged or passed on."""
        given = params.pop(PARAM_ENGINE_KEY, None)
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), self._secret):
            raise InvalidInput(
                f"{model} refused the request: it is internal to this server and answers only its own models "
                f"(the {PARAM_ENGINE_KEY} parameter is {'missing' if given is None else 'wrong'}); send requests to the `llm` model"
            )
