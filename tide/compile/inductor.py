"""``enable()`` / ``disable()``: TIDE's rewrite as an Inductor post-grad pass, so that a model compiled by
``torch.compile`` after ``enable()`` gets TIDE's collectives. The pass runs in
``torch._inductor.config.post_grad_custom_post_pass``, before Inductor's own bucketing and overlap passes
(they then find no FSDP collective to bucket). A pass already set there is kept: both run, the user's first
(in a :class:`PassChain`: torch 2.11 takes one pass there, not a list).
On Inductor's graphs the pass also pins the order it placed (tide/compile/schedule.py), so Inductor's
scheduler issues TIDE's calls and the collectives beside them in that order on every rank, and its
``simple_overlap`` (torch 2.14+) may sink a wait but never move a collective past another: it stays on.

Importing this module also gives the graph ops Inductor lowerings of their own: the ops' fallback kernels,
with buffers Inductor never reuses for a later buffer of the same size:

- their inputs: on CUDA the call reads them on a stream of its own until its wait
  (tide/ops/works.py); reused by the compute stream before then, they would be overwritten mid-transfer;
- ``all_gather_start``'s outputs: on CUDA they lie in an arena slot, held until they die
  (tide/transport/graph_gather.py); reused, an output would live on as an activation (even one saved for the
  backward) and hold its slot long after its last reader.
"""
from __future__ import annotations

import logging
import warnings

import torch
from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.lowering import fallback_handler, register_lowering
from torch._inductor.virtualized import V

from tide.compile.rewriter import rewrite_graph

log = logging.getLogger("tide")

_previous: list = []  # the config value the enable() in force replaced (one at most: enable() is idempotent)

_gather_fallback = fallback_handler(torch.ops.tide.all_gather_start.default, add_to_fallback_set=False)
_scatter_fallback = fallback_handler(torch.ops.tide.reduce_scatter_start.default, add_to_fallback_set=False)


def _never_reuse(buffers) -> None:
    for buffer in buffers:
        V.graph.never_reuse_buffers.add(buffer.get_name())


@register_lowering(torch.ops.tide.all_gather_start.default, type_promotion_kind=None)
def _all_gather_start_unshared(shards, world_size, group_name):
    outs = _gather_fallback(shards, world_size, group_name)
    _never_reuse(list(shards) + list(outs))
    return outs


@register_lowering(torch.ops.tide.reduce_scatter_start.default, type_promotion_kind=None)
def _reduce_scatter_start_unshared(grads, scale, out_dtype, world_size, group_name):
    outs = _scatter_fallback(grads, scale, out_dtype, world_size, group_name)
    _never_reuse(grads)
    return outs


class TidePass(CustomGraphPass):
    """The rewrite of ``tide.compile.rewrite_graph`` on Inductor's post-grad graph, its order pinned."""

    def __call__(self, graph) -> None:
        rewrite_graph(graph, pin=True)

    def uuid(self) -> None:
        # No key: Inductor then bypasses its FX graph cache for graphs compiled with the pass. A cache hit
        # skips the pass, and with it the plan's exchange between the ranks: a rank served from the cache
        # while a peer compiles leaves that peer waiting for it (the ranks' graphs differ with uneven
        # shards, so their cache entries differ too).
        return None


class PassChain(CustomGraphPass):
    """Several post-grad passes as one, run in order (torch 2.11 takes one pass there, not a list)."""

    def __init__(self, passes) -> None:
        self.passes = list(passes)

    def __call__(self, graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self):
        keys = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes]
        return None if any(k is None for k in keys) else repr(keys).encode()


def _as_tuple(value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, PassChain):
        return tuple(value.passes)
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _compiled_frames() -> int:
    """Frames Dynamo has compiled and still holds (``torch._dynamo.reset()`` drops them; Dynamo's graph counters
    are never reset, so they cannot tell)."""
    from torch._dynamo import convert_frame

    return len(convert_frame.output_codes.seen_ids)


def enable() -> TidePass:
    """Append TIDE's pass to ``post_grad_custom_post_pass`` (a :class:`PassChain` after the passes set there) and
    return it; when it is there already, return that one. Frames compiled before (and not dropped by
    ``torch._dynamo.reset()``) keep stock's collectives until they are compiled again: warned."""
    current = next((p for p in _as_tuple(config.post_grad_custom_post_pass) if isinstance(p, TidePass)), None)
    if current is not None:
        return current
    if _compiled_frames():
        warnings.warn(f"tide.compile.enable: {_compiled_frames()} frame(s) were compiled before TIDE's pass was "
                      "enabled; they keep stock's collectives until compiled again (torch._dynamo.reset(), then "
                      "compile)", stacklevel=2)
    tide_pass = TidePass()
    previous = config.post_grad_custom_post_pass
    _previous.append(previous)
    passes = _as_tuple(previous) + (tide_pass,)
    config.post_grad_custom_post_pass = passes[0] if len(passes) == 1 else PassChain(passes)
    log.info("tide.compile.enable: TIDE's pass joins Inductor's post-grad passes (%d in all)", len(passes))
    return tide_pass


def disable() -> None:
    """Restore ``post_grad_custom_post_pass`` to what :func:`enable` found."""
    if not _previous:
        raise RuntimeError("tide.compile.disable: TIDE's pass is not enabled")
    config.post_grad_custom_post_pass = _previous.pop()


def enabled() -> bool:
    return any(isinstance(p, TidePass) for p in _as_tuple(config.post_grad_custom_post_pass))
