"""The bucket plan of one graph, from rank-invariant facts only, and its agreement among each group's ranks.

A rank's graph differs from its peers' where its shard is short (a pad before the all-gather, slices after
the waits), so the plan reads none of that: per collective only its kind, module name, phase, group,
world size and the shapes and dtypes every rank sees alike (an all-gather's padded shard, a
reduce-scatter's unpadded gradient and output dtype), in graph order. A bucket is a run of consecutive
matches of one kind (the other kind's collectives may lie between) with the same block, phase, group and,
for reduce-scatters, the same scale and output dtype. A block is what a user calls one: a container's child
(``layers.3``, ``model.layers.3``: :func:`tide.compile.patterns.block_of`), whatever the nesting above it.
Collectives of modules in no block (an embedding, a final norm and a head) bucket with the same module's
(a head read once per chunk of a chunked loss) and with those that no matmul separates from them (a final
norm and a head). An all-gather whose shard is produced after its bucket's first collective
starts a new bucket.
"""
from __future__ import annotations

import bisect
import hashlib
from collections import Counter
from dataclasses import dataclass, field

import torch

from tide import agreement, timeouts
from tide.compile.patterns import Match, block_of
from tide.ops import call_groups
from tide.ops.calls import resolve_group

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
           aten.convolution_backward.default, aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default}


@dataclass
class Bucket:
    kind: str
    module: str
    phase: str
    group_name: str
    world_size: int
    members: list[Match] = field(default_factory=list)

    def describe(self) -> str:
        facts = ", ".join(_fact(m) for m in self.members)
        return f"{self.kind} {self.phase} {self.name()} on {self.group_name}/{self.world_size}: [{facts}]"

    def name(self) -> str:
        """The block, else the modules the bucket serves (``norm+output``), else ``-``."""
        return self.module or "+".join(dict.fromkeys(m.module for m in self.members if m.module)) or "-"


def _dtype(d) -> str:
    return str(d).removeprefix("torch.")


def _fact(m: Match) -> str:
    if m.kind == "all_gather":
        shape, dtype = m.facts
        return f"{shape} {_dtype(dtype)}"
    shape, dtype, out_dtype = m.facts
    return f"{shape} {_dtype(dtype)}->{_dtype(out_dtype)} x{m.scale:g}"


def _key(m: Match) -> tuple:
    extra = (m.scale, m.facts[2]) if m.kind == "reduce_scatter" else ()
    return (block_of(m.module), m.phase, m.group_name, m.world_size, *extra)


def buckets(matches: list[Match], position: dict) -> list[Bucket]:
    """The buckets of ``matches`` (in graph order); ``position`` numbers the graph's nodes in order."""
    out: list[Bucket] = []
    open_bucket: dict[str, tuple] = {}  # kind -> (key, bucket) of the run in progress
    matmuls = sorted(i for n, i in position.items() if n.op == "call_function" and n.target in MATMULS)
    for m in matches:
        key, run = _key(m), open_bucket.get(m.kind)
        fits = run is not None and run[0] == key
        if fits and m.kind == "all_gather":
            fits = position[m.source] < position[run[1].members[0].collective]
        if fits and not key[0]:  # in no block: the same module's, or a run of collectives between two matmuls
            last = run[1].members[-1]
            fits = (bool(m.module) and m.module == last.module
                    or bisect.bisect(matmuls, position[last.collective])
                    == bisect.bisect(matmuls, position[m.collective]))
        if not fits:
            run = (key, Bucket(m.kind, key[0], m.phase, m.group_name, m.world_size))
            open_bucket[m.kind] = run
            out.append(run[1])
        run[1].members.append(m)
    return out


def entries(issue_order: list, buckets: dict, stock: dict) -> list[tuple[str, str]]:
    """(group name, one line) per collective of ``issue_order`` (:func:`tide.compile.schedule.issue_order`):
    a TIDE call's bucket (``buckets``: call node -> :class:`Bucket`), a collective left to stock with its
    reason (``stock``: node -> :class:`Stock`), or another collective's op. The same on every rank whose graph
    holds the same collectives in the same order."""
    rows = []
    for node in issue_order:
        if node in buckets:
            rows.append((buckets[node].group_name, buckets[node].describe()))
        elif node in stock:
            rows.append((str(node.args[-1]), f"{stock[node].kind} stock:{stock[node].reason}"))
        else:
            rows.append((str(node.args[-1]), f"{node.target._schema.name} stock"))
    return rows


def describe(plan_entries: list[tuple[str, str]]) -> str:
    return "\n".join(line for _, line in plan_entries)


def digest(description: str) -> str:
    return hashlib.sha256(description.encode()).hexdigest()[:16]


_agreements: Counter = Counter()  # group name -> plans agreed on it (numbers the store keys: its ranks compile alike)


def _missing(store, base: str, n: int, world_size: int, timeout_s: float, what: str) -> str:
    """Why peers never published plan ``n``: each one's last plan on the group, in words."""
    latest = {}
    for p in range(world_size):
        key = f"{base}/latest/{p}"
        latest[p] = int(store.get(key)) if store.check([key]) else 0
    here = [p for p, k in latest.items() if k >= n]
    causes = []
    for p, k in latest.items():
        if k >= n:
            continue
        if k == 0:
            causes.append(f"rank {p} never ran TIDE's pass on this group (tide.compile.enable() was not called "
                          "there, or its graph was compiled before enable())")
        else:
            causes.append(f"rank {p} agreed {k} plan(s) and is not compiling this graph: a recompile on rank(s) "
                          f"{here} only (their guards failed where rank {p}'s held, e.g. a shape or a Python value "
                          "only they changed)")
    return (f"{what}: rank(s) {[p for p, k in latest.items() if k < n]} did not reach plan #{n} within "
            f"{timeout_s:g} s: " + "; ".join(causes))


def agree(plan_entries: list[tuple[str, str]]) -> None:
    """Check that every rank of each group in the plan planned the same for that group, through the default
    store; raises ``RuntimeError`` on every rank of a group, naming the first entry that differs, when one of
    its ranks planned otherwise (and after the group's timeout when a rank never got here). Without a
    default process group there is nobody to agree with."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    for group_name in sorted({g for g, _ in plan_entries}):
        mine = describe([entry for entry in plan_entries if entry[0] == group_name])
        _agree_on(resolve_group("compile.rewrite", group_name), mine)


def _agree_on(group, description: str) -> None:
    import torch.distributed as dist

    if group.size() < 2:
        return
    _agreements[group.group_name] += 1
    n = _agreements[group.group_name]
    base = f"tide/compile/{call_groups.restart_count()}/{group.group_name}"
    rank, what = group.rank(), f"tide.compile.rewrite: the bucket plan on group {group.group_name!r}"
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{base}/latest/{rank}", str(n))  # how far this rank got: its peers' error names what is missing
    timeout_s = timeouts.timeout_for(group)
    try:
        plans = agreement.exchange(store, f"{base}/plan{n}", rank, group.size(), description, timeout_s, what)
    except RuntimeError:
        raise RuntimeError(_missing(store, base, n, group.size(), timeout_s, what)) from None
    for peer, theirs in enumerate(plans):
        if theirs != description:
            mine_lines, their_lines = description.split("\n"), theirs.split("\n")
            i = next((k for k, (a, b) in enumerate(zip(mine_lines, their_lines)) if a != b),
                     min(len(mine_lines), len(their_lines)))
            line = lambda lines: lines[i] if i < len(lines) else "(nothing)"  # noqa: E731
            raise RuntimeError(f"{what} of rank {rank} (digest {digest(description)}) differs from rank {peer}'s "
                               f"(digest {digest(theirs)}) at plan entry {i}: {line(mine_lines)!r} here, "
                               f"{line(their_lines)!r} there; the ranks' graphs differ beyond their shards' padding")
