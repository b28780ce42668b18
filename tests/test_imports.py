"""Import hygiene: what importing a part of TIDE loads, and that its units import downwards only.

Units are the subpackages (``tide.meta``, ``tide.ops``, ``tide.transport``, ``tide.multinode``,
``tide.fsdp``, ``tide.extension``, ...) and the top-level modules (``tide.counters``, ``tide.registry``,
...); an arrow is an import anywhere in a module, inside functions too: one that loads on first use still
makes the importer depend on what it imports."""
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


def _imports(path: Path) -> dict[str, bool]:
    """The tide modules ``path`` imports anywhere (``from tide import x`` names ``tide.x``), each with whether
    an import of it runs when the module is imported (one outside every function)."""
    tree = ast.parse(path.read_text())
    functions = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    in_functions = {id(node) for f in functions for node in ast.walk(f) if node is not f}
    out: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("tide.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = ([f"tide.{a.name}" for a in node.names] if node.module == "tide" else
                     [node.module] if node.module.startswith("tide.") else [])
        else:
            continue
        for name in names:
            out[name] = out.get(name, False) or id(node) not in in_functions
    return out


def _unit_graph(at_import_only: bool = False) -> dict[str, set[str]]:
    """unit -> the other units it imports: anywhere, or with ``at_import_only`` outside functions only."""
    graph: dict[str, set[str]] = {}
    for path in sorted(TIDE.rglob("*.py")):
        name = _module_name(path)
        if name == "tide":  # the package's own __init__ only re-exports
            continue
        unit = _unit(name)
        deps = {_unit(m) for m, at_import in _imports(path).items() if at_import or not at_import_only}
        graph.setdefault(unit, set()).update(deps - {unit})
    return graph


def test_the_graph_sees_imports_inside_functions():
    assert "tide.extension" in _unit_graph()["tide.sums"]  # only inside sums._kernel
    assert "tide.extension" not in _unit_graph(at_import_only=True)["tide.sums"]


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


# The layers, bottom first (docs/design.md, "Module map"). A unit imports units of its own layer or below,
# never above; units named nowhere here (the CLI, the models, the integrations) sit on top of them all.
LAYERS = (
    {"tide.registry", "tide.knobs", "tide.meta"},
    {"tide.extension"},
    {"tide.procfs", "tide.trace", "tide.timeouts", "tide.agreement", "tide.topology", "tide.routes", "tide.counters",
     "tide.sums"},
    {"tide.transport"},
    {"tide.multinode"},
    {"tide.ops"},
    {"tide.fsdp", "tide.compile"},
)


def _layer(unit: str) -> int:
    return next((i for i, layer in enumerate(LAYERS) if unit in layer), len(LAYERS))


def test_the_layers_import_downwards_only():
    graph = _unit_graph()
    upward = [f"{unit} -> {dep}" for unit, deps in sorted(graph.items()) for dep in sorted(deps)
              if _layer(dep) > _layer(unit)]
    assert not upward, upward
    assert not graph["tide.registry"] and graph["tide.meta"] <= {"tide.registry"}, graph
    # The extension's loader: below every layer that uses the extension, using nothing above the bottom.
    assert graph["tide.extension"] <= {"tide.registry", "tide.knobs"}, graph
    assert all("tide.extension" in graph[u] for u in ("tide.ops", "tide.sums", "tide.multinode", "tide.transport"))


def test_the_cpu_side_imports_the_cuda_transport_only_inside_functions():
    at_import = _unit_graph(at_import_only=True)
    assert "tide.transport" not in at_import["tide.ops"] and "tide.transport" not in at_import["tide.multinode"]
    assert not at_import["tide.extension"], at_import  # setup.py loads it alone: the standard library only
