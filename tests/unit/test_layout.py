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


# Beside the server's package, lowest first: each imports only from groups below it (or from itself).
# The launcher starts one tritonserver and its front; the deploy package composes and supervises what it
# starts (`make serve`, the replicas, the pod) and configures the balancer by the front's own limits;
# the benchmarks drive all of them.
PYTHON_BACKEND = PACKAGE.parent
BENCH = PYTHON_BACKEND.parent / "bench"
OUTSIDE_LAYERS = (("specgate",), ("specgate_client", "specgate_launcher"), ("specgate_front",), ("specgate_deploy",), ("bench",))


def _top_level_modules() -> dict[str, Path]:
    """module name -> file, for python_backend's modules and packages (specgate's too) and bench."""
    files = {p: PYTHON_BACKEND for p in PYTHON_BACKEND.rglob("*.py")} | {p: BENCH.parent for p in BENCH.rglob("*.py")}
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p for p, root in files.items()}


def _outside_layer(name: str) -> int | None:
    return next((i for i, group in enumerate(OUTSIDE_LAYERS) if name.split(".")[0] in group), None)


def test_the_packages_beside_the_server_import_only_downward() -> None:
    modules = _top_level_modules()
    assert {"specgate_launcher", "specgate_deploy.replica", "specgate_front.app", "bench.common"} <= modules.keys()
    upward = {}
    for name, path in modules.items():
        own = _outside_layer(name)
        bad = sorted(n for n in _imports(path)
                     if (layer := _outside_layer(n)) is not None and layer >= own and n.split(".")[0] != name.split(".")[0])
        if bad:
            upward[name] = bad
    assert not upward


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (a path that ends where it starts), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            if found := visit(nxt, [*path, node]):
                return found
        done.add(node)
        return None

    return next((c for node in sorted(graph) if (c := visit(node, [])) is not None), None)


def test_no_module_imports_itself_round_a_circle() -> None:
    """Module by module, wherever the import sits (a function-level import closes a circle too)."""
    modules = _top_level_modules()

    def targets(path: Path) -> set[str]:
        """The modules `path` imports: `from a.b import c` is module a.b.c where there is one, else a.b."""
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.update(f"{node.module}.{a.name}" for a in node.names)
        found = set()
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            found.add(name)
        return found - {""}

    graph = {m: targets(p) - {m} for m, p in modules.items()}
    assert _cycle(graph) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check can fail
