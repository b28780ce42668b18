"""Where an arena puts a group's all-gather outputs (``Arena._places``, ``bind_outputs``' checks): pure host
logic, checked on CPU tensors with an arena built without its rendezvous. Where outputs lie (the
extension's ``slot_of`` / ``placed_slot``, which ``bound_slot`` asks) and the binding itself need a GPU:
tests/cuda/test_gate_cuda.py."""
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
    with pytest.raises(ValueError,
                       match=r"tide\.transport\.bind_outputs: group needs \d+ slot bytes, the arena has 64"):
        _arena(64).bind_outputs([torch.empty(64)], 0)
    with pytest.raises(ValueError, match=r"tide\.transport\.bind_outputs: slot must be in \[0, 2\), got 2"):
        _arena(1 << 20).bind_outputs([torch.empty(64)], 2)
