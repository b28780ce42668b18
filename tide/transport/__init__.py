"""TIDE's CUDA transport inside one NVLink domain: an arena per set of ranks (symmetric flag words, a data
region leased per phase from the caching allocator), TIDE-AG (copy-engine
copies + stream-memop flags, one kernel for the own shard) and TIDE-RS (copy-engine pushes into a bounded
staging ring, a bounded-grid fp32 summing kernel). See docs/design.md ("CUDA transport").

Importing this package builds nothing and needs no GPU: the extension is compiled on first use
(:func:`tide.extension.load`, or ahead of time with ``python -m tide.extension``).

    enable(group, slot_bytes=... | layouts=[...]) -> Arena    (collective, once per set of ranks)
    get(group_name) -> Arena | None                            (the arena of a group's ranks: its route's)
    Arena.bind_outputs(outs, slot)                             (FSDP's all-gather outputs into a slot)
    Arena.slots                                                (the slot leases)
    disable(group_name)                                        (releases the arena's memory)
    all_gather.new_plan / issue_call(arena, shards, outs, ...) (TIDE-AG's driver: all_gather.py)
    reduce_scatter.new_plan / issue_call(arena, grads, ...)    (TIDE-RS's driver: reduce_scatter.py)
    node_leg.enable(group, slot_bytes=...) -> Arena            (a multi-node group's node arena: node_leg.py)
"""
from tide.transport.arena import Arena  # noqa: F401
from tide.transport.serving import arenas, disable, enable, get  # noqa: F401

__all__ = ["Arena", "enable", "disable", "get", "arenas"]
