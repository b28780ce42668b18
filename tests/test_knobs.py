"""``tide.knobs``: every environment variable TIDE reads is validated where it is read, through one
module; a bad value raises ``ValueError`` naming the variable, the value and what is accepted."""
import ast
import pathlib
import subprocess
import sys

import pytest

from tide import knobs

TIDE = pathlib.Path(knobs.__file__).resolve().parent


@pytest.mark.parametrize("reader, value, expected", [
    (lambda: knobs.positive_int("TIDE_X", 7), "12", 12),
    (lambda: knobs.positive_int("TIDE_X", 7), "", 7),
    (lambda: knobs.positive_float("TIDE_X", None), "2.5", 2.5),
    (lambda: knobs.positive_float("TIDE_X", None), "", None),
    (lambda: knobs.choice("TIDE_X", ("a", "b"), "a"), "b", "b"),
    (lambda: knobs.choice("TIDE_X", ("a", "b"), "a"), "", "a"),
    (lambda: knobs.flag("TIDE_X"), "1", True),
    (lambda: knobs.flag("TIDE_X"), "0", False),
    (lambda: knobs.flag("TIDE_X"), "", False),
])
def test_valid_values_and_defaults(monkeypatch, reader, value, expected):
    monkeypatch.setenv("TIDE_X", value)
    assert reader() == expected


@pytest.mark.parametrize("reader, value, accepted", [
    (lambda: knobs.positive_int("TIDE_X", 7), "abc", "an integer >= 1"),
    (lambda: knobs.positive_int("TIDE_X", 7), "0", "an integer >= 1"),
    (lambda: knobs.positive_int("TIDE_X", 7), "1.5", "an integer >= 1"),
    (lambda: knobs.positive_float("TIDE_X", None), "x", "a number > 0"),
    (lambda: knobs.positive_float("TIDE_X", None), "-3", "a number > 0"),
    (lambda: knobs.positive_float("TIDE_X", None), "nan", "a number > 0"),
    (lambda: knobs.positive_float("TIDE_X", None), "inf", "a number > 0"),
    (lambda: knobs.choice("TIDE_X", ("a", "b"), "a"), "c", "one of ('a', 'b')"),
    (lambda: knobs.flag("TIDE_X"), "yes", "0 or 1"),
])
def test_bad_values_name_the_variable_the_value_and_what_is_accepted(monkeypatch, reader, value, accepted):
    monkeypatch.setenv("TIDE_X", value)
    with pytest.raises(ValueError) as e:
        reader()
    assert str(e.value) == f"tide: TIDE_X must be {accepted}, got {value!r}"


def test_bad_values_raise_where_the_library_reads_them(monkeypatch):
    """The readers the library calls, one per variable: a bad value raises there, naming it."""
    import tide.fsdp
    import tide.torchtitan
    from tide import topology
    from tide.fsdp import fallbacks
    from tide import sums, timeouts
    from tide.transport import probe

    def raises(var, value, call):
        monkeypatch.setenv(var, value)
        with pytest.raises(ValueError, match=f"tide: {var} must be .*, got {value!r}"):
            call()
        monkeypatch.delenv(var)

    sums._kernel.cache_clear()  # the summing kernel reads TIDE_RS_CTAS before it builds anything
    raises("TIDE_RS_CTAS", "abc", sums._kernel)
    sums._kernel.cache_clear()
    raises("TIDE_TIMEOUT_S", "x", lambda: timeouts.timeout_for(None))
    raises("TIDE_FSDP_TRANSPORT", "nccl", tide.fsdp.default_transport)
    raises("TIDE_RS_MODE", "bogus", tide.torchtitan.options)
    raises("TIDE_CUDA_MULTINODE", "yes", fallbacks.serve_multinode_on_cuda)
    raises("TIDE_ALLOW_MULTICAST", "true", probe.multicast_allowed)
    raises("LOCAL_WORLD_SIZE", "0", topology.local_world_size)


def test_a_bad_tide_trace_fails_the_import_naming_it():
    proc = subprocess.run([sys.executable, "-c", "import tide"], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "TIDE_TRACE": "on"})
    assert proc.returncode != 0 and "tide: TIDE_TRACE must be 0 or 1, got 'on'" in proc.stderr, proc.stderr


def _tide_names(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to a ``"TIDE_..."`` string (``PACE_ENV = "TIDE_MULTINODE_PACE_BYTES"``)."""
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and str(node.value.value).startswith("TIDE_")
            for t in node.targets if isinstance(t, ast.Name)}


def _environ_reads(path: pathlib.Path) -> list[str]:
    """Where ``path`` reads a TIDE_* variable (or one named at run time) from ``os.environ`` / ``os.getenv``."""
    tree = ast.parse(path.read_text())
    names = _tide_names(tree)
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                node.func.attr == "getenv" or (node.func.attr == "get" and "environ" in ast.unparse(node.func.value))):
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value):
            key = node.slice
        if key is None:
            continue
        name = key.value if isinstance(key, ast.Constant) else names.get(getattr(key, "id", ""))
        if name is None or str(name).startswith("TIDE_"):  # a TIDE_* name, or one this scan cannot tell
            found.append(f"{path.relative_to(TIDE.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_but_knobs_reads_a_tide_variable():
    reads = [r for p in sorted(TIDE.rglob("*.py")) if p.name != "knobs.py" for r in _environ_reads(p)]
    assert reads == [], "read these through tide.knobs:\n" + "\n".join(reads)
