"""Completion of the graph ops (``all_gather_start``, ``reduce_scatter_start``): the contract of c10d's
functional collectives, so that a traced graph's own ``torch.ops._c10d_functional.wait_tensor`` nodes
complete TIDE's calls.

Each call makes one :class:`TideWork` and registers it on every output with
``torch._C._distributed_c10d._register_work`` (torch's work registry, keyed by the output's storage; a
view of the output finds it too). ``wait_tensor(out)`` takes the works registered on ``out``'s storage
out of the registry, calls their ``wait()`` and returns ``out`` itself; a second ``wait_tensor`` finds
none and returns at once. Torch warns at exit about works never waited.

- CPU: the kernels are synchronous (the reference backend has gathered or reduced before they return),
  so the work is complete from the start and ``wait()`` does nothing.
- CUDA: the work holds an event recorded on the current stream after everything the call queued there;
  ``wait()`` makes the stream current at the wait wait for it (as ``torch.distributed._symmetric_memory``'s
  low-contention collectives do). The inputs stay valid without being held: the call's work is ordered on
  the stream the caching allocator reuses them on.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Sequence

import torch
from torch._C._distributed_c10d import Work, _register_work


class TideWork(Work):
    """One graph-op call's completion: already complete (``event`` None), or the CUDA event after it."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        super().__init__()
        self.event = event

    def wait(self, timeout: timedelta = timedelta(seconds=0)) -> bool:
        """Order the current stream after the call (no host wait: ``timeout`` has nothing to bound)."""
        if self.event is not None:
            self.event.wait()
        return True

    def is_completed(self) -> bool:
        return self.event is None or self.event.query()


def register(outs: Sequence[torch.Tensor]) -> TideWork:
    """Register the work of the call that just produced ``outs`` (its kernel's last step) on each of them:
    complete on CPU, an event recorded now on the current stream on CUDA."""
    event = None
    if outs[0].is_cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(outs[0].device))
    work = TideWork(event)
    for out in outs:
        _register_work(out, work)
    return work
