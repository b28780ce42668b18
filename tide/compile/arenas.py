"""The CUDA arenas TIDE's graph ops run on in compiled training.

``prepare(model)`` creates, on every rank and before the compiled model first runs (never under CUDA-graph
capture), the arena of each data-parallel group that the model's DTensor ``Shard(0)`` parameters are
sharded over. The plan buckets each block's collectives per call (``layers.3``, tide/compile/plan.py); the
arena has ``TIDE_COMPILE_PREFETCH`` + 1 slots (the buckets alive at once, tide/compile/schedule.py), each
fitting the largest block's all-gather, so ``all_gather_start`` gathers into a free slot with the copy
engines. A bucket of modules in no block larger than that (an embedding, a head) takes the arena's direct
lane: caching-allocator outputs of its own size, which the copy engines fill the same way, so the slots
are not sized for the largest matrix. Its staging ring fits one round of the largest reduce-scatter. A
group that already has an arena keeps it.

``release()`` gives every arena's leased data region back to the caching allocator (the regions of outputs
still alive stay until those die). Call it on every rank at the same point, after each optimizer step and
before capturing a step into a CUDA graph: a region held across a capture's boundary keeps the captured
all-gathers out of the slots (``allocator:lease_across_capture``: the direct lane serves them).
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from tide import routes
from tide.compile import schedule
from tide.compile.patterns import block_of
from tide.meta import plans

log = logging.getLogger("tide")

_prepared: list = []  # the arenas prepare() returned, which release() releases


def _sharded_params(model: nn.Module):
    """(group, unit, padded shard shape, world size, dtype) of every CUDA DTensor parameter sharded on dim 0;
    its unit is its block, else its module (``(False, name)``, ``(True, name)``)."""
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or p.device.type != "cuda":
            continue
        for dim, placement in enumerate(p.placements):
            if isinstance(placement, Shard) and placement.dim == 0:
                group = p.device_mesh.get_group(dim)
                W = group.size()
                shape = (math.ceil(p.shape[0] / W), *p.shape[1:]) if p.dim() else (1,)
                module = name.rpartition(".")[0]
                yield group, (bool(block_of(module)), block_of(module) or module), shape, W, p.dtype


def prepare(model: nn.Module, *, param_dtype: torch.dtype | None = None) -> list:
    """Create the arenas of ``model``'s data-parallel groups (collective: every rank of each group); return
    them. ``param_dtype``: the dtype parameters are gathered in (mixed precision), else their own. CPU
    parameters, and groups that span nodes (the reference backend's multi-node schedule serves them),
    get none."""
    from tide import transport

    units: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    groups = {}
    for group, unit, shape, W, dtype in _sharded_params(model):
        if W < 2 or routes.of(group).multinode:
            continue
        groups[group.group_name] = group
        units[group.group_name][unit].append((shape, param_dtype or dtype))
    made = []
    for name, group in groups.items():
        W = group.size()
        blocks = [u for (in_block, _), u in units[name].items() if in_block] or list(units[name].values())
        layouts = [plans.all_gather_layout([s for s, _ in u], [d for _, d in u], W) for u in blocks]
        pieces = [plans.rs_piece_bytes([math.prod(s) for s, _ in u], [d.itemsize for _, d in u])
                  for u in units[name].values()]
        arena = transport.get(name)
        if arena is None:
            arena = transport.enable(group, layouts=layouts, rs_piece_bytes=max(pieces),
                                     num_slots=schedule.prefetch_depth() + 1)
            log.info("tide.compile.prepare: created %r for %d blocks", arena, len(blocks))
        made.append(arena)
        if arena not in _prepared:
            _prepared.append(arena)
    return made


def release() -> None:
    """Give the leased data region of every arena :func:`prepare` returned back to the caching allocator
    (every rank at the same point); arenas closed since are forgotten."""
    _prepared[:] = [a for a in _prepared if a.native is not None]
    for arena in _prepared:
        arena.release()
