"""``enable()`` / ``disable()``: TIDE's rewrite as an Inductor post-grad pass, so that a model compiled by
``torch.compile`` after ``enable()`` gets TIDE's collectives. The pass runs in
``torch._inductor.config.post_grad_custom_post_pass``, before Inductor's own bucketing and overlap passes
(they then find no FSDP collective to bucket). A pass already set there is kept: both run, the user's first.

Importing this module also gives ``tide::all_gather_start`` an Inductor lowering of its own: the op's fallback
kernel, whose outputs Inductor never reuses for a later buffer of the same size. On CUDA those outputs lie in
an arena slot, held until they die (tide/transport/graph_gather.py); reused, an output would live on as an
activation (even one saved for the backward) and hold its slot long after its last reader.
"""
from __future__ import annotations

import torch
from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.lowering import fallback_handler, register_lowering
from torch._inductor.virtualized import V

from tide.compile.rewriter import rewrite_graph

_previous: list = []  # the config value each enable() replaced, innermost last

_gather_fallback = fallback_handler(torch.ops.tide.all_gather_start.default, add_to_fallback_set=False)


@register_lowering(torch.ops.tide.all_gather_start.default, type_promotion_kind=None)
def _all_gather_start_unshared(shards, world_size, group_name):
    outs = _gather_fallback(shards, world_size, group_name)
    for out in outs:
        V.graph.never_reuse_buffers.add(out.get_name())
    return outs


class TidePass(CustomGraphPass):
    """The rewrite of ``tide.compile.rewrite_graph`` on Inductor's post-grad graph."""

    def __call__(self, graph) -> None:
        rewrite_graph(graph)

    def uuid(self) -> None:
        # No key: Inductor then bypasses its FX graph cache for graphs compiled with the pass. A cache hit
        # skips the pass, and with it the plan's exchange between the ranks: a rank served from the cache
        # while a peer compiles leaves that peer waiting for it (the ranks' graphs differ with uneven
        # shards, so their cache entries differ too).
        return None


def _as_tuple(value) -> tuple:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def enable() -> TidePass:
    """Append TIDE's pass to ``post_grad_custom_post_pass`` (a list of passes when one was set) and return it."""
    tide_pass = TidePass()
    previous = config.post_grad_custom_post_pass
    _previous.append(previous)
    passes = _as_tuple(previous) + (tide_pass,)
    config.post_grad_custom_post_pass = passes[0] if len(passes) == 1 else list(passes)
    return tide_pass


def disable() -> None:
    """Restore ``post_grad_custom_post_pass`` to what the matching :func:`enable` found."""
    if not _previous:
        raise RuntimeError("tide.compile.disable: TIDE's pass is not enabled")
    config.post_grad_custom_post_pass = _previous.pop()


def enabled() -> bool:
    return any(isinstance(p, TidePass) for p in _as_tuple(config.post_grad_custom_post_pass))
