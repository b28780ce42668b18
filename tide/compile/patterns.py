"""The FX matchers: the only module that knows how DTensor lowers a ``Shard(0)`` <-> ``Replicate`` redistribute
(SimpleFSDP) into functional c10d collectives, as aot_eager, Inductor's post-grad graph and make_fx show it.

All-gather (forward, and the recompute of activation checkpointing)::

    [_to_copy | convert_element_type (param dtype)] -> [constant_pad_nd (short ranks only)]
        -> _c10d_functional.all_gather_into_tensor(x, W, group) -> wait_tensor -> [slice (short ranks only)]

Reduce-scatter (backward)::

    grad -> [_to_copy | convert_element_type (reduce dtype), of the whole unsharded grad]
        -> [split(c) -> getitem_i -> [constant_pad_nd] -> cat (uneven d0 only)]
        -> _c10d_functional.reduce_scatter_tensor(x, 'sum' | 'avg', W, group) -> wait_tensor -> [slice]

Every other c10d collective is :class:`Stock` with a reason. The pad before the all-gather and the slices
after the waits exist only on ranks whose shard is short, so nothing a match reports depends on them.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from tide.meta.checks import FLOAT_DTYPES

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
ALL_GATHER, REDUCE_SCATTER, WAIT = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
                                    c10d.wait_tensor.default)
CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}
# Collectives the pass knows of but never serves (HSDP's replicate reduction, coalesced or bucketed forms).
OTHER_COLLECTIVES = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_gather_into_tensor_coalesced": "coalesced",
    "reduce_scatter_tensor_coalesced": "coalesced", "all_gather_into_tensor_out": "out_variant",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}


@dataclass
class Stock:
    """A c10d collective the pass leaves as it is, and why."""

    node: Node
    kind: str
    reason: str


@dataclass
class Match:
    """A collective the pass can serve. ``input`` is what TIDE's op takes for it: the all-gather's own
    (cast, padded) input, or the reduce-scatter's original unsharded gradient; ``source`` the first node of
    the chain; ``glue`` the nodes between ``source`` and the collective: the all-gather's cast and pad (moved
    up with its bucket's op) or the reduce-scatter's cast and pad (removed when nothing else reads them)."""

    kind: str
    collective: Node
    wait: Node
    input: Node
    source: Node
    world_size: int
    group_name: str
    module: str
    phase: str
    facts: tuple  # rank-invariant: (padded shard shape, dtype) or (grad shape, grad dtype, out dtype)
    scale: float = 1.0
    glue: list = field(default_factory=list)


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _is_static(t) -> bool:
    return all(isinstance(s, int) for s in t.shape)


def _target(node) -> object:
    return node.target if isinstance(node, Node) and node.op == "call_function" else None


def _cast_input(node):
    """The input of ``node`` when it is a float-to-float dtype cast (nothing else changed), else None."""
    if _target(node) not in CASTS or any(k not in ("dtype", "layout", "device") for k in node.kwargs):
        return None
    src, out = _val(node.args[0]), _val(node)
    if src is None or out is None or not (src.dtype.is_floating_point and out.dtype.is_floating_point):
        return None
    return node.args[0] if src.device == out.device and tuple(src.shape) == tuple(out.shape) else None


def _dim0_pad_input(node):
    """The input of ``node`` when it is a zero ``constant_pad_nd`` at the end of dim 0 only, else None."""
    if _target(node) is not aten.constant_pad_nd.default:
        return None
    pad, value = node.args[1], (node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0))
    src = _val(node.args[0])
    if src is None or value != 0 or len(pad) != 2 * src.dim() or any(pad[:-1]) or pad[-1] < 0:
        return None
    return node.args[0]


_GETATTR = re.compile(r"getattr\(([^()]*), '([^']+)'\)")
_ROOT = re.compile(r"^(?:[LG]\['[^']*'\]|self)")


def module_name(source: str) -> str:
    """A module path as Dynamo's ``nn_module_stack`` writes it (``L['model'].layers[0]._modules['attn']``,
    ``getattr(L['self'].h, '0')``) as a module name below the compiled frame's root (``layers.0.attn``)."""
    while _GETATTR.search(source):
        source = _GETATTR.sub(r"\1.\2", source)
    source = _ROOT.sub("", source)
    source = re.sub(r"\._modules\['([^']+)'\]", r".\1", source)
    source = re.sub(r"\[(\d+)\]|\['([^']+)'\]", lambda m: "." + (m.group(1) or m.group(2)), source)
    return source.strip(".")


def block_of(name: str) -> str:
    """The block a module name lies in: its path through its first container index (``layers.3.attn.wo``,
    ``model.layers.3.mlp``: ``layers.3``, ``model.layers.3``); ``""`` for a module in no container
    (an embedding, a final norm, a head)."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return "" if index is None else ".".join(parts[:index + 1])


def module_of(node: Node) -> str:
    """The module a collective serves, by name: GraphTrainer's ``custom["module_fqn"]``, else the innermost
    entry of Dynamo's ``nn_module_stack`` (for a gradient: the forward's) as a :func:`module_name`, else ``""``."""
    custom = node.meta.get("custom") or {}
    if custom.get("module_fqn"):
        return str(custom["module_fqn"])
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    entries = list(stack.values())
    if not entries:
        return ""
    entry = entries[-1]
    return module_name(str(entry[0] if isinstance(entry, tuple) else entry))


def phase_of(node: Node) -> str:
    backward = node.meta.get("autograd_backward") or node.meta.get("partitioner_tag") == "is_backward"
    return "backward" if backward else "forward"


def _common(node: Node, kind: str):
    """(the wait, W, group) of a collective fit for TIDE, or the :class:`Stock` reason it is not."""
    world_size, group_name = node.args[-2], node.args[-1]
    out, src = _val(node), _val(node.args[0])
    if out is None or src is None:
        return Stock(node, kind, "no_meta")
    if not _is_static(out) or not _is_static(src):
        return Stock(node, kind, "dynamic_shape")
    if out.dtype not in FLOAT_DTYPES:  # the dtypes TIDE's ops take (bf16, fp16, fp32)
        return Stock(node, kind, "dtype")
    if world_size < 2:
        return Stock(node, kind, "group_size_1")
    users = list(node.users)
    if len(users) != 1 or _target(users[0]) is not WAIT:
        return Stock(node, kind, "collective_users")
    return users[0], world_size, group_name


def match_all_gather(node: Node) -> Match | Stock:
    common = _common(node, "all_gather")
    if isinstance(common, Stock):
        return common
    wait, world_size, group_name = common
    if any(_target(u) in SPLITS for u in wait.users):  # Shard(d != 0): chunked and concatenated on dim d
        return Stock(node, "all_gather", "shard_dim")
    x = node.args[0]
    unpadded = _dim0_pad_input(x) or x
    source = _cast_input(unpadded) or unpadded
    glue = [n for n in dict.fromkeys((unpadded, x)) if n is not source]
    shard = _val(x)
    return Match("all_gather", node, wait, x, source, world_size, group_name, module_of(node), phase_of(node),
                 (tuple(shard.shape), shard.dtype), glue=glue)


def _uneven_chunks(cat: Node, rows: int, world_size: int):
    """(the padded gradient, the glue nodes) when ``cat`` is DTensor's dim-0 padding of one tensor into
    ``world_size`` chunks of ``rows`` rows (split, pad of the short chunk, zero-padded empty chunks when
    d0 <= (W-1) * rows, cat), else None."""
    pieces = cat.args[0]
    if (len(cat.args) > 1 and cat.args[1] != 0) or len(pieces) != world_size:
        return None
    glue, split, empties = [cat], None, 0
    for i, piece in enumerate(pieces):
        padded = _dim0_pad_input(piece)
        item = padded if padded is not None else piece
        if _val(piece).shape[0] != rows:
            return None
        if padded is not None and split is not None and _val(padded).shape[0] == 0:  # an empty chunk
            glue += [piece, padded]
            empties += 1
            continue
        if (empties or _target(item) is not operator.getitem or item.args[1] != i
                or (split is not None and item.args[0] is not split)):
            return None
        split = item.args[0]
        glue += [piece, item] if padded is not None else [item]
    if _target(split) is not aten.split.Tensor or split.args[1] != rows or (len(split.args) > 2 and split.args[2]):
        return None
    return split.args[0], glue + [split]


def match_reduce_scatter(node: Node) -> Match | Stock:
    common = _common(node, "reduce_scatter")
    if isinstance(common, Stock):
        return common
    wait, world_size, group_name = common
    if node.args[1] not in ("sum", "avg"):
        return Stock(node, "reduce_scatter", "reduce_op")
    x, out = node.args[0], _val(node)
    rows, glue = out.shape[0], []
    if _target(x) is aten.cat.default:
        chunks = _uneven_chunks(x, rows, world_size)
        if chunks is None:
            return Stock(node, "reduce_scatter", "input_shape")
        x, glue = chunks
    grad = _cast_input(x)
    if grad is not None:
        glue.append(x)
    else:
        grad = x
    g = _val(grad)
    if g is None or g.dtype not in FLOAT_DTYPES or g.dim() == 0:
        return Stock(node, "reduce_scatter", "input_shape")
    if -(-g.shape[0] // world_size) != rows:  # not ceil(d0 / W) rows per rank
        return Stock(node, "reduce_scatter", "input_shape")
    if _val(x).shape[1:] != out.shape[1:]:
        return Stock(node, "reduce_scatter", "input_shape")
    scale = 1.0 / world_size if node.args[1] == "avg" else 1.0
    return Match("reduce_scatter", node, wait, grad, grad, world_size, group_name, module_of(node), phase_of(node),
                 (tuple(g.shape), g.dtype, out.dtype), scale, glue)


def classify(node: Node) -> Match | Stock | None:
    """A match, a stock collective with its reason, or None for a node that is no c10d collective."""
    if node.op != "call_function":
        return None
    if node.target is ALL_GATHER:
        return match_all_gather(node)
    if node.target is REDUCE_SCATTER:
        return match_reduce_scatter(node)
    name = getattr(node.target, "_schema", None) and node.target._schema.name
    if name and name.startswith("_c10d_functional::"):
        op = name.split("::", 1)[1]
        if op in OTHER_COLLECTIVES:
            return Stock(node, op, OTHER_COLLECTIVES[op])
    return None
