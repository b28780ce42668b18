"""``CommDebugMode`` (``torch.distributed.tensor.debug``), the tool users count collectives with, sees TIDE's
FSDP2 collectives as the c10d collectives they stand for, one for one: each TIDE all-gather as
``c10d._allgather_base_`` and each reduce-scatter as ``c10d._reduce_scatter_base_``, what stock FSDP2's
``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor`` dispatch. So counts per phase or module
(PyTorch's own FSDP2 tests assert them) are stock's.

Each op the seam issues has a ``torch.library.register_torch_dispatch`` rule for the ``CommDebugMode`` class: it
hands the call to the mode under the c10d op's name (:class:`CountedAs`), so the mode's own accounting (totals,
per module and phase, its tracing tables) takes it as it takes that op, and runs it. The mode is off the
dispatch stack while the op runs, so the reference backend's own c10d calls inside it are not counted again.
The mode's module takes about 1.6 s to import: the rules are registered at the seam's first TIDE collective
after the user imported it (:func:`register`; before that, one dictionary lookup per collective).
"""
from __future__ import annotations

import sys

import torch

from tide import registry

COMM_MODE_MODULE = "torch.distributed.tensor.debug._comm_mode"
# TIDE op -> the c10d collective it stands for.
COUNTED_AS = {
    "all_gather_into_params_": "_allgather_base_",
    "reduce_scatter_params_": "_reduce_scatter_base_",
}


class CountedAs:
    """A TIDE op under the name of the c10d collective it stands for: ``CommDebugMode`` keys its counts by an
    op's ``_overloadpacket`` and calls the op."""

    def __init__(self, op: torch._ops.OpOverload, packet: torch._ops.OpOverloadPacket) -> None:
        self.op = op
        self._overloadpacket = packet

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def __repr__(self) -> str:  # the name the mode's tracing tables print
        return f"{self._overloadpacket} ({self.op})"


def register() -> None:
    """Register the rules (once ``CommDebugMode``'s module is loaded: ``tide.fsdp.decide`` asks at each TIDE
    collective until they are)."""
    mode_class = sys.modules[COMM_MODE_MODULE].CommDebugMode
    counted = {}
    for name, c10d_name in COUNTED_AS.items():
        op = getattr(torch.ops.tide, name).default
        counted[op] = CountedAs(op, getattr(torch.ops.c10d, c10d_name))
        torch.library.register_torch_dispatch(f"tide::{name}", mode_class,
                                              lambda mode, func, types, args, kwargs:
                                              mode.__torch_dispatch__(counted[func], types, args, kwargs))
    registry.comm_debug_rules.extend(counted.values())
