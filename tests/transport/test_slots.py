"""The arena's slot leases and the FSDP wiring's slot plan, driven on CPU by stand-ins for storages,
streams and the arena (the CUDA tests run the same code on the real transport)."""
import types

import torch

from tide.fsdp import fallbacks, shard_dims, wiring
from tide.fsdp.decide import AllGatherFacts, TideAllGather
from tide.transport.slots import SlotLeases


class Storage:
    """A bound output's storage: FSDP's reshard (``resize_(0)``) drops its pointer."""

    def __init__(self, ptr: int, nbytes: int = 64):
        self.ptr, self.size = ptr, nbytes

    def data_ptr(self):
        return self.ptr

    def nbytes(self):
        return self.size

    def reshard(self):
        self.ptr, self.size = 0, 0


def test_acquire_round_robin_skips_held_slots_and_reports_none_when_all_are_held():
    leases = SlotLeases(2)
    first, second = Storage(100), Storage(200)
    a = leases.acquire()
    leases.bind(a, [first])
    b = leases.acquire()
    assert (a, b) == (0, 1)
    leases.bind(b, [second])
    assert leases.held() == 2 and leases.acquire() is None
    first.reshard()  # FSDP resharded the first group
    assert not leases.is_held(a) and leases.acquire() == a


def test_a_slot_is_free_only_when_every_bound_storage_is_resharded():
    leases = SlotLeases(1)
    storages = [Storage(1), Storage(2)]
    leases.bind(leases.acquire(), storages)
    storages[0].reshard()
    assert leases.is_held(0) and leases.acquire() is None
    storages[1].reshard()
    assert leases.acquire() == 0


def test_a_storage_pointed_elsewhere_no_longer_holds_the_slot():
    leases = SlotLeases(1)
    st = Storage(1)
    leases.bind(leases.acquire(), [st])
    st.ptr = 999  # stock copy-out re-allocated it: not the slot any more
    assert not leases.is_held(0)


def test_a_slot_is_free_once_its_bound_storages_are_gone():
    """A compiled graph frees ``all_gather_start``'s outputs after their last reader: the slot frees with them,
    and the leases never keep a storage alive."""
    leases = SlotLeases(1)
    storages = [Storage(1), Storage(2)]
    leases.bind(leases.acquire(), storages)
    del storages[0]
    assert leases.is_held(0)
    del storages[0]
    assert not leases.is_held(0) and leases.acquire() == 0


def test_prefer_and_last_slot():
    leases = SlotLeases(2)
    owner, st = object(), Storage(1)
    leases.bind(leases.acquire(), [st], owners=[owner])
    assert leases.last_slot(owner) == 0 and leases.last_slot(object()) is None
    assert leases.acquire(prefer=0) == 1  # 0 is held
    st.reshard()
    assert leases.acquire(prefer=0) == 0


# ------------------------------------------------------------------------------------------ the FSDP plan
def _group(nparams=3, numel=1024, leaf=True, raf=True, shard_dim=0):
    params = [types.SimpleNamespace(_sharded_param_data=torch.empty(numel), param_dtype=torch.bfloat16,
                                    orig_dtype=torch.float32, fsdp_placement=types.SimpleNamespace(dim=0))
              for _ in range(nparams)]
    params[-1].fsdp_placement.dim = shard_dim
    group = types.SimpleNamespace(fsdp_params=params, post_forward_mesh_info=object() if raf else None)
    group._all_gather_comm = TideAllGather(group, leaf=leaf)
    return group


def _arena(slot_bytes):
    return types.SimpleNamespace(slots=SlotLeases(2), slot_bytes=slot_bytes)


def _unshard(arena, group, W=2):
    if not hasattr(group, "facts"):  # decided once per group, as tide.fsdp.decide keeps them
        group.facts = AllGatherFacts(group.fsdp_params, None, (), shard_dims.sharded(group.fsdp_params))
    mode, slot = wiring.plan_all_gather(arena, group._all_gather_comm, group.facts, W)
    if mode == "bound":
        group.storages = [Storage(1000 * (slot + 1) + i) for i in range(len(group.fsdp_params))]
        arena.slots.bind(slot, group.storages, owners=group.fsdp_params)
    return mode, slot


def _reshard(group):
    for st in getattr(group, "storages", []):
        st.reshard()


def test_blocks_with_prefetch_never_find_a_busy_slot():
    """FSDP2's schedule with one-module prefetch: forward unshards block i+1 while i is unsharded, backward
    block i-1 while i is; the root is gathered directly. Every block unshard gets a slot other than the
    unsharded neighbour's."""
    blocks = [_group() for _ in range(4)]
    root = _group(leaf=False)
    arena = _arena(wiring.slot_layout(blocks[0].fsdp_params, 2).slot_bytes)
    assert _unshard(arena, root)[0] == "direct"
    modes = []
    for step in range(3):
        order = list(range(4))
        for phase in (order, order[::-1]):  # forward, then backward
            live = None
            for i in phase:
                if live is None:
                    modes.append(_unshard(arena, blocks[i]))
                nxt = phase[phase.index(i) + 1] if phase.index(i) + 1 < len(phase) else None
                if nxt is not None:
                    modes.append(_unshard(arena, blocks[nxt]))  # the prefetch
                _reshard(blocks[i])
                live = nxt
    assert all(m == "bound" for m, _ in modes), modes
    assert len({s for _, s in modes}) == 2


def test_groups_that_do_not_use_slots_are_gathered_directly():
    arena = _arena(wiring.slot_layout(_group().fsdp_params, 2).slot_bytes)
    assert _unshard(arena, _group(raf=False))[0] == "direct"  # reshard_after_forward=False
    assert _unshard(arena, _group(shard_dim=1))[0] == "direct"  # a Shard(1) param's blocks fit no slot place
    assert _unshard(arena, _group(numel=4096))[0] == "direct"  # larger than a slot
    group = _group()
    no_arena = wiring.plan_all_gather(None, group._all_gather_comm, AllGatherFacts([], None, (), False), 2)
    assert no_arena == ("none", None)
    assert _unshard(arena, group)[0] == "bound"
    _reshard(group)
    group.post_forward_mesh_info = None  # FSDPModule.set_reshard_after_forward(False) between steps
    assert _unshard(arena, group)[0] == "direct"


def test_a_third_live_block_is_refused_as_arena_busy():
    blocks = [_group() for _ in range(3)]
    arena = _arena(wiring.slot_layout(blocks[0].fsdp_params, 2).slot_bytes)
    assert [_unshard(arena, b)[0] for b in blocks] == ["bound", "bound", "busy"]
    assert fallbacks.arena_reason("busy") == "arena_busy"
