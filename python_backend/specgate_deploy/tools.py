"""The system tools the replica mode runs: HAProxy and Prometheus (with its promtool), Debian's packages.

The launcher never installs them: `make serve REPLICAS=N` without them stops with the command that
installs them (`.ci/run` runs it on CI).
"""

from __future__ import annotations

import shutil
from pathlib import Path

INSTALL_HINT = "apt-get install haproxy prometheus"
# Debian puts haproxy in /usr/sbin, which a non-root user's PATH may lack
_EXTRA_DIRS = ("/usr/sbin", "/usr/local/sbin")


class MissingTool(SystemExit):
    """A required program is not installed; the message says how to install it."""


def which(name: str) -> Path | None:
    found = shutil.which(name) or next((str(Path(d) / name) for d in _EXTRA_DIRS if (Path(d) / name).exists()), None)
    return Path(found) if found else None


def require(name: str) -> Path:
    path = which(name)
    if path is None:
        raise MissingTool(f"{name} is not installed; the replica mode needs HAProxy and Prometheus: {INSTALL_HINT} (as root)")
    return path
