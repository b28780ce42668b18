"""TIDE-AG for the graph op ``all_gather_start``: its outputs made in a free arena slot, so that the peers'
copy engines write every shard straight into them (zero-copy, as for FSDP2's outputs).

A compiled graph owns these outputs: it frees them after their last reader, and the slot is free again
once every output of the call has died (:class:`tide.transport.slots.SlotLeases` holds their storages
weakly). The graph is the same on every rank (its plan is agreed, tide/compile/plan.py), so every rank
acquires and frees slots in the same order and chooses the same slot for each call, as the push needs.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tide.meta import plans


def gather_into_slot(arena, shards: Sequence[torch.Tensor], world_size: int,
                     group_name: str) -> list[torch.Tensor] | str:
    """The unsharded ``(W * c_i, *rest)`` outputs of ``shards`` (checked, contiguous), gathered by the
    transport into a free slot; or why not (nothing issued): ``slot_too_small`` (the call's outputs need more
    than a slot) or ``no_free_slot`` (outputs alive hold every slot)."""
    layout = plans.all_gather_layout([tuple(s.shape) for s in shards], [s.dtype for s in shards], world_size)
    if layout.slot_bytes > arena.slot_bytes:
        return "slot_too_small"
    slot = arena.slots.acquire()
    if slot is None:
        return "no_free_slot"
    arena.slots.wait(slot, torch.cuda.current_stream(arena.device))
    # Each output gets a storage of its own, pointed into the slot (the caching allocator's block it starts
    # with goes back at once); the slot is held while any of them lives.
    flat = [torch.empty(world_size * s.numel(), dtype=s.dtype, device=arena.device) for s in shards]
    arena.bind_outputs(flat, slot, world_size=world_size)
    torch.ops.tide.all_gather_into_params_(list(shards), flat, world_size, group_name)
    return [o.view(world_size * s.shape[0], *s.shape[1:]) for o, s in zip(flat, shards)]
