"""Tenant metric labels: a keyed hash (HMAC-SHA256) under a server secret, never the API key.

An unkeyed hash of an API key can be reversed by hashing common keys until one matches; without the
secret, a file only the server reads, a label reveals nothing. The same secret gives the same labels
after a restart: `make serve` creates the file once (specgate_launcher) and passes its path in
LABEL_KEY_ENV.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from specgate.secret_file import read_secret

log = logging.getLogger(__name__)

LABEL_KEY_ENV = "SPECGATE_LABEL_KEY_FILE"
LABEL_HEX = 8


def label_secret_from_env() -> bytes:
    """The secret named by LABEL_KEY_ENV; without one, a random secret and a warning (labels then
    change at every restart, which breaks dashboards but leaks nothing)."""
    path = os.environ.get(LABEL_KEY_ENV)
    if not path:
        log.warning("%s is not set: tenant metric labels use a random secret and change at every restart", LABEL_KEY_ENV)
        return secrets.token_bytes(32)
    return read_secret(Path(path)).encode()


class TenantLabels:
    """Tenant identity -> metric label: the first LABEL_HEX hex of HMAC-SHA256(secret, identity)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def __call__(self, identity: str) -> str:
        return hmac.new(self._secret, identity.encode(), hashlib.sha256).hexdigest()[:LABEL_HEX]
