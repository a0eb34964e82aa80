"""Server secrets kept in files: created once with a random value, readable by their owner only.

`make serve` (specgate_launcher) creates them under artifacts/secrets/ and passes their paths on;
they are never printed or logged.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def ensure_secret(path: Path) -> Path:
    """Create `path` holding a fresh random secret unless it exists; mode 0600, its folder 0700."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        # O_EXCL: two launchers starting at once cannot both write it, and an existing secret
        # (the one today's labels and admin clients use) is never replaced.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def read_secret(path: Path) -> str:
    """The secret in `path`. Refuses a file that others may read, as ssh does with private keys."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(f"secret file {path} is readable by others (mode {mode:o}); chmod 600 it")
    secret = path.read_text().strip()
    if not secret:
        raise ValueError(f"secret file {path} is empty")
    return secret
