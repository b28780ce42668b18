"""How long a TIDE call may wait, one rule for every backend: ``TIDE_TIMEOUT_S``, else the process group's
own timeout; and the error a call that waited longer raises (the CUDA watchdog's report, or the CPU
call agreement's: tide/transport/watchdog.py, tide/ops/calls.py).
"""
from __future__ import annotations

from tide import knobs


TIMEOUT_WORDS = "TIDE_TIMEOUT_S, else the process group's timeout"


class TideTimeoutError(RuntimeError):
    """A TIDE op did not complete within its timeout (the watchdog's report is the message)."""


def did_not_complete(op: str, where: str, waited_s: float, since: str, timeout_s: float) -> str:
    """The one headline of a call that outlived its timeout, on every backend: ``op`` on ``where`` (its group in
    words), ``waited_s`` after ``since`` (what started the wait: its issue, a replay)."""
    return (f"tide: {op} on {where} did not complete {waited_s:.1f} s after {since} (timeout {timeout_s:g} s: "
            f"{TIMEOUT_WORDS})")


def timeout_for(group) -> float:
    """Seconds a TIDE op of ``group`` may take: ``TIDE_TIMEOUT_S``, else the group's own timeout."""
    seconds = knobs.get("TIDE_TIMEOUT_S")
    return group_timeout(group) if seconds is None else seconds


def group_timeout(group) -> float:
    """``group``'s own timeout (its backend's, else the default for its backend)."""
    import torch
    import torch.distributed as dist

    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            continue
    return dist.distributed_c10d._get_default_timeout(dist.get_backend(group)).total_seconds()
