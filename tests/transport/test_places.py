"""Where an arena puts a group's all-gather outputs (``Arena._places``, ``bound_slot``, ``bind_outputs``'
checks): pure host logic, checked on CPU tensors with an arena built without its rendezvous (the
rendezvous and the binding itself need GPUs: tests/cuda)."""
import pytest
import torch

from tide.meta import plans
from tide.transport.arena import Arena


def _arena(slot_bytes: int) -> Arena:
    arena = Arena.__new__(Arena)  # no rendezvous: only the layout bookkeeping below is exercised
    arena._bind_places, arena.slot_bytes, arena.num_slots, arena.world_size = {}, slot_bytes, 2, 2
    return arena


def test_places_follow_the_group_layout_of_its_own_world_size():
    outs = [torch.empty(4 * 12, dtype=torch.bfloat16), torch.empty(4 * 5), torch.empty(4 * 3, dtype=torch.float16)]
    for W in (2, 4):
        offsets, nbytes, need = _arena(1 << 20)._places(outs, W)
        layout = plans.all_gather_layout([(o.numel() // W,) for o in outs], [o.dtype for o in outs], W)
        assert offsets == [p.slot_offset for p in layout.params] and need == layout.slot_bytes
        assert nbytes == [o.numel() * o.element_size() for o in outs]
    assert _arena(1 << 20)._places([torch.empty(6)], 4) is None  # 6 elements are no 4 * c


def test_bind_outputs_refuses_before_binding_anything():
    with pytest.raises(ValueError, match=r"tide\.transport\.bind_outputs: outputs must have W\*c elements \(W = 4\)"):
        _arena(1 << 20).bind_outputs([torch.empty(6)], 0, world_size=4)
    with pytest.raises(ValueError, match=r"tide\.transport\.bind_outputs: group needs \d+ slot bytes, the arena has 64"):
        _arena(64).bind_outputs([torch.empty(64)], 0)
    with pytest.raises(ValueError, match=r"tide\.transport\.bind_outputs: slot must be in \[0, 2\), got 2"):
        _arena(1 << 20).bind_outputs([torch.empty(64)], 2)


def test_bound_slot_finds_outputs_at_their_places_only():
    from types import SimpleNamespace

    slot_bytes = 4096
    arena = _arena(slot_bytes)
    region = torch.zeros(3 * slot_bytes, dtype=torch.uint8)  # two slots, then the ring
    arena.slots_off, arena.ring_off, arena.leases = 0, 2 * slot_bytes, SimpleNamespace(held=region)
    dtypes, numels = [torch.bfloat16, torch.float32], [4 * 10, 4 * 7]
    offsets, nbytes, _ = arena._places([torch.empty(n, dtype=d) for n, d in zip(numels, dtypes)], 4)

    def at(slot, shift=0):
        base = slot * slot_bytes + shift
        return [region[base + o:base + o + b].view(d) for o, b, d in zip(offsets, nbytes, dtypes)]

    assert arena.bound_slot(at(0), 4) == 0 and arena.bound_slot(at(1), 4) == 1
    assert arena.bound_slot(at(1, shift=16), 4) is None  # in a slot, not at the group's places
    assert arena.bound_slot(at(0)[::-1], 4) is None  # the same tensors as another group's: other places
    assert arena.bound_slot([region[2 * slot_bytes:2 * slot_bytes + 80].view(torch.bfloat16)], 4) is None  # ring
    assert arena.bound_slot([torch.empty(4 * 2000)], 4) is None  # outside the region
    # An empty output has no address of its own: it neither places nor unplaces its group.
    outs = [torch.empty(0, dtype=torch.bfloat16), torch.empty(4 * 7)]
    offsets, nbytes, _ = arena._places(outs, 4)
    outs[1] = region[slot_bytes + offsets[1]:slot_bytes + offsets[1] + nbytes[1]].view(torch.float32)
    assert arena.bound_slot(outs, 4) == 1 and arena.bound_slot(outs[:1], 4) is None
