"""TIDE-AG for the graph op ``all_gather_start``, which makes its own outputs: the peers' copy engines
write every shard straight into them (zero-copy, as for FSDP2's outputs), wherever they lie.

- **In a free arena slot** (``slot``): each output a storage of its own pointed into the slot. A compiled
  graph frees them after their last reader, and the slot is free again once every output of the call has
  died (:class:`tide.transport.slots.SlotLeases` holds their storages weakly).
- **On the direct lane** (``allocator``): with every slot held by live outputs, a call larger than a slot,
  or the slots' region leased outside the CUDA-graph capture in progress, the outputs come from the
  caching allocator, leased for this call and mapped by the peers
  (:func:`tide.transport.all_gather.all_gather_direct`).

The graph is the same on every rank (its plan is agreed, tide/compile/plan.py), so every rank acquires
and frees slots in the same order, chooses the same slot for each call and takes the direct lane at the
same calls, as the push needs.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tide.meta import plans
from tide.transport import all_gather


def gather(arena, shards: Sequence[torch.Tensor], world_size: int,
           group_name: str) -> tuple[list[torch.Tensor], str] | None:
    """The unsharded ``(W * c_i, *rest)`` outputs of ``shards`` (checked, contiguous), gathered by the
    transport, and where they lie: ``slot``, ``allocator:<why no slot>`` (``slot_too_small``, ``no_free_slot``,
    ``lease_across_capture``) or ``empty`` (every shard empty); None when the direct lane cannot take them
    either (the ranks cannot export allocator memory; nothing issued)."""
    if not any(s.numel() for s in shards):  # nothing to move
        return [s.new_empty((world_size * s.shape[0], *s.shape[1:])) for s in shards], "empty"
    layout = plans.all_gather_layout([tuple(s.shape) for s in shards], [s.dtype for s in shards], world_size)
    if layout.slot_bytes > arena.slot_bytes:
        why = "slot_too_small"
    elif arena.leases.held_elsewhere():
        why = "lease_across_capture"
    else:
        slot = arena.slots.acquire()
        if slot is not None:
            return _into_slot(arena, shards, world_size, group_name, slot), "slot"
        why = "no_free_slot"
    flat = all_gather.all_gather_direct(arena, shards, layout)
    return None if flat is None else (_shaped(flat, shards, world_size), f"allocator:{why}")


def _into_slot(arena, shards, world_size: int, group_name: str, slot: int) -> list[torch.Tensor]:
    # Each output gets a storage of its own, pointed into the slot (the caching allocator's block it starts
    # with goes back at once); the slot is held while any of them lives.
    flat = [torch.empty(world_size * s.numel(), dtype=s.dtype, device=arena.device) for s in shards]
    arena.bind_outputs(flat, slot, world_size=world_size)
    torch.ops.tide.all_gather_into_params_(list(shards), flat, world_size, group_name)
    return _shaped(flat, shards, world_size)


def _shaped(flat, shards, world_size: int) -> list[torch.Tensor]:
    return [o.view(world_size * s.shape[0], *s.shape[1:]) for o, s in zip(flat, shards)]
