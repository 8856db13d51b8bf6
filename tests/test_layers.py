"""The map of layers in docs/design.md holds: imports point one way, and no module imports
itself back through others (no import circle)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "ps", "worker", "scripts")
# package -> packages its modules may import (docs/design.md, "Layers")
ALLOWED = {
    "common": {"common"},
    "ps": {"common", "ps"},
    "worker": {"common", "worker"},
    "scripts": {"common", "ps", "worker", "scripts"},
}


def _imports() -> dict[str, set[str]]:
    """wavelet module -> the wavelet modules it imports (anywhere in the file)."""
    graph = {}
    for package in PACKAGES:
        for path in (ROOT / package).glob("*.py"):
            name = f"{package}.{path.stem}"
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("wavelet."):
                    found.add(node.module.removeprefix("wavelet."))
                elif isinstance(node, ast.Import):
                    found |= {
                        a.name.removeprefix("wavelet.")
                        for a in node.names
                        if a.name.startswith("wavelet.")
                    }
            graph[name] = {m for m in found if m.split(".")[0] in PACKAGES}
    return graph


def test_imports_point_down_the_layers():
    wrong = [
        f"{module} imports {target}"
        for module, targets in _imports().items()
        for target in targets
        if target.split(".")[0] not in ALLOWED[module.split(".")[0]]
    ]
    assert not wrong, wrong


def test_no_import_circle():
    graph = _imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                raise AssertionError(" -> ".join([*path, module, target]))
            if target not in state:
                visit(target, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_every_module_says_its_job_first():
    missing = [
        f"{p.parent.name}/{p.name}"
        for package in PACKAGES
        for p in (ROOT / package).glob("*.py")
        if p.stem != "__init__" and not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not missing, missing
