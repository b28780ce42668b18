"""The multi-node schedule's settings, agreed by a group's ranks at its first multi-node call.

The pacing knob, ``TIDE_MULTINODE_PACE_BYTES`` (default :data:`DEFAULT_PACE_BYTES`), and the rails'
implementation, ``TIDE_MULTINODE_RAILS`` (``auto``, the default: direct NCCL where every rank of the group can
run them, else ``p2p``; or ``p2p`` or ``nccl``: ``tide/multinode/rails.py``), are read by each rank and
compared across the group at the group's first multi-node call: ranks that set them differently would post
sends and receives of different sizes or on different communicators, so all of them raise, naming the
settings.
"""
from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tide import agreement, knobs, registry, timeouts
from tide.meta.multinode import DEFAULT_PACE_BYTES
from tide.multinode import nccl_rails, rails

log = logging.getLogger("tide")

PACE_ENV = "TIDE_MULTINODE_PACE_BYTES"


@dataclass(frozen=True)
class Settings:
    """What a group's ranks agreed on at its first multi-node call."""

    pace: int  # bytes per rail step (PACE_ENV)
    direct: bool  # no rank asked for p2p (rails.RAILS_ENV) and every rank can run the direct NCCL rails
    prefix: str  # the store keys of this agreement


def agreed(group: dist.ProcessGroup) -> Settings:
    """This group's settings, agreed by its ranks at the group's first multi-node call (one store round
    trip): :data:`PACE_ENV` and ``rails.RAILS_ENV``. A rank's invalid value, or values that differ
    between ranks, make every rank raise, naming them. Direct NCCL rails that some rank cannot run leave
    every rank on ``p2p``, logged with the reason (a warning when they were asked for by name). "Can run"
    means an NCCL group and the extension's NCCL symbols; a communicator whose set-up then fails raises
    there rather than falling back (its peers wait in theirs until the watchdog ends them)."""
    settings = registry.group_entry(registry.multinode_settings, group)
    if settings is None:  # first call, or a re-created group of the same name: it agrees anew
        settings = _agree(group)
        registry.multinode_settings[group.group_name] = (weakref.ref(group), settings)
    return settings


def _agree(group: dist.ProcessGroup) -> Settings:
    name = group.group_name
    registry.settings_agreements[name] += 1
    prefix = f"tide/multinode/{name}/{registry.settings_agreements[name]}"
    problems = []  # published, not raised here: every rank names them instead of waiting for this one
    try:
        pace = knobs.get(PACE_ENV) or DEFAULT_PACE_BYTES
    except ValueError as e:
        pace = None
        problems.append(str(e))
    try:
        want = knobs.get(rails.RAILS_ENV)
    except ValueError as e:
        want = None
        problems.append(str(e))
    why_not = ""
    if want != "p2p" and not problems:
        why_not = ("the group is not an NCCL group (ranks sharing GPUs)" if "nccl" not in dist.get_backend(group)
                   else nccl_rails.unavailable() or "")
    what = f"tide: the multi-node settings of group {name!r}"
    mine = json.dumps({"pace": pace, "rails": want, "why_not": why_not, "problems": problems})
    store = dist.distributed_c10d._get_default_store()
    every = [json.loads(v) for v in agreement.exchange(store, f"{prefix}/settings", group.rank(), group.size(), mine,
                                                       timeouts.timeout_for(group), what)]
    bad = [f"rank {r}: {p}" for r, v in enumerate(every) for p in v["problems"]]
    if bad:
        raise ValueError(f"{what}: {'; '.join(bad)}")
    if len({(v["pace"], v["rails"]) for v in every}) > 1:
        per_rank = [f"{v['pace']}, {v['rails']}" for v in every]
        raise RuntimeError(f"{what}: the ranks set {PACE_ENV} and {rails.RAILS_ENV} differently "
                           f"(per rank: {per_rank}); "
                           "the schedule needs the same on every rank")
    reasons = [f"rank {r}: {v['why_not']}" for r, v in enumerate(every) if v["why_not"]]
    if reasons:
        (log.warning if want == "nccl" else log.debug)("%s: direct NCCL rails unavailable, the rails stay p2p (%s)",
                                                        what, "; ".join(reasons))
    return Settings(int(pace), want != "p2p" and not reasons, prefix)


def pace(group: dist.ProcessGroup, device: torch.device) -> int:
    """The agreed pace, and the direct rails opened where agreed and the op's tensors are on a GPU (at an
    op's start: every rank is there; CPU tensors on a group with an NCCL backend for CUDA never use them)."""
    settings = agreed(group)
    if settings.direct and device.type == "cuda":
        rails.open_direct(group, settings.prefix)
    return settings.pace
