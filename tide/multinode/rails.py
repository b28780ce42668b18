"""The point-to-point legs of the multi-node schedule (``tide/multinode/schedule.py``).

One call moves a round's pieces: every send and receive of this rank (a span of a tensor, with its peer),
posted as batches of point-to-point operations on the group (a bounded number per peer each), then waited
for. How it moves them depends on the group's backend for the tensors' device, recorded per leg in
``tide.stats()["multinode"]``:

- ``p2p``: the backend moves the tensors themselves: NCCL for CUDA tensors (one GPU per rank), gloo for
  CPU tensors;
- ``p2p_host_staged``: CUDA tensors on a gloo group (ranks sharing one GPU), whose send and receive move
  host memory only: a round's pieces for one peer are packed into one pinned host buffer (copied from the
  GPU without a wait per piece, then one stream sync), sent as one message, and unpacked from the peer's
  message by copies queued on the current stream, as gloo itself stages a CUDA collective;
- ``nccl_direct``: CUDA tensors on an NCCL group whose ranks can all run them and did not set
  ``TIDE_MULTINODE_RAILS=p2p`` (the default ``auto``, or ``nccl``): each batch is one NCCL group issued
  from one extension call on a communicator of TIDE's own (``tide/multinode/nccl_rails.py``).

NCCL's one-sided put/signal (``nccl4py``, NCCL >= 2.29) is the other implementation the design names; it
is not built. :func:`put_signal_unavailable` says why it could not run here.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch
import torch.distributed as dist

import weakref

from tide import counters, registry

# One of knobs.RAILS_CHOICES: "auto" (default: direct NCCL where every rank can run them), "p2p" or "nccl".
RAILS_ENV = "TIDE_MULTINODE_RAILS"


def _opened(group: dist.ProcessGroup):
    """``group``'s open DirectRails, or None (also for another group once registered under its name)."""
    return registry.group_entry(registry.direct_rails, group)


def implementation(group: dist.ProcessGroup, device: torch.device) -> str:
    """``p2p``, ``p2p_host_staged`` or ``nccl_direct`` for tensors on ``device`` over ``group`` (see the
    module docstring). Under CUDA-graph capture the direct rails step aside for ``p2p``: their completion
    word would be captured, not written."""
    if device.type == "cpu":
        return "p2p"
    if "nccl" not in dist.get_backend(group):
        return "p2p_host_staged"
    if _opened(group) is not None and not torch.cuda.is_current_stream_capturing():
        return "nccl_direct"
    return "p2p"


def open_direct(group: dist.ProcessGroup, prefix: str) -> None:
    """Open ``group``'s direct NCCL rails unless they are open (collective: every rank of the group at the
    same call, after agreeing on them; ``prefix``: that agreement's store keys). Never under CUDA-graph
    capture, where the communicator's set-up must not run: a later call opens them."""
    from tide.multinode.nccl_rails import DirectRails

    if _opened(group) is None and not torch.cuda.is_current_stream_capturing():
        # Fresh store keys per opening: after a close, an earlier opening's unique id is still in the store,
        # and a rank reading it would join a communicator that no longer exists.
        registry.rails_openings[group.group_name] += 1
        opening = registry.rails_openings[group.group_name]
        registry.direct_rails[group.group_name] = (weakref.ref(group), DirectRails(group, f"{prefix}/{opening}"))


def close_direct(group: dist.ProcessGroup) -> None:
    """Close ``group``'s direct NCCL rails, if open, once their work has completed (``tide.fsdp.disable``:
    their communicator's buffers go with them; a later multi-node call opens them again)."""
    opened = registry.direct_rails.pop(group.group_name, None)
    if opened is not None:
        opened[1].stream.synchronize()


# At most this many sends and as many receives per peer in one batch: NCCL before 2.30 can hang on a group
# of many point-to-point operations (pytorch#174288), and an unpaced intra-node step of an MoE block has
# thousands of pieces.
MAX_OPS_PER_PEER = 64


def exchange(group: dist.ProcessGroup, sends: Sequence, recvs: Sequence, leg: str) -> None:
    """Post every send and receive of this rank, then wait for all; ``leg`` names the schedule's leg in the
    stats (``rail``, ``intra``, ``handoff``). Each is ``(group peer, span)``, the span ``(tensor, start,
    count)`` elements ``[start, start + count)`` of a contiguous tensor, moved where they lie (the direct
    rails take the span itself: no slice per piece). Pairs post in the same order on both ends.

    Batches hold at most :data:`MAX_OPS_PER_PEER` sends and receives per peer. Batch k carries the k-th
    slice of this rank's sends to each peer and receives from it. That peer's receives from this rank
    and sends to it follow the same order, so its batch k carries the matching slices: every send meets
    its receive in the same batch on both ends. Host-staged rounds are not batched: each peer's pieces go
    as one packed message (:func:`exchange_packed`)."""
    if not sends and not recvs:
        return
    device = (sends or recvs)[0][1][0].device
    how = implementation(group, device)
    counters.count_multinode(f"{leg}:{how}")
    if how != "nccl_direct":  # torch's point-to-point ops take tensors: each span becomes its slice
        sends = [(peer, piece(*span)) for peer, span in sends]
        recvs = [(peer, piece(*span)) for peer, span in recvs]
    if how == "p2p_host_staged":
        exchange_packed(group, sends, recvs)
        return
    to, frm = defaultdict(list), defaultdict(list)
    for peer, what in sends:
        to[peer].append(what)
    for peer, what in recvs:
        frm[peer].append(what)
    batches = max(-(-len(ts) // MAX_OPS_PER_PEER) for ts in (*to.values(), *frm.values()))
    for k in range(batches):
        part = slice(k * MAX_OPS_PER_PEER, (k + 1) * MAX_OPS_PER_PEER)
        ops = [(peer, what, True) for peer in sorted(to) for what in to[peer][part]]
        ops += [(peer, what, False) for peer in sorted(frm) for what in frm[peer][part]]
        if not ops:  # no op with a peer in batch k here means none with this rank in that peer's batch k
            continue
        if how == "nccl_direct":
            _opened(group).post([(peer, *span, send) for peer, span, send in ops], leg)
            continue
        p2p = [dist.P2POp(dist.isend if send else dist.irecv, t, group=group, group_peer=peer) for peer, t, send in ops]
        for work in dist.batch_isend_irecv(p2p):
            work.wait()


def exchange_packed(group: dist.ProcessGroup, sends: Sequence, recvs: Sequence) -> None:
    """:func:`exchange` with one message per peer and direction: ``sends`` / ``recvs`` are ``(group peer,
    1-D tensor)``, in the order both ends post them, any dtypes, all on one device. Each peer's pieces are
    packed as bytes into one host buffer (pinned for GPU pieces: copied off the GPU without a wait per
    piece, then one sync of the current stream), and a received buffer is unpacked into its pieces by
    copies on the current stream (asynchronous from pinned memory, ordered before the stream's later
    work)."""
    if not sends and not recvs:
        return
    device = (sends or recvs)[0][1].device
    pin = device.type == "cuda"
    to, frm = defaultdict(list), defaultdict(list)
    for peer, t in sends:
        to[peer].append(t.view(torch.uint8))
    for peer, t in recvs:
        frm[peer].append(t.view(torch.uint8))
    host = lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pin)  # noqa: E731
    outgoing = {}
    for peer, pieces in to.items():
        buf, at = host(sum(p.numel() for p in pieces)), 0
        for p in pieces:
            buf[at:at + p.numel()].copy_(p, non_blocking=pin)
            at += p.numel()
        outgoing[peer] = buf
    incoming = {peer: host(sum(p.numel() for p in pieces)) for peer, pieces in frm.items()}
    if pin and outgoing:
        torch.cuda.current_stream(device).synchronize()  # the packed bytes have landed
    ops = [dist.P2POp(dist.isend, buf, group=group, group_peer=peer) for peer, buf in sorted(outgoing.items())]
    ops += [dist.P2POp(dist.irecv, buf, group=group, group_peer=peer) for peer, buf in sorted(incoming.items())]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for peer, buf in incoming.items():
        at = 0
        for p in frm[peer]:
            p.copy_(buf[at:at + p.numel()], non_blocking=pin)
            at += p.numel()


def piece(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Elements ``[start, start + count)`` of contiguous ``t``, as a 1-D view."""
    flat = t if t.dim() == 1 else t.view(-1)
    return flat[start:start + count]


def whole(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The span of all of contiguous ``t``."""
    return t, 0, t.numel()


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
