"""The marker comm objects that opt an FSDP2 param group into TIDE (``tide.fsdp.enable`` installs them).

FSDP2 calls a group's ``_all_gather_comm`` / ``_reduce_scatter_comm`` only on its stock path, so each
marker wraps the comm it replaced (``fallback``) and hands every call to it; the seam recognises the
markers and takes the TIDE path instead. They also carry the per-group state the seam remembers.
"""
from __future__ import annotations

from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGatherResult


class TideAllGather(AllGather):
    """Opt-in marker for a param group's all-gather; the stock path still uses ``fallback``."""

    def __init__(self, fallback: AllGather, param_group=None, transport: str = "auto", leaf: bool = False) -> None:
        self.fallback = fallback
        # The FSDPParamGroup, whether its FSDP module has no FSDP module below it (both decide slot
        # binding), and the transport choice: "auto" uses the CUDA transport's arena on CUDA, "reference"
        # never creates one.
        self.param_group = param_group
        self.leaf = leaf
        self.transport = transport
        # (the group's fsdp_params list, its static fallback reason): FSDP passes the same list object on
        # every unshard, and the checked properties are fixed once FSDP's lazy init has set the dtypes.
        self.static_reason: tuple[list, str | None] | None = None
        # (the fsdp_params list, which params are tensor extensions: tide.fsdp.extensions.hooked), likewise.
        self.hooked: tuple[list, tuple[bool, ...]] | None = None
        # (the fsdp_params list, its extensions' input sizes or None, whether the group fits an arena slot),
        # once per list like static_reason (and per input sizes for a group with extensions).
        self.slot_fit: tuple[list, tuple | None, bool] | None = None
        # The CUDA contract's verdict for this group's ranks (tide.fsdp.fallbacks.contract_reason), once.
        self.contract: tuple[str | None] | None = None

    def allocate(self, size, *, dtype, device):
        return self.fallback.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return self.fallback(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)


class TideReduceScatter(ReduceScatter):
    """Opt-in marker for a param group's reduce-scatter; carries the group's ``rs_mode``."""

    def __init__(self, fallback: ReduceScatter, rs_mode: str, transport: str = "auto") -> None:
        self.fallback = fallback
        self.rs_mode = rs_mode
        self.transport = transport
        # id(FSDPParam) -> handle of its Slot-Reuse post-accumulate-grad hook (tide.fsdp.hooks).
        self.grad_hooks: dict = {}
        # FSDPParams whose fixed properties (placement, offload, DTensor) passed: each reduce passes a
        # fresh list (the params that have grads), so the check is remembered per param.
        self.checked_params: set[int] = set()
        self.contract: tuple[str | None] | None = None

    def allocate(self, size, *, dtype, device):
        return self.fallback.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return self.fallback(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                             async_op=async_op)


class TideAllGatherResult(AllGatherResult):
    """An all-gather whose data TIDE already placed in the params: copy-out only waits its event."""

    __slots__ = ()
