"""The server's package stands alone: nothing in `specgate` (what the Triton stubs load) imports
the client library, the launcher or the OpenAI front, which are clients of the server. And its
subpackages are layered: each imports only from layers below it (or from itself), never upward."""

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


# lowest first; a module at the top of the package (algorithms, contract, machine, ...) is a leaf
LAYERS = (("text", "decoding"), ("cost_model",), ("speculative", "gate"), ("serving",))
LEAVES = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}


def _layer(name: str) -> int | None:
    """The layer of `specgate.<name>...`; -1 for a leaf module; None for anything outside specgate."""
    parts = name.split(".")
    if parts[0] != "specgate" or len(parts) < 2:
        return None
    if parts[1] in LEAVES:
        return -1
    return next(i for i, group in enumerate(LAYERS) if parts[1] in group)


def test_subpackages_import_only_downward() -> None:
    leaves_import_packages = {
        m.name: sorted(n for n in _imports(m) if (layer := _layer(n)) is not None and layer >= 0) for m in PACKAGE.glob("*.py")
    }
    assert not {m: names for m, names in leaves_import_packages.items() if names}, "a leaf module imports a subpackage"
    upward = {}
    for group in LAYERS:
        for pkg in group:
            own = _layer(f"specgate.{pkg}")
            for m in sorted((PACKAGE / pkg).rglob("*.py")):
                bad = sorted(n for n in _imports(m) if (layer := _layer(n)) is not None and layer >= own and n.split(".")[1] != pkg)
                if bad:
                    upward[str(m.relative_to(PACKAGE))] = bad
    assert not upward
