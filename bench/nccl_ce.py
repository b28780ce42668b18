"""NCCL's own zero-SM all-gather (copy engines, NCCL >= 2.28), the anchor TIDE-AG is measured against.

NCCL takes its copy-engine all-gather when the communicator's CTA policy is zero and both buffers lie
in symmetric windows (NVIDIA/nccl ``src/ce_coll.cc``). From torch: a process group created with
``ProcessGroupNCCL.Options`` whose ``config.cta_policy`` is ``NCCL_CTA_POLICY_ZERO``, torch symmetric
memory on its NCCL backend, buffers allocated from ``symm_mem.get_mem_pool`` and rendezvoused on that
group, and the collective issued on a side stream (NCCL 2.28 refuses the legacy default stream for CE
collectives). :class:`NcclCeAllGather` is the same thing as an FSDP2 ``AllGather`` comm
(``set_custom_all_gather``), the way torch 2.13's ``set_symm_mem_for_comm`` wires its symmetric buffers.

Torch symmetric memory has one backend per process: use this in a process that runs no TIDE arena
(TIDE's arena uses the CUDA backend).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def available() -> str | None:
    """None when this torch/NCCL can run NCCL's copy-engine all-gather, else why not."""
    if not dist.is_nccl_available() or not hasattr(dist, "ProcessGroupNCCL"):
        return "no NCCL process group in this torch"
    if not hasattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO"):
        return "this torch cannot set NCCL's CTA policy"
    if tuple(torch.cuda.nccl.version()) < (2, 28, 3):
        return f"NCCL {torch.cuda.nccl.version()} has no copy-engine collectives (>= 2.28.3)"
    try:
        from torch.distributed import _symmetric_memory as symm_mem  # noqa: F401
    except ImportError:
        return "no torch symmetric memory"
    if not hasattr(symm_mem, "get_mem_pool"):
        return "torch symmetric memory has no memory pool"
    return None


def new_group(ranks=None) -> dist.ProcessGroup:
    """A NCCL group over ``ranks`` (default: all) with CTA policy zero; collective over the default group."""
    from torch.distributed import _symmetric_memory as symm_mem

    symm_mem.set_backend("NCCL")
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
    group = dist.new_group(ranks, backend="nccl", pg_options=opts)
    dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    return group


def empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor in NCCL symmetric memory (the backend's memory pool)."""
    from torch.distributed import _symmetric_memory as symm_mem

    with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
        return torch.empty(numel, dtype=dtype, device=device)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """``all_gather_into_tensor`` on the copy-engine group; both tensors from :func:`empty` (or views of them)."""
    from torch.distributed import _symmetric_memory as symm_mem

    symm_mem.rendezvous(out, group.group_name)
    if inp.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
        symm_mem.rendezvous(inp, group.group_name)
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


def fsdp_comm(group: dist.ProcessGroup):
    """An FSDP2 ``AllGather`` that gathers through :func:`all_gather` (for ``set_custom_all_gather``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    class NcclCeAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return empty(int(torch.Size(size).numel()), dtype, device).view(size)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ARG002 - the CE group
            return all_gather(output_tensor, input_tensor, ce_group, async_op=async_op)

    ce_group = group
    return NcclCeAllGather()
