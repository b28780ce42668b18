"""Which FSDP2 param groups are TIDE's, and the per-group state the seam keeps for each collective.

``tide.fsdp.enable`` gives each param group a :class:`TideAllGather` and a :class:`TideReduceScatter`
(:func:`attach`). They are not FSDP2 comms: the group's own ``_all_gather_comm`` / ``_reduce_scatter_comm``
stay FSDP2's, so every FSDP2 API that sets or checks them (``set_custom_all_gather``,
``set_allocate_memory_from_process_group_for_comm``, ``set_symm_mem_for_comm``, ...) behaves as on stock, in
either order with ``enable``, and the stock path calls whichever comm FSDP2 holds. The seam finds a group's
state from the ``fsdp_params`` FSDP2 hands it (:func:`of_params`).
"""
from __future__ import annotations

import dataclasses
import weakref

from torch.distributed.fsdp._fully_shard import _fsdp_collectives
from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGatherResult

from tide import registry

# FSDP2's own comm classes: they only choose where stock's staging buffers come from, which TIDE's path has
# none of. Any other comm in a group's slot is the user's (set_custom_all_gather / set_custom_reduce_scatter):
# that collective then keeps it (stock:custom_comm). Looked up by name: torch 2.11 has fewer of them.
STOCK_ALL_GATHERS = tuple(c for c in (getattr(_fsdp_collectives, n, None) for n in (
    "DefaultAllGather", "ProcessGroupAllocAllGather", "SymmMemAllGather")) if c is not None)
STOCK_REDUCE_SCATTERS = tuple(c for c in (getattr(_fsdp_collectives, n, None) for n in (
    "DefaultReduceScatter", "ProcessGroupAllocReduceScatter", "SymmMemReduceScatter")) if c is not None)


@dataclasses.dataclass
class AllGatherFacts:
    """What a group's all-gathers rest on that cannot change between its calls, decided once per
    ``fsdp_params`` list (FSDP passes the same list on every unshard, and the properties read are fixed once
    its lazy init has set the dtypes) by ``tide.fsdp.decide.all_gather_facts``."""
    fsdp_params: list
    static_reason: str | None  # tide.fsdp.fallbacks.static_all_gather_reason
    hooked: tuple[bool, ...]  # per param, whether it is a tensor extension; () when none is
    sharded: bool  # a param is sharded on a dim other than 0 (tide.fsdp.shard_dims): never bound into slots
    # Whether the group fits a slot, per (its extensions' input sizes, or None; the arena's slot bytes).
    slot_fits: dict = dataclasses.field(default_factory=dict)


class TideAllGather:
    """TIDE's state of one enabled param group's all-gather."""

    def __init__(self, param_group, transport: str = "auto", leaf: bool = False) -> None:
        # The FSDPParamGroup, whether its FSDP module has no FSDP module below it (both decide slot
        # binding), and the transport choice: "auto" uses the CUDA transport's arena on CUDA, "reference"
        # never creates one.
        self.param_group = param_group
        self.leaf = leaf
        self.transport = transport
        # What the group's all-gathers rest on that no call changes (tide.fsdp.decide.all_gather_facts).
        self.facts: AllGatherFacts | None = None
        # The group's all-gather decided on TIDE, kept for the calls it holds for (tide.fsdp.decide.GroupAllGather).
        self.decided = None
        # The CUDA contract's verdict for this group's ranks (tide.fsdp.fallbacks.contract_reason), once.
        self.contract: tuple[str | None] | None = None
        # (process group, whether its ranks are threads of this process), per process group seen.
        self.threaded: tuple | None = None
        # Whether the user's own comm in the group's slot was warned about (once per group and collective).
        self.custom_comm_warned = False

    def fsdp_comm(self):
        """The comm FSDP2 holds for this group's all-gather (the stock path's)."""
        return self.param_group._all_gather_comm


class TideReduceScatter:
    """TIDE's state of one enabled param group's reduce-scatter; carries the group's ``rs_mode``."""

    def __init__(self, param_group, rs_mode: str, transport: str = "auto") -> None:
        self.param_group = param_group
        self.rs_mode = rs_mode
        self.transport = transport
        # id(FSDPParam) -> handle of its Slot-Reuse post-accumulate-grad hook (tide.fsdp.hooks).
        self.grad_hooks: dict = {}
        # Whether those hooks moved a gradient into the slot since the group's last reduce (tide.stats()["wiring"]
        # then counts the reduce as rs:slot_reuse), so the reduce needs no look at where each gradient lies.
        self.grads_moved_into_slot = False
        # FSDPParams whose fixed properties (placement, offload, DTensor) passed: each reduce passes a
        # fresh list (the params that have grads), so the check is remembered per param.
        self.checked_params: set[int] = set()
        # The group's reduce decided on TIDE, kept for the calls it holds for (tide.fsdp.decide.GroupReduce).
        self.decided = None
        self.contract: tuple[str | None] | None = None
        self.threaded: tuple | None = None
        self.custom_comm_warned = False

    def take_grads_moved_into_slot(self) -> bool:
        """Whether the Slot-Reuse hooks moved any gradient into the slot since the last call (and start over)."""
        moved, self.grads_moved_into_slot = self.grads_moved_into_slot, False
        return moved

    def fsdp_comm(self):
        """The comm FSDP2 holds for this group's reduce-scatter (the stock path's)."""
        return self.param_group._reduce_scatter_comm


# The attribute of an FSDPParamGroup holding its (TideAllGather, TideReduceScatter): the state lives and
# dies with the group.
_ATTR = "_tide_comms"


def attach(param_group, all_gather: TideAllGather, reduce_scatter: TideReduceScatter) -> None:
    setattr(param_group, _ATTR, (all_gather, reduce_scatter))
    for p in param_group.fsdp_params:
        registry.groups_of_params[p] = weakref.ref(param_group)


def detach(param_group) -> None:
    if hasattr(param_group, _ATTR):
        delattr(param_group, _ATTR)
    for p in param_group.fsdp_params:
        registry.groups_of_params.pop(p, None)


def of_group(param_group) -> tuple[TideAllGather, TideReduceScatter] | None:
    """The group's TIDE state, or None when it is not enabled."""
    return getattr(param_group, _ATTR, None)


def of_params(fsdp_params) -> tuple[TideAllGather, TideReduceScatter] | None:
    """The TIDE state of the enabled group that holds ``fsdp_params`` (what FSDP2 passes its collectives),
    or None."""
    ref = registry.groups_of_params.get(fsdp_params[0]) if fsdp_params else None
    group = ref() if ref is not None else None
    return None if group is None else of_group(group)


class TideAllGatherResult(AllGatherResult):
    """An all-gather whose data TIDE already placed in the params: copy-out only waits its event."""

    __slots__ = ()
