"""Several checks in one run of ranks: each rank runs them in turn and keeps each one's result, or its
traceback, and each test judges its own part. A check that raised on one rank leaves the others' next calls
unmatched: those raise too (TIDE's call check), within the timeout."""
from __future__ import annotations

import traceback


def run_each(checks, *args) -> dict:
    """``{name: ("ok", result) or ("error", traceback)}`` of every ``(name, check)``, each called with ``args``."""
    parts = {}
    for name, check in checks:
        try:
            parts[name] = ("ok", check(*args))
        except Exception:  # noqa: BLE001 - judged by the part's test
            parts[name] = ("error", traceback.format_exc())
    return parts


def part(checked, name: str) -> list:
    """Every rank's result of ``name`` (``checked``: the run's seed and per-rank parts); the tracebacks of the
    ranks where it raised fail the test."""
    seed, per_rank = checked
    raised = [f"rank {rank}:\n{parts[name][1]}" for rank, parts in enumerate(per_rank) if parts[name][0] != "ok"]
    assert not raised, f"seed {seed} world size {len(per_rank)}: {name} raised on\n" + "\n".join(raised)
    return [parts[name][1] for parts in per_rank]
