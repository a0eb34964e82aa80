"""The server's package stands alone: nothing in `specgate` (what the Triton stubs load) imports
the client library, the launcher or the OpenAI front, which are clients of the server."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python_backend" / "specgate"
OUTSIDE = ("specgate_client", "specgate_launcher", "specgate_front")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_server_package_imports_no_client_side_module() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 40  # the walk found the package
    offenders = {
        str(m.relative_to(PACKAGE)): sorted(n for n in _imports(m) if n.split(".")[0] in OUTSIDE) for m in modules
    }
    assert not {m: names for m, names in offenders.items() if names}
