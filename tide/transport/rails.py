"""The point-to-point legs of the multi-node schedule (``tide/ops/reference_multinode.py``).

One call moves a round's pieces: every ``(peer, tensor)`` send and receive of this rank, posted as one
batch of point-to-point operations on the group, then waited for. How it moves them depends on the
group's backend for the tensors' device, recorded per leg in ``tide.stats()["multinode"]``:

- ``p2p``: the backend moves the tensors themselves: NCCL for CUDA tensors (one GPU per rank), gloo for
  CPU tensors;
- ``p2p_host_staged``: CUDA tensors on a gloo group (ranks sharing one GPU), whose send and receive move
  host memory only: sends are copied to the host first, receives land in host buffers and are copied
  into place after.

NCCL's one-sided put/signal (``nccl4py``, NCCL >= 2.29) is the other implementation the design names; it
is not built. :func:`put_signal_unavailable` says why it could not run here.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from tide import counters


def implementation(group: dist.ProcessGroup, device: torch.device) -> str:
    """``p2p`` or ``p2p_host_staged`` for tensors on ``device`` over ``group`` (see the module docstring)."""
    if device.type == "cpu" or "nccl" in dist.get_backend(group):
        return "p2p"
    return "p2p_host_staged"


def exchange(group: dist.ProcessGroup, sends: Sequence, recvs: Sequence, leg: str) -> None:
    """Post every ``(group peer, tensor)`` send and receive (pairs post in the same order on both ends),
    then wait for all; ``leg`` names the schedule's leg in the stats (``rail``, ``intra``, ``handoff``)."""
    if not sends and not recvs:
        return
    device = (sends or recvs)[0][1].device
    how = implementation(group, device)
    counters.count_multinode(f"{leg}:{how}")
    if how == "p2p_host_staged":
        sends = [(peer, t.cpu()) for peer, t in sends]
        landed = [(t, torch.empty(t.shape, dtype=t.dtype)) for _, t in recvs]
        recvs = [(peer, host) for (peer, _), (_, host) in zip(recvs, landed)]
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for peer, t in recvs]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if how == "p2p_host_staged":
        for target, host in landed:
            target.copy_(host)


def put_signal_unavailable() -> str | None:
    """Why NCCL's one-sided put/signal cannot carry the rails in this process (None would mean it could;
    that implementation is not built, so callers use :func:`exchange` either way)."""
    try:
        import nccl4py  # noqa: F401
    except ImportError:
        return "nccl4py is not installed"
    version = getattr(torch.cuda, "nccl", None)
    found = version.version() if version is not None and torch.cuda.is_available() else None
    if found is None or tuple(found[:2]) < (2, 29):
        return f"the loaded NCCL is {found}, put/signal needs >= 2.29"
    return None
