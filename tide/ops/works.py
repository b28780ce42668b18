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
- CUDA: a call runs on a stream of its own kind (:func:`side_stream`: one for all-gathers, one for
  reduce-scatters, per device, as FSDP2 has), after everything queued so far on the stream it was called
  from (:func:`issued_on`), so that the compute issued after it runs beside its transfer. The work holds an
  event recorded on that stream after the call, and the call's inputs: ``wait()`` makes the stream current
  at the wait (the compute stream) wait for the event, then lets the inputs go, which the caching allocator
  may then give to that stream's later work (the call read them until the event). Its outputs come from the
  side stream's memory and are read only after the wait. Every call first orders its stream after the
  compute stream, so memory a dead output leaves behind is written again only after its last reader.
  Under CUDA-graph capture the side stream joins the capture at the fork, and each wait joins it back.
"""
from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Sequence

import torch
from torch._C._distributed_c10d import Work, _register_work

KINDS = ("all_gather", "reduce_scatter")
_streams: dict[tuple[int, str], "torch.cuda.Stream"] = {}


class TideWork(Work):
    """One graph-op call's completion: already complete (``event`` None), or the CUDA event after it, with the
    call's inputs held until the wait."""

    def __init__(self, event: torch.cuda.Event | None = None, held: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.event = event
        self._held = list(held)

    def wait(self, timeout: timedelta = timedelta(seconds=0)) -> bool:
        """Order the current stream after the call, then let its inputs go (no host wait: ``timeout`` has
        nothing to bound)."""
        if self.event is not None:
            self.event.wait()
        self._held.clear()
        return True

    def is_completed(self) -> bool:
        return self.event is None or self.event.query()


def side_stream(kind: str, device: torch.device) -> "torch.cuda.Stream | None":
    """The stream ``kind`` (``all_gather`` or ``reduce_scatter``) calls run on for ``device``; None on CPU."""
    if device.type != "cuda":
        return None
    key = (device.index if device.index is not None else torch.cuda.current_device(), kind)
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.Stream(device=key[0], priority=-1)
    return stream


@contextlib.contextmanager
def issued_on(stream: "torch.cuda.Stream | None"):
    """Within it, work goes to ``stream``, after everything queued so far on the current stream (nothing
    changes for None)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


def register(outs: Sequence[torch.Tensor], stream: "torch.cuda.Stream | None" = None,
             held: Sequence[torch.Tensor] = ()) -> TideWork:
    """Register the work of the call that just produced ``outs`` on each of them: complete (``stream`` None),
    or an event recorded now on ``stream`` holding ``held`` (the call's inputs) until the wait."""
    event = None
    if stream is not None:
        event = torch.cuda.Event()
        event.record(stream)
    work = TideWork(event, held if stream is not None else ())
    for out in outs:
        _register_work(out, work)
    return work
