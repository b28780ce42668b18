"""The gatekeeper (csrc/transport/gate.h) and the one rule of where outputs lie (``slot_of``,
``outputs_slot``, ``placed_slot``: csrc/transport/arena.h), asked directly on a one-rank extension arena:
each verdict in the table's order, as the ops' C++ kernels see it, and what the Python kernels act on."""
import pytest
import torch

from tide.meta import plans
from tide.ops import cuda as cuda_ops

SLOT_BYTES, SLOTS = 1 << 16, 2


@pytest.fixture
def arena(ext):
    flags = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    a = ext.Arena(rank=0, world=1, flag_bases=[flags.data_ptr()], device=torch.cuda.current_device(), num_slots=SLOTS,
                  slot_bytes=SLOT_BYTES, ring_depth=1, entry_bytes=1 << 12, sum_ctas=1, cast_ctas=1)
    yield a  # the fixture's frame keeps the flag words alive while the arena lives
    ext.forget_arena(arena=a)
    del a, flags


def _lease(a, context=0):
    region = torch.empty(SLOTS * SLOT_BYTES + (1 << 12), dtype=torch.uint8, device="cuda")
    a.set_region(region=region, bases=[region.data_ptr()], context=context)
    return region


def _outputs_at(region, slot, shards, shift=0):
    layout = plans.all_gather_layout([s.shape for s in shards], [s.dtype for s in shards], 1)
    base = slot * SLOT_BYTES + shift
    return [region[base + p.slot_offset:base + p.slot_offset + p.out_bytes].view(s.dtype)
            for p, s in zip(layout.params, shards)], layout


def _keep_plan(ext, a, shards, outs, layout):
    info = plans.ag_plan_info(layout, 0)
    a.keep_ag_plan(shards=shards, outs=outs, plan=ext.AgPlan(
        own_offset=info.own_offset, out_offset=info.out_offset, out_numel=info.out_numel,
        out_dtype=[o.dtype for o in outs], slot_bytes=layout.slot_bytes,
        chunks=[[ext.ShardRange(**r._asdict()) for r in chunk] for chunk in info.chunks]))


def test_outputs_lie_where_the_one_rule_says(ext, arena):
    shards = [torch.randn(40, device="cuda", dtype=torch.bfloat16), torch.randn(28, device="cuda")]
    assert arena.slot_of(ptr=shards[0].data_ptr()) == -1  # no region leased
    region = _lease(arena)
    outs, layout = _outputs_at(region, 1, shards)
    offsets = [p.slot_offset for p in layout.params]
    assert arena.slot_of(ptr=outs[0].data_ptr()) == 1 and arena.outputs_slot(outs=outs) == 1
    assert arena.placed_slot(outs=outs, offsets=offsets, need=layout.slot_bytes) == 1
    shifted, _ = _outputs_at(region, 1, shards, shift=16)
    assert arena.placed_slot(outs=shifted, offsets=offsets, need=layout.slot_bytes) == -1  # in a slot, off its places
    assert arena.placed_slot(outs=outs[::-1], offsets=offsets, need=layout.slot_bytes) == -1  # another group's places
    assert arena.placed_slot(outs=outs, offsets=offsets, need=SLOT_BYTES + 16) == -1  # the group fits no slot
    ring = region[SLOTS * SLOT_BYTES:SLOTS * SLOT_BYTES + 64]
    assert arena.slot_of(ptr=ring.data_ptr()) == -1 and arena.slot_of(ptr=shards[0].data_ptr()) == -1
    empty = [torch.empty(0, device="cuda"), outs[1]]  # an empty output has no address: it neither places nor unplaces
    assert arena.placed_slot(outs=empty, offsets=offsets, need=layout.slot_bytes) == 1
    assert arena.outputs_slot(outs=[torch.empty(0, device="cuda")]) == 0  # all empty: slot 0 of a held region


def test_the_gate_gives_each_verdict_in_its_tables_order(ext, arena):
    assert ext.verdicts() == list(cuda_ops.VERDICTS)  # Python acts on exactly the built gate's verdicts
    shards = [torch.randn(40, device="cuda", dtype=torch.bfloat16), torch.randn(28, device="cuda")]
    free = [torch.empty(40, device="cuda", dtype=torch.bfloat16), torch.empty(28, device="cuda")]
    grads = [torch.randn(40, device="cuda", dtype=torch.bfloat16)]
    shard_grads = [torch.empty(40, device="cuda")]

    def ag(outs, world=1, name="gate-test"):
        return ext.gate_all_gather(shards=shards, outs=outs, world_size=world, group_name=name)[0]

    def rs():
        return ext.gate_reduce_scatter(grads=grads, shard_grads=shard_grads, world_size=1, group_name="gate-test")[0]

    assert ag(free) == "no_arena" and rs() == "no_arena"
    ext.bind_group(group_name="gate-test", arena=arena, world_size=1)
    assert ag(free, world=2) == "world_size"
    with torch.enable_grad():
        assert ag([free[0].requires_grad_(), free[1]]) == "grad"
    free[0].requires_grad_(False)
    assert ag(free) == "outputs_not_in_slot" and rs() == "no_lease"  # no region: no slot
    region = _lease(arena)
    assert ag(free) == "outputs_not_in_slot" and rs() == "no_plan"
    outs, layout = _outputs_at(region, 0, shards)
    assert ag(outs) == "no_plan"
    _keep_plan(ext, arena, shards, outs, layout)
    verdict, bound, plan, slot = ext.gate_all_gather(shards=shards, outs=outs, world_size=1, group_name="gate-test")
    assert (verdict, bound, slot) == ("transport", arena, 0) and plan.slot_bytes == layout.slot_bytes  # for Python
    shifted, _ = _outputs_at(region, 0, shards, shift=16)
    assert ag(shifted) == "outputs_not_in_slot"  # the plan's places decide, not the slot alone
    symmetric = _lease(arena, context=ext.EVERY_CONTEXT)  # a symmetric region belongs to every context
    everywhere, _ = _outputs_at(symmetric, 0, shards)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = ag(everywhere)
        _lease(arena)  # (set_region is host work) an eager lease may not be baked into the graph
        across = ag(outs)
    assert (captured, across) == ("capturing", "lease_across_capture")
    region = _lease(arena, context=12345)  # leased inside some capture: eager work may not use it
    outs, _ = _outputs_at(region, 0, shards)
    assert ag(outs) == "lease_across_capture"
    ext.forget_arena(arena=arena)
    assert ag(outs) == "no_arena"
