"""Direct NCCL rails of the multi-node schedule: one C++ call per batch of a step's point-to-point operations.

Through torch's ProcessGroupNCCL every piece of a step is a call of its own, with its own bookkeeping;
that host cost made the emulated multi-node ops 3-20x slower than NCCL's collectives on two H200s. Here a
step's sends and receives go to NCCL as one group from one extension call (``csrc/transport/nccl_p2p.cpp``).

- **A communicator of TIDE's own** per process group, made at the group's first multi-node call (rank 0's
  unique id through the store, then a collective ``ncclCommInitRank``): NCCL kernels of one communicator
  must never run from two streams at once, and torch runs its own on its internal stream.
- **One rail stream per group.** Every exchange waits for the caller's stream, runs on the rail stream,
  and the caller's stream waits for it before the call returns (also when the call raises), as if it had
  run there: FSDP2's all-gather and reduce-scatter streams thus never put two kernels of the communicator
  side by side. No tensor is recorded on the rail stream, as none would be for a kernel on the caller's
  stream: a block allocated there is reused only by work ordered after the exchange, and FSDP2's events
  order the rest (a recorded block's reuse waits until the allocator sees the rail stream pass it, which
  left the step's reserved memory at the mercy of the host's lead over the GPU).
- **Bounded like every TIDE op.** The watchdog (``tide/transport/watchdog.py``) tracks the communicator's
  creation and every exchange from before its call, through a completion word written on the caller's
  stream after the join: a peer that dies mid-step ends this process after the timeout, with a report.

The default wherever every rank of the group can run them (``TIDE_MULTINODE_RAILS`` unset or ``auto``;
``p2p`` keeps torch's point-to-point path; ``tide/multinode/settings.py`` agrees on it with the pace):
on two H200s as 2 nodes x 1 they beat the p2p rails at every size and reserve less memory in the
8B-shaped step. Counted as ``<leg>:nccl_direct`` in ``tide.stats()["multinode"]``.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from tide import agreement, timeouts


def unavailable() -> str | None:
    """Why this process cannot run direct NCCL rails (None when it can): no CUDA, or no NCCL in torch's
    libraries, or the extension cannot be built."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from tide import extension

        reason = extension.load().nccl_unavailable()
    except Exception as e:  # noqa: BLE001 - any failure to build or load means: not here
        return f"the CUDA extension is unavailable: {str(e).splitlines()[0]}"
    return reason or None


class DirectRails:
    """The direct NCCL rails of ``group`` (every rank constructs them together, one GPU per rank)."""

    def __init__(self, group: dist.ProcessGroup, prefix: str) -> None:
        from tide import extension
        from tide.transport import watchdog  # the CUDA transport, only where these rails run

        self.ext = extension.load()
        self.rank, self.world = group.rank(), group.size()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeouts.timeout_for(group)
        self.label = f"{group.group_name!r} (ranks {dist.get_process_group_ranks(group)}, this rank {self.rank})"
        store = dist.distributed_c10d._get_default_store()
        what = f"tide.transport: the direct NCCL rails of group {self.label}"
        # Rank 0's unique id, read by every rank within the timeout (a missing peer is named, not waited for).
        mine = self.ext.nccl_unique_id().hex() if self.rank == 0 else ""
        ids = agreement.exchange(store, f"{prefix}/nccl_id", self.rank, self.world, mine, self.timeout_s, what)
        done = watchdog.Completion(self.ext, self.device.index)
        watchdog.WATCHDOG.track(done, "direct NCCL rails: communicator", self.label, self.timeout_s, self._report)
        try:
            self._comm = self.ext.NcclComm(id=bytes.fromhex(ids[0]), world=self.world, rank=self.rank,
                                           device=self.device.index)
        finally:
            done.issued(None)
        self.stream = torch.cuda.Stream(self.device)

    def _report(self):
        yield f"  direct NCCL rails of group {self.label}: a peer did not post its matching operations"

    def post(self, ops: Sequence[tuple[int, torch.Tensor, int, int, bool]], leg: str) -> None:
        """One NCCL group of ``(group peer, tensor, start, count, is_send)`` operations (elements
        ``[start, start + count)`` of a contiguous tensor on this GPU, checked in C++), ordered on the
        caller's stream."""
        from tide.transport import watchdog

        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        done = watchdog.Completion(self.ext, self.device.index)
        watchdog.WATCHDOG.track(done, f"direct NCCL rails: {leg} step", self.label, self.timeout_s, self._report)
        op = None
        try:
            try:
                peers, tensors, starts, counts, sends = zip(*ops)
                self._comm.exchange(peers=peers, tensors=tensors, starts=starts, counts=counts, sends=sends,
                                    stream=self.stream.cuda_stream)
            finally:  # also when it raised: what it queued may still touch these tensors
                current.wait_stream(self.stream)
            op = self.ext.mark_completion(device=self.device.index)
        finally:
            done.issued(op)
