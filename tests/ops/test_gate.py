"""The gatekeeper is written once: the C++ gate (csrc/transport/gate.h) decides when a call of the
mutating ops may take the transport, and the ops' Python kernels only act on its verdicts
(``tide.ops.cuda.VERDICTS``). A verdict added, dropped, renamed or reordered on one side only fails
here, on CPU, from the sources (tests/cuda/test_gate_cuda.py asks the built extension the same)."""
import re
from pathlib import Path

from tide.ops import cuda

GATE = Path(__file__).resolve().parents[2] / "csrc" / "transport"


def _source(name: str) -> str:
    return (GATE / name).read_text()


def _names() -> list[str]:
    """The verdicts' names, in the order of the C++ kVerdicts array."""
    body = re.search(r"kVerdicts = \{(.*?)\};", _source("gate.h"), re.S).group(1)
    return re.findall(r'"(\w+)"', body)


def _enum() -> list[str]:
    """The Verdict enumerators before kCount, in order."""
    body = re.search(r"enum class Verdict : int \{(.*?)\};", _source("gate.h"), re.S).group(1)
    return [e for e in re.findall(r"\b(k\w+)", body) if e != "kCount"]


def _camel(name: str) -> str:
    return "k" + "".join(part.capitalize() for part in name.split("_"))


def test_python_acts_on_exactly_the_gates_verdicts_in_its_order():
    assert list(cuda.VERDICTS) == _names()
    assert [_camel(n) for n in _names()] == _enum()  # each name is its enumerator's


def test_every_verdict_is_in_the_gates_table_in_order():
    """The header's table, which says when each verdict holds and what Python does, lists them all."""
    table = [m.group(1) for m in re.finditer(r"^//   (\w+)\s{2,}", _source("gate.h"), re.M)]
    assert table[1:] == _names()  # the first row is the column heads


def test_the_design_docs_table_lists_the_verdicts_in_order():
    doc = (GATE.parents[1] / "docs" / "design.md").read_text()
    table = doc[doc.index("| verdict | holds when | Python then |"):]
    rows = re.findall(r"^\| `(\w+)` \|", table[:table.index("\n\n")], re.M)
    assert rows == _names()


def test_every_verdict_but_transport_is_given_somewhere():
    """No verdict is dead: the gate returns each condition's, and the C++ kernel "refused" (both in dispatch.cpp)."""
    given = set(re.findall(r"Verdict::(k\w+)", _source("dispatch.cpp")))
    assert set(_enum()) <= given, set(_enum()) - given


def test_each_verdict_means_one_action_of_the_python_kernels():
    """Issue with what the gate found, make what is missing and ask again, the reference backend, or an error."""
    assert set(cuda.VERDICTS.values()) == {"issue", "bind", "lease", "plan", "reference", "raise", "refuse"}
    assert {v for v, action in cuda.VERDICTS.items() if action == "issue"} == {"transport", "capturing"}
