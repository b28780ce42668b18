"""Import hygiene: what importing a part of TIDE loads, and no import circle between its packages.

Units are the subpackages (``tide.meta``, ``tide.ops``, ``tide.transport``, ``tide.multinode``,
``tide.fsdp``) and the top-level modules (``tide.counters``, ``tide.registry``, ...); an arrow is a
module-level import (imports inside functions load on first use and are left out)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIDE = ROOT / "tide"


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(m for m in sys.modules if m.startswith('tide'))))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize("statement", ["import tide", "import tide.ops.reference", "import tide.multinode.schedule"])
def test_the_cpu_side_loads_no_cuda_transport(statement):
    loaded = _loaded_after(statement)
    assert "tide.ops" in loaded or "tide.multinode.schedule" in loaded, loaded
    assert not [m for m in loaded if m.startswith("tide.transport")], loaded


def _unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _module_level_imports(path: Path) -> set[str]:
    """The tide modules ``path`` imports at module level (``from tide import x`` names ``tide.x``)."""
    out = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "finalbody", []) + \
                [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("tide.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "tide":
                out |= {f"tide.{a.name}" for a in node.names}
            elif node.module.startswith("tide."):
                out.add(node.module)
    return out


def _unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(TIDE.rglob("*.py")):
        name = _module_name(path)
        if name == "tide":  # the package's own __init__ only re-exports
            continue
        unit = _unit(name)
        graph.setdefault(unit, set()).update(u for u in map(_unit, _module_level_imports(path)) if u != unit)
    return graph


def test_no_import_circle_between_packages():
    graph = _unit_graph()
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(unit: str) -> None:
        state[unit] = "open"
        path.append(unit)
        for dep in sorted(graph.get(unit, ())):
            if state.get(dep) == "open":
                raise AssertionError(" -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[unit] = "done"

    for unit in sorted(graph):
        if unit not in state:
            visit(unit)


def test_the_layers_import_downwards_only():
    graph = _unit_graph()
    assert "tide.transport" not in graph["tide.ops"] and "tide.transport" not in graph["tide.multinode"], graph
    assert not graph["tide.registry"] and not graph["tide.meta"] - {"tide.registry"}, graph
