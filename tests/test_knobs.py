"""``tide.knobs``: every environment variable TIDE reads is declared once in ``tide.knobs.KNOBS`` and read
through it; a bad value raises ``ValueError`` naming the variable, the value and what is accepted, where it
is read and, for every knob, at TIDE's first use (``tide.fsdp.enable``, the first op call) on any device."""
import ast
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tide import knobs
from tide.launch import run_ranks

TIDE = pathlib.Path(knobs.__file__).resolve().parent
ACCEPTED = {"positive_int": "an integer >= 1", "count": "an integer >= 0", "positive_float": "a number > 0",
            "flag": "0 or 1"}
# A bad value of every declared knob (a knob declared without one fails test_every_knob_is_validated).
BAD = {"TIDE_RS_CTAS": "abc", "TIDE_MULTINODE_RAILS": "x", "TIDE_RS_RING_BYTES": "-1", "TIDE_AG_CAST_CTAS": "0",
       "TIDE_RS_RING_DEPTH": "x", "TIDE_MULTINODE_PACE_BYTES": "abc", "TIDE_CUDA_MULTINODE": "2",
       "TIDE_ALLOW_MULTICAST": "yes", "TIDE_BUILD_VERBOSE": "x", "LOCAL_WORLD_SIZE": "0", "TIDE_TIMEOUT_S": "-3",
       "TIDE_RS_MODE": "x", "TIDE_FSDP_TRANSPORT": "x", "TIDE_TRACE": "on", "TIDE_BUILD_CUDA": "true",
       "TIDE_COMPILE_PREFETCH": "-1"}


@pytest.fixture
def clean_env(monkeypatch):
    """No declared knob set, and none validated yet in this process."""
    for name in knobs.KNOBS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(knobs, "_validated", False)
    return monkeypatch


@pytest.mark.parametrize("knob, value, expected", [
    (knobs.Knob("positive_int"), "12", 12),
    (knobs.Knob("positive_int", 7), "", 7),
    (knobs.Knob("count", 1), "0", 0),
    (knobs.Knob("count", 1), "", 1),
    (knobs.Knob("positive_float"), "2.5", 2.5),
    (knobs.Knob("positive_float"), "", None),
    (knobs.Knob("choice", "a", ("a", "b")), "b", "b"),
    (knobs.Knob("choice", "a", ("a", "b")), "", "a"),
    (knobs.Knob("flag", False), "1", True),
    (knobs.Knob("flag", False), "0", False),
    (knobs.Knob("flag", False), "", False),
])
def test_valid_values_and_defaults(monkeypatch, knob, value, expected):
    monkeypatch.setitem(knobs.KNOBS, "TIDE_X", knob)
    monkeypatch.setenv("TIDE_X", value)
    assert knobs.get("TIDE_X") == expected


@pytest.mark.parametrize("knob, value, accepted", [
    (knobs.Knob("positive_int"), "abc", "an integer >= 1"),
    (knobs.Knob("positive_int"), "0", "an integer >= 1"),
    (knobs.Knob("positive_int"), "1.5", "an integer >= 1"),
    (knobs.Knob("count", 1), "-1", "an integer >= 0"),
    (knobs.Knob("count", 1), "x", "an integer >= 0"),
    (knobs.Knob("positive_float"), "x", "a number > 0"),
    (knobs.Knob("positive_float"), "-3", "a number > 0"),
    (knobs.Knob("positive_float"), "nan", "a number > 0"),
    (knobs.Knob("positive_float"), "inf", "a number > 0"),
    (knobs.Knob("choice", "a", ("a", "b")), "c", "one of ('a', 'b')"),
    (knobs.Knob("flag", False), "yes", "0 or 1"),
])
def test_bad_values_name_the_variable_the_value_and_what_is_accepted(monkeypatch, knob, value, accepted):
    monkeypatch.setitem(knobs.KNOBS, "TIDE_X", knob)
    monkeypatch.setenv("TIDE_X", value)
    with pytest.raises(ValueError) as e:
        knobs.get("TIDE_X")
    assert str(e.value) == f"tide: TIDE_X must be {accepted}, got {value!r}"


def test_an_undeclared_knob_cannot_be_read():
    with pytest.raises(KeyError, match="'TIDE_NOT_DECLARED' is not a declared knob"):
        knobs.get("TIDE_NOT_DECLARED")
    with pytest.raises(KeyError, match="'TIDE_RS_CTAS' is not a declared flag"):
        knobs.flag("TIDE_RS_CTAS")


@pytest.mark.parametrize("name", sorted(knobs.KNOBS))
def test_every_knob_is_validated(clean_env, name):
    knob = knobs.KNOBS[name]
    accepted = f"one of {knob.choices}" if knob.kind == "choice" else ACCEPTED[knob.kind]
    knobs.validate_all()  # nothing set: every default
    clean_env.setenv(name, BAD[name])
    with pytest.raises(ValueError) as e:
        knobs.validate_all()
    assert str(e.value) == f"tide: {name} must be {accepted}, got {BAD[name]!r}"


def test_validation_runs_once_it_has_passed(clean_env):
    clean_env.setenv("TIDE_RS_CTAS", "abc")
    for _ in range(2):  # a failed validation is not remembered: every use raises until the value is fixed
        with pytest.raises(ValueError, match="TIDE_RS_CTAS"):
            knobs.validate_once()
    clean_env.setenv("TIDE_RS_CTAS", "8")
    knobs.validate_once()
    clean_env.setenv("TIDE_RS_CTAS", "abc")
    knobs.validate_once()  # passed before: the steady path tests a flag, it does not parse again
    with pytest.raises(ValueError, match="TIDE_RS_CTAS"):
        knobs.get("TIDE_RS_CTAS")  # the reader still checks what it reads


def bad_knob_at_first_use(rank: int, world_size: int) -> dict:
    """A first op call, then ``tide.fsdp.enable`` on a live FSDP2 model, under the caller's bad knob; then
    both again with it unset."""
    from torch.distributed.fsdp import fully_shard

    import tide.fsdp
    import tide.ops

    def error_of(call):
        try:
            call()
        except ValueError as e:
            return str(e)
        return None

    shards, outs = [torch.full((2,), float(rank))], [torch.empty(2 * world_size)]
    model = fully_shard(torch.nn.Linear(4, 4))
    errors = {"op": error_of(lambda: tide.ops.all_gather_into_params(shards, outs)),
              "enable": error_of(lambda: tide.fsdp.enable(model))}
    del os.environ["TIDE_RS_CTAS"]
    tide.ops.all_gather_into_params(shards, outs)
    tide.fsdp.enable(model)
    return {**errors, "gathered": outs[0].tolist(), "enabled": len(tide.fsdp.param_groups(model))}


def test_a_bad_knob_raises_at_the_first_op_call_and_at_enable_on_cpu():
    for r in run_ranks(bad_knob_at_first_use, 2, env={"TIDE_RS_CTAS": "abc"}, timeout=120):
        assert r["op"] == r["enable"] == "tide: TIDE_RS_CTAS must be an integer >= 1, got 'abc'", r
        assert r["gathered"] == [0.0, 0.0, 1.0, 1.0] and r["enabled"] == 1, r


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


def _string_names(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to a string (``PACE_ENV = "TIDE_MULTINODE_PACE_BYTES"``)."""
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def _environ_reads(path: pathlib.Path) -> list[str]:
    """Where ``path`` reads a TIDE_* variable (or one named at run time) from ``os.environ`` / ``os.getenv``."""
    tree = ast.parse(path.read_text())
    names = _string_names(tree)
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


def _knob_reads(path: pathlib.Path, names: dict[str, str]) -> list[tuple[str, str | None]]:
    """(where, variable) of every ``knobs.get`` / ``knobs.flag`` call in ``path``; the variable is None where
    this scan cannot tell it (neither a string nor a module-level name bound to one, ``rails.RAILS_ENV``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "flag")
                and ast.unparse(node.func.value) == "knobs"):
            key = node.args[0]
            name = key.value if isinstance(key, ast.Constant) \
                else names.get(getattr(key, "attr", getattr(key, "id", "")))
            found.append((f"{path.relative_to(TIDE.parent)}:{node.lineno}: {ast.unparse(node)}", name))
    return found


def test_the_table_declares_every_variable_read_and_each_is_read():
    files = [p for p in sorted(TIDE.rglob("*.py")) if p.name != "knobs.py"] + [TIDE.parent / "setup.py"]
    names = {k: v for p in files for k, v in _string_names(ast.parse(p.read_text())).items()}
    reads = [read for p in files for read in _knob_reads(p, names)]
    undeclared = [where for where, name in reads if name not in knobs.KNOBS]
    assert not undeclared, "declare these in tide.knobs.KNOBS (or name them by a string):\n" + "\n".join(undeclared)
    assert {name for _, name in reads} == set(knobs.KNOBS), "declared but read nowhere"
