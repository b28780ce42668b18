"""Apply the bucket plan to a graph: one ``tide::all_gather_start`` / ``tide::reduce_scatter_start`` per bucket,
one ``_c10d_functional.wait_tensor`` per output where the old wait was, and the old collectives gone.

- All-gather: the op is issued where the bucket's first collective was and takes each collective's own
  input (cast and padded: the op's contract); the later members' casts and pads move up with it.
- Reduce-scatter: the op is issued after the bucket's last gradient is produced and takes the original
  gradients (unpadded, in their own dtype); the fp32 casts, splits, pads and cats that only fed the
  collectives are erased. A wait that stood before the op moves after it, with its users.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch.fx import Graph, GraphModule, Node

from tide.compile import patterns, plan as planning, schedule
from tide.compile.report import Report, record

aten = torch.ops.aten


def _op(name: str):
    op = getattr(torch.ops.tide, name, None)
    if op is None:
        raise RuntimeError(f"tide.compile.rewrite: torch.ops.tide.{name} is not registered (this TIDE build lacks "
                           "the async collectives)")
    return op.default


def _node(graph: Graph, target, args, like: Node, val) -> Node:
    node = graph.call_function(target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    node.meta["val"] = val
    return node


def _issue(graph: Graph, bucket: planning.Bucket, target, args, anchor: Node, before: bool) -> schedule.Call:
    """The bucket's op at ``anchor`` and one getitem per output (the call's waits are added by the caller)."""
    first = bucket.members[0].collective
    with graph.inserting_before(anchor) if before else graph.inserting_after(anchor):
        start = _node(graph, target, args, first, [m.collective.meta["val"] for m in bucket.members])
    items, cursor = [], start
    for i, m in enumerate(bucket.members):
        with graph.inserting_after(cursor):
            cursor = _node(graph, operator.getitem, (start, i), m.collective, m.collective.meta["val"])
        items.append(cursor)
    return schedule.Call(bucket, start), items


def _replace_wait(graph: Graph, m: patterns.Match, item: Node, after: Node | None) -> Node:
    """A new wait on ``item`` where ``m``'s wait was (after ``after`` when given), then the old pair erased."""
    with graph.inserting_before(m.wait) if after is None else graph.inserting_after(after):
        wait = _node(graph, patterns.WAIT, (item,), m.wait, m.wait.meta["val"])
    m.wait.replace_all_uses_with(wait)
    graph.erase_node(m.wait)
    graph.erase_node(m.collective)
    return wait


def _contiguous(graph: Graph, node: Node, report: Report, kind: str) -> Node:
    """``node``, or a contiguous copy of it in its own dtype (the ops take contiguous tensors)."""
    val = node.meta["val"]
    if val.is_contiguous():
        return node
    report.count(kind, "copies")
    with graph.inserting_after(node):
        copy = graph.call_function(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    copy.meta["val"] = val.clone(memory_format=torch.contiguous_format)
    return copy


def _gather(graph: Graph, bucket: planning.Bucket, position: dict, report: Report) -> schedule.Call:
    first = bucket.members[0].collective
    for m in bucket.members[1:]:
        for n in m.glue:
            if position[n] > position[first]:
                first.prepend(n)
    args = ([_contiguous(graph, m.input, report, bucket.kind) for m in bucket.members], bucket.world_size,
            bucket.group_name)
    call, items = _issue(graph, bucket, _op("all_gather_start"), args, first, before=True)
    call.waits = [_replace_wait(graph, m, item, None) for m, item in zip(bucket.members, items)]
    return call


def _scatter(graph: Graph, bucket: planning.Bucket, position: dict, report: Report) -> schedule.Call:
    last = max((m.input for m in bucket.members), key=position.__getitem__)
    out_dtype = bucket.members[0].facts[2]
    args = ([_contiguous(graph, m.input, report, bucket.kind) for m in bucket.members], bucket.members[0].scale,
            out_dtype, bucket.world_size, bucket.group_name)
    call, items = _issue(graph, bucket, _op("reduce_scatter_start"), args, last, before=False)
    cursor = items[-1]  # the waits that stood before the op follow it, in their order
    for m, item in zip(bucket.members, items):
        if position[m.wait] > position[last]:
            call.waits.append(_replace_wait(graph, m, item, None))
        else:
            cursor = _replace_wait(graph, m, item, cursor)
            call.waits.append(cursor)
    return call


def _erase_unused(graph: Graph, nodes: list[Node]) -> int:
    """Erase those of ``nodes`` that nothing reads any more (and then those only they read). Only calls: a
    graph input stays, even unread (Inductor's backward may take an empty shard's zero padding as one, and
    its inputs are bound by position)."""
    left, erased = {n for n in nodes if n.op == "call_function"}, 0
    while True:
        unused = [n for n in left if not n.users]
        if not unused:
            return erased
        for n in unused:
            graph.erase_node(n)
            left.discard(n)
            erased += 1


def stable_topological_sort(graph: Graph) -> None:
    """Move each node that stands before one of its inputs to just after its last input, keeping the order
    of everything else."""
    pending = list(reversed(graph.nodes))
    ready, waiting, cursor = set(), defaultdict(list), None
    while pending:
        node = pending.pop()
        missing = [x for x in node.all_input_nodes if x not in ready]
        if missing:
            waiting[missing[-1]].append(node)
            continue
        ready.add(node)
        if cursor is not None and cursor.next is not node:
            cursor.append(node)
        cursor = node
        pending.extend(reversed(waiting.pop(node, ())))
    if waiting:
        raise RuntimeError("tide.compile.rewrite: the rewritten graph has a cycle")


def _merge_repeated_waits(graph: Graph) -> None:
    """A collective waited on more than once (Inductor 2.15 merges a tied weight's two identical gathers into
    one, each old wait kept): its later waits' users read the first wait, which precedes them, and the later
    waits go. A wait of a completed collective is a no-op, so this changes nothing that runs."""
    for node in list(graph.nodes):
        waits = list(node.users)
        if len(waits) > 1 and all(w.op == "call_function" and w.target is patterns.WAIT for w in waits):
            position = {n: i for i, n in enumerate(graph.nodes)}
            first, *later = sorted(waits, key=position.__getitem__)
            for w in later:
                w.replace_all_uses_with(first)
                graph.erase_node(w)


def rewrite_graph(graph: Graph, agree: bool = True, pin: bool = False) -> Report:
    """Rewrite ``graph`` in place (see the module doc), place its calls and waits
    (:func:`tide.compile.schedule.place`, ``TIDE_COMPILE_PREFETCH`` buckets ahead) and agree on the issue
    order with the ranks of each group it names (``agree``); ``pin``: make that order the only one Inductor
    may issue (:func:`tide.compile.schedule.pin`; Inductor's post-grad graphs). Returns what was rewritten and
    what was left to stock, and why."""
    _merge_repeated_waits(graph)
    position = {n: i for i, n in enumerate(graph.nodes)}
    found = [f for f in map(patterns.classify, graph.nodes) if f is not None]
    matches = [f for f in found if isinstance(f, patterns.Match)]
    stock = [f for f in found if isinstance(f, patterns.Stock)]
    plan = planning.buckets(matches, position)
    report = Report()
    calls = []
    for bucket in plan:
        calls.append((_gather if bucket.kind == "all_gather" else _scatter)(graph, bucket, position, report))
        report.count(bucket.kind, "buckets")
        report.count(bucket.kind, "tide", len(bucket.members))
    for s in stock:
        report.count(s.kind, f"stock:{s.reason}")
    report.glue_removed = _erase_unused(graph, [n for m in matches if m.kind == "reduce_scatter" for n in m.glue])
    stable_topological_sort(graph)
    report.depth = schedule.prefetch_depth()
    schedule.place(graph, calls, report.depth)
    plan_entries = planning.entries(schedule.issue_order(graph), {c.start: c.bucket for c in calls},
                                    {s.node: s for s in stock})
    report.plan = planning.describe(plan_entries)
    report.digest = planning.digest(report.plan)
    if agree:
        planning.agree(plan_entries)
    if pin:
        report.pins = schedule.pin(graph, calls)
    graph.lint()
    record(report)
    return report


def rewrite(gm: GraphModule, agree: bool = True) -> Report:
    """:func:`rewrite_graph` on ``gm.graph``, then recompile ``gm`` (make_fx graphs, GraphTrainer's pipeline:
    their FX order is what runs, so the placement needs no pinning)."""
    report = rewrite_graph(gm.graph, agree)
    gm.recompile()
    return report
