"""How much of each collective's transfer a graph leaves exposed: for every collective call (TIDE's graph ops
and c10d's functional collectives alike), the compute kernels issued between the call and the first wait
on its outputs. None means nothing can run beside the transfer: it is exposed.

Two readings of one measure:

- :func:`of_code`: the Python wrapper Inductor generates (``torch._inductor.utils.run_and_get_code``), the order
  a compiled graph really issues. Kernels: Triton launches (``.run(``), C++ kernels (``cpp_fused_*``), extern
  kernels (``extern_kernels.*``, matmuls) and ATen fallbacks (``torch.ops.aten.*``).
- :func:`of_graph`: an FX graph that runs in its node order (make_fx, aot_eager, torchtitan's graph trainer
  outside its Inductor regions). Kernels: every ATen call that is not a view.

Neither counts a kernel that only casts, pads or copies (a generated kernel whose name lists only such ops,
``triton_poi_fused__to_copy_0``): those prepare the collectives' own inputs.

A wait right after its call is "read at once" when the next kernel reads what it waited for (or the graph
returns it): nothing could have gone between.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from torch.fx import Graph

KINDS = {"all_gather_start": "all_gather", "all_gather_into_tensor": "all_gather",
         "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
         "reduce_scatter_start": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
         "reduce_scatter_tensor_coalesced": "reduce_scatter"}


@dataclass
class Exposure:
    """One collective call: its op (``all_gather_start``, ``reduce_scatter_tensor``, ...), whether TIDE issues
    it, the kernels between it and its first wait, and whether that wait's output is read at once."""

    op: str
    tide: bool
    kernels: int
    read_at_once: bool = False

    @property
    def kind(self) -> str:
        return KINDS.get(self.op, self.op)

    @property
    def exposed(self) -> bool:
        return self.kernels == 0


_START = re.compile(r"^\s*(?:(\w+) = )?torch\.ops\.(tide|_c10d_functional)\.(\w+)\.default\((.*)$")
_ITEM = re.compile(r"^\s*(\w+) = (\w+)\[\d+\]")
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")
_KERNEL = re.compile(r"\.run\(|\bcpp_fused_\w+\(|\bextern_kernels\.\w+\(|\btorch\.ops\.aten\.")
_OUT = re.compile(r"\bout=(\w+)")
_FUSED = re.compile(r"\b(?:triton_\w+?_fused|cpp_fused)_(\w+?)_\d+(?:\.run)?\(")
_DATA_OPS = re.compile(r"_to_copy|constant_pad_nd|convert_element_type|_unsafe_view|clone|copy|view|reshape|_")


def _computes(line: str) -> bool:
    """A kernel launch that does more than cast, pad or copy."""
    if not _KERNEL.search(line):
        return False
    fused = _FUSED.search(line)
    return fused is None or bool(_DATA_OPS.sub("", fused.group(1)))


def of_code(code: str) -> list[Exposure]:
    """The collective calls of one generated wrapper (``code``), in issue order."""
    root: dict[str, str] = {}  # buffer -> the call that made it
    calls: dict[str, dict] = {}  # call's buffer -> {op, tide, kernels, waited, read_at_once}
    open_calls: list[str] = []
    waited: str | None = None  # the outputs of the call just waited, until the next kernel
    lines = code.splitlines()
    for line in lines:
        wait = _WAIT.search(line)
        if wait:
            name = root.get(wait.group(1), wait.group(1))
            call = calls.get(name)
            if call is not None and not call["waited"]:
                call["waited"] = True
                open_calls.remove(name)
                waited = name if call["kernels"] == 0 else None
            continue
        start = _START.match(line)
        if start:
            out = start.group(1) or (_OUT.search(line).group(1) if _OUT.search(line) else None)
            if out is not None:
                calls[out] = {"op": start.group(3), "tide": start.group(2) == "tide", "kernels": 0, "waited": False,
                              "read_at_once": False}
                open_calls.append(out)
                root[out] = out
            continue
        item = _ITEM.match(line)
        if item and item.group(2) in root:
            root[item.group(1)] = root[item.group(2)]
            continue
        if _computes(line) or line.strip().startswith("return "):
            if waited is not None:
                names = {b for b, r in root.items() if r == waited}
                calls[waited]["read_at_once"] = any(re.search(rf"\b{b}\b", line) for b in names)
                waited = None
            if _computes(line):
                for name in open_calls:
                    calls[name]["kernels"] += 1
    return [Exposure(c["op"], c["tide"], c["kernels"], c["read_at_once"]) for c in calls.values() if c["waited"]]


def of_graph(graph: Graph) -> list[Exposure]:
    """The collective calls of an FX graph that runs in node order, in that order."""
    from tide.compile.schedule import computes, is_collective, is_view, tide_ops

    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    out = []
    for node in nodes:
        if not is_collective(node):
            continue
        outputs = [node] + [u for u in node.users if is_view(u)]
        waits = [w for o in outputs for w in o.users if w.op == "call_function" and "wait_tensor" in str(w.target)]
        if not waits:
            continue
        first = min(waits, key=order.__getitem__)
        kernels = sum(1 for n in nodes[order[node] + 1:order[first]] if computes(n))
        following = next((n for n in nodes[order[first] + 1:] if computes(n) or n.op == "output"), None)
        read = following is not None and any(w in following.all_input_nodes or
                                             any(v in following.all_input_nodes for v in w.users if is_view(v))
                                             for w in waits)
        op = node.target._schema.name.split("::", 1)[1]
        out.append(Exposure(op, node.target in tide_ops(), kernels, read))
    return out


def summary(exposures: list[Exposure]) -> dict:
    """Per kind (``all_gather``, ``reduce_scatter``, ...) and issuer (``tide`` or ``stock``): ``calls``,
    ``exposed`` (no kernel before the first wait) and ``exposed_unread`` (exposed, and the output not read at
    once: a wait that could have gone later)."""
    counts: dict[str, Counter] = {}
    for e in exposures:
        c = counts.setdefault(f"{'tide' if e.tide else 'stock'}:{e.kind}", Counter())
        c["calls"] += 1
        c["exposed"] += e.exposed
        c["exposed_unread"] += e.exposed and not e.read_at_once
    return {key: dict(c) for key, c in sorted(counts.items())}
