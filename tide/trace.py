"""A trace of what TIDE did, for chasing a hang: ``TIDE_TRACE=1`` writes one line to stderr per decision.

Each line says which path an FSDP2 collective or a ``torch.ops.tide`` call took (the counters of
:mod:`tide.counters`), when the transport's watchdog started to track an op, when an op was still
pending a second after it was issued, and when such a late op completed. The last lines of a rank that
hung show what it issued and what never completed. Off by default: callers test :data:`ENABLED`
before they build a line, so a decision costs one test of a module constant.
"""
from __future__ import annotations

import os
import sys
import time

from tide import knobs

ENABLED = knobs.get("TIDE_TRACE")
LATE_S = 1.0  # an op still pending this long after its issue gets a line
_T0 = time.monotonic()


def event(message: str) -> None:
    """One trace line (only with ``TIDE_TRACE=1``), prefixed with the rank, the process id (which
    ``tide.launch`` names for a rank it kills) and the seconds since import."""
    if ENABLED:
        sys.stderr.write(f"tide[rank {os.environ.get('RANK', '?')} pid {os.getpid()}] +{time.monotonic() - _T0:.3f}s "
                         f"{message}\n")
        sys.stderr.flush()
