"""What the rewrite did, per graph (:class:`Report`) and summed over the process (:func:`report`), in the
shape of ``tide.stats()``: per collective kind, the buckets rewritten (``"buckets"``), the collectives they
serve (``"tide"``), the inputs copied to make them contiguous (``"copies"``) and the collectives left to
stock per reason (``"stock:<reason>"``)."""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger("tide")


@dataclass
class Report:
    counts: dict[str, Counter] = field(default_factory=dict)  # kind -> {"buckets", "tide", "copies", "stock:<r>"}
    glue_removed: int = 0  # casts, pads, splits and cats of the reduce-scatters the rewrite erased
    digest: str = ""  # of the agreed plan (tide.compile.plan.describe)
    plan: str = ""  # one line per call and per collective left to stock, in issue order
    depth: int = 0  # all-gather buckets issued ahead (tide.compile.schedule)
    pins: int = 0  # ordering dependencies given to Inductor (tide.compile.schedule.pin)

    def count(self, kind: str, path: str, n: int = 1) -> None:
        self.counts.setdefault(kind, Counter())[path] += n

    def as_dict(self) -> dict:
        return {kind: dict(sorted(c.items())) for kind, c in sorted(self.counts.items())}


_totals: dict[str, Counter] = {}
_graphs = Counter()
_logged: set = set()  # (kind, path) of the stock reasons already logged


def record(one: Report) -> None:
    """Add ``one`` to the process's totals; a reason to leave a collective to stock is logged once."""
    for kind, c in one.counts.items():
        _totals.setdefault(kind, Counter()).update(c)
        for path in c:
            if path.startswith("stock:") and (kind, path) not in _logged:
                _logged.add((kind, path))
                log.info("tide.compile: a %s stays a c10d collective (%s); logged once", kind, path)
    _graphs["graphs"] += 1
    _graphs["glue_removed"] += one.glue_removed


def report() -> dict:
    """Every rewrite since the last :func:`reset_report`: ``{kind: {"buckets": n, "tide": n,
    "stock:<reason>": n}, "graphs": n, "glue_removed": n}``."""
    return {**{kind: dict(sorted(c.items())) for kind, c in sorted(_totals.items())},
            "graphs": _graphs["graphs"], "glue_removed": _graphs["glue_removed"]}


def reset_report() -> None:
    _totals.clear()
    _graphs.clear()
