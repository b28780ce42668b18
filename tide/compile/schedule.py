"""Where a rewritten graph issues TIDE's calls and waits them, and what keeps Inductor from moving either.

**Placement** (every graph: a make_fx or aot_eager graph runs in its FX order, which this sets):

- every wait right before the first node that reads its output (views of it do not count: they follow it);
- all-gathers, taken in the order of their first waits: bucket k's call is issued right before the first
  wait of bucket k - depth (``TIDE_COMPILE_PREFETCH``, default 1: one block ahead, FSDP2's implicit
  prefetch; 0: right before its own first wait), or right after an input it cannot move before that (its
  shards' casts and pads move with it). In the backward, the recomputed gathers are ahead in backward order;
- reduce-scatters: each call right after its last gradient is produced (the rewrite puts it there), its
  waits right before the first later reduce-scatter's call that compute separates from it, or before the
  first read of its shards if that comes first. Its transfer overlaps the backward of the block before it,
  and a call holds its gradients until its wait (tide/ops/works.py), so the gradients of at most two
  blocks outlive their last reader.

So when bucket k's call is issued, buckets k - depth .. k - 1 are still being read: depth + 1 buckets'
gathered parameters are alive at once, as in FSDP2, and ``tide.compile.prepare`` makes depth + 1 slots.

**Order** (:func:`issue_order`): TIDE's calls and the collectives left to stock, in FX order after
placement. It depends only on the plan and on where each rank's graph computes what (the same on every
rank: the ranks' graphs differ only by the pads and slices of short shards), and the plan's agreement
compares it between the ranks (tide/compile/plan.py).

**Pinning** (:func:`pin`, Inductor only): Inductor's scheduler treats TIDE's calls as ordinary kernels and
reorders independent ones (for peak memory, fusion, locality), differently on ranks whose graphs differ.
Explicit dependencies (:func:`dependencies`) make the order above the only one it may issue: each
collective of the issue order after the one before it; each wait after the last call issued before it (a
prefetched call stays ahead of the compute that precedes its own use); each call after the last matmul
before it (a prefetched call is not hoisted further, where it would need another slot); and what a call
overlaps, the last matmul (else the last computing node) between it and its first wait, after the call and
before its waits. They are ``control_deps`` (torch._inductor.fx_passes.control_dependencies, Inductor's own
way to keep an FX order through its scheduler), which every scheduler pass honours, ``simple_overlap``
included: it may still sink a wait later, never move a collective past another.
"""
from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from tide import knobs
from tide.compile import patterns
from tide.compile.plan import MATMULS, Bucket

aten = torch.ops.aten
# What only casts, pads or copies: moves with an all-gather's call (its shard's cast and pad), and is no compute.
LIGHT = patterns.CASTS | {aten.constant_pad_nd.default, aten.clone.default, aten.view.default,
                           aten._unsafe_view.default, aten.reshape.default}


def is_view(node: Node) -> bool:
    """A node that only re-reads its input: a getitem or an aten view (they follow what they view)."""
    if node.op != "call_function":
        return False
    target = node.target
    return (target is operator.getitem or getattr(target, "is_view", False)
            or target in (aten._unsafe_view.default, aten.reshape.default, aten.alias.default))


def computes(node: Node) -> bool:
    """An ATen call that does more than view, cast, pad or copy (a collective and a wait do not count)."""
    if node.op != "call_function" or is_view(node) or is_collective(node) or node.target in LIGHT:
        return False
    name = getattr(getattr(node.target, "_schema", None), "name", "")
    return name.startswith(("aten::", "prims::"))


def pinned_target(node: Node):
    """The op a node runs: its target, or for a node :func:`pin` wrapped in ``control_deps``, the target of
    the one call in its subgraph."""
    if node.op == "call_function" and getattr(node.target, "__name__", "") == "control_deps":
        subgraph = getattr(node.graph.owning_module, node.args[1].target)
        return next(n.target for n in subgraph.graph.nodes if n.op == "call_function")
    return node.target


def pinned_inputs(node: Node) -> list[Node]:
    """The nodes a node's op reads: for a node :func:`pin` wrapped, its op's own (not the dependencies)."""
    if node.op == "call_function" and getattr(node.target, "__name__", "") == "control_deps":
        return [a for a in node.args[2:] if isinstance(a, Node)]
    return node.all_input_nodes


def tide_ops() -> tuple:
    return torch.ops.tide.all_gather_start.default, torch.ops.tide.reduce_scatter_start.default


def is_collective(node: Node) -> bool:
    """A TIDE call or a functional c10d collective (not its wait)."""
    if node.op != "call_function":
        return False
    if node.target in tide_ops():
        return True
    name = getattr(getattr(node.target, "_schema", None), "name", "")
    return name.startswith("_c10d_functional::") and node.target is not patterns.WAIT


@dataclass
class Call:
    """One TIDE call of a rewritten graph: its bucket, its node and the waits on its outputs."""

    bucket: Bucket
    start: Node
    waits: list[Node] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.bucket.kind


def prefetch_depth() -> int:
    """``TIDE_COMPILE_PREFETCH``: all-gather buckets issued ahead of the one being read (default 1)."""
    return knobs.get("TIDE_COMPILE_PREFETCH")


def _positions(graph: Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _first_read(node: Node, order: dict[Node, int]) -> Node | None:
    """The first node that reads ``node``'s value other than through views, or None."""
    reads, stack, seen = [], list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if is_view(user):
            stack.extend(user.users)
        else:
            reads.append(user)
    return min(reads, key=order.__getitem__, default=None)


def _move_before(node: Node, target: Node) -> None:
    """``node`` right before ``target`` (the caller re-sorts: views of ``node`` then follow it)."""
    if node.next is not target and node is not target:
        target.prepend(node)


def _issue_at(start: Node, target: Node, order: dict[Node, int]) -> None:
    """``start`` and its getitems right before ``target``, its light inputs standing after ``target``
    moved before it; when an input that cannot move stands after ``target``, right after that input."""
    light, floor, stack, seen = [], None, list(start.all_input_nodes), set()
    while stack:
        x = stack.pop()
        if x in seen or order[x] < order[target]:
            continue
        seen.add(x)
        if x.op == "call_function" and x.target in LIGHT:
            light.append(x)
            stack.extend(x.all_input_nodes)
        elif floor is None or order[x] > order[floor]:
            floor = x
    if floor is not None:
        light = [x for x in light if order[x] > order[floor]]
        cursor = floor
    else:
        cursor = target.prev
    for x in sorted(light, key=order.__getitem__) + [start] + list(start.users):
        if cursor is not x and cursor.next is not x:
            cursor.append(x)
        cursor = x


def place(graph: Graph, calls: list[Call], depth: int) -> None:
    """Place ``calls`` and their waits in ``graph`` (see the module doc); ``graph`` is left topologically
    sorted."""
    from tide.compile.rewriter import stable_topological_sort

    order = _positions(graph)
    for call in calls:
        for wait in call.waits:
            first = _first_read(wait, order)
            if first is not None:
                _move_before(wait, first)
    stable_topological_sort(graph)
    order = _positions(graph)
    gathers = sorted((c for c in calls if c.kind == "all_gather"), key=lambda c: min(map(order.__getitem__, c.waits)))
    first_waits = [min(c.waits, key=order.__getitem__) for c in gathers]
    for k, call in enumerate(gathers):
        _issue_at(call.start, first_waits[max(0, k - depth)], order)
        order = _positions(graph)
    scatters = sorted((c for c in calls if c.kind == "reduce_scatter"), key=lambda c: order[c.start])
    nodes = list(graph.nodes)
    computed = [0]  # computed[i]: compute nodes before nodes[i]
    for node in nodes:
        computed.append(computed[-1] + computes(node))
    for k, call in enumerate(scatters):
        following = next((c.start for c in scatters[k + 1:] if computed[order[c.start]] > computed[order[call.start]]),
                         None)
        for wait in call.waits:
            targets = [n for n in (following, _first_read(wait, order)) if n is not None]
            if targets:
                _move_before(wait, min(targets, key=order.__getitem__))
    stable_topological_sort(graph)


def issue_order(graph: Graph) -> list[Node]:
    """TIDE's calls and the c10d collectives beside them, in the order ``graph`` issues them."""
    return [n for n in graph.nodes if is_collective(n)]


def _anchor(window: list[Node]) -> Node | None:
    """What a call overlaps in ``window`` (the nodes between it and its first wait): the last matmul there, else
    the last node that computes, else None."""
    matmuls = [n for n in window if n.op == "call_function" and n.target in MATMULS]
    computing = matmuls or [n for n in window if computes(n)]
    return computing[-1] if computing else None


def dependencies(graph: Graph, calls: list[Call]) -> dict[Node, set[Node]]:
    """The ordering dependencies that pin the placed graph's order (see the module doc): node -> the nodes it
    must follow, each standing before it."""
    deps: dict[Node, set[Node]] = defaultdict(set)
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    last_collective = last_matmul = None
    own = {w: c.start for c in calls for w in c.waits}
    for node in nodes:
        if is_collective(node):
            if last_collective is not None:
                deps[node].add(last_collective)
            if node.target in tide_ops() and last_matmul is not None:
                deps[node].add(last_matmul)
            last_collective = node
        elif node in own and last_collective is not None and last_collective is not own[node]:
            deps[node].add(last_collective)
        elif node.op == "call_function" and node.target in MATMULS:
            last_matmul = node
    for call in calls:
        anchor = _anchor(nodes[order[call.start] + 1:min(order[w] for w in call.waits)])
        if anchor is not None:
            deps[anchor].add(call.start)
            for wait in call.waits:
                deps[wait].add(anchor)
    return {node: before for node, before in deps.items() if before}


def pin(graph: Graph, calls: list[Call]) -> int:
    """Make the placed order the only one Inductor's scheduler may issue; returns the dependencies added."""
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    order = _positions(graph)
    deps = {node: OrderedSet(sorted(map(_one_tensor, before), key=order.__getitem__))
            for node, before in dependencies(graph, calls).items()}
    preserve_node_ordering(graph, deps)
    return sum(len(before) for before in deps.values())


def _one_tensor(node: Node) -> Node:
    """A dependency as one tensor: for a call that returns a list, its first output (torch 2.11's lowering of
    ``control_deps`` skips a dependency that is not one tensor; the outputs follow the call)."""
    if isinstance(node.meta.get("val"), (list, tuple)):
        return min((u for u in node.users if u.target is operator.getitem), key=lambda u: u.args[1])
    return node
