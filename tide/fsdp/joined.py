"""Whether every rank runs an FSDP2 param group on TIDE: agreed once, at the group's first TIDE collective.

``tide.fsdp.enable`` is a per-rank call. A rank that did not make it (or made it on other modules) issues
stock FSDP2's collectives for the group, and its peers on TIDE would wait for it in TIDE's call while it
waits for them in the backend's. So at a param group's first collective that would run on TIDE, each such
rank publishes that it does, in the default group's store, and waits, bounded, for its peers to do the same.
When every rank has, the group is TIDE's. When one has not within the bound, the ranks that run TIDE warn,
naming it, and take stock FSDP2 for the group from then on (``stock:peer_not_enabled``), which is what that
rank runs: training goes on, correct. One compare-and-set on a decision key makes every TIDE rank of the
group take the same path (a rank that arrives after the decision follows it). Once a peer was missing on a
process group, later param groups over it decide without waiting: a stock decision is always safe, since
every rank follows it.

The bound is TIDE's timeout, at most half the process group's own: the rank that runs stock waits for its
peers in the backend's collective for the group's timeout, and must still find them there.
"""
from __future__ import annotations

import json
import warnings
from datetime import timedelta

import torch.distributed as dist

from tide import registry
from tide.ops import call_groups
from tide.timeouts import group_timeout, timeout_for


def reason(param_group, group: dist.ProcessGroup) -> str | None:
    """``"peer_not_enabled"`` when a rank of ``group`` does not run ``param_group`` on TIDE, else None;
    decided at the first call (bounded wait, see the module doc) and kept for the group's life."""
    decided = registry.joined_groups.get(param_group)
    if decided is None:
        decided = registry.joined_groups[param_group] = (_join(param_group, group),)
    return decided[0]


def _join(param_group, group: dist.ProcessGroup) -> str | None:
    ranks = group.size()
    store = dist.distributed_c10d._get_default_store()
    fqn = getattr(param_group, "_module_fqn", None) or ""
    name = (group.group_name, fqn)
    registry.join_instances[name] += 1  # the same models in the same order on every rank: the same numbers
    prefix = (f"tide/joined/{call_groups.restart_count()}/{group.group_name}/{fqn}/"
              f"{registry.join_instances[name]}")
    store.set(f"{prefix}/{group.rank()}", "tide")
    keys, decision_key = [f"{prefix}/{r}" for r in range(ranks)], f"{prefix}/decision"
    bound = min(timeout_for(group), group_timeout(group) / 2)
    if store.check([decision_key]):  # decided before this rank came: follow
        mine = ""
    elif group.group_name in registry.groups_missing_peers:  # a peer was missing here before: no more waits
        mine = _missing(store, keys)
    else:
        try:
            store.wait(keys, timedelta(seconds=bound))
            mine = "[]"
        except RuntimeError:  # the bound passed
            mine = _missing(store, keys)
    decision = store.compare_set(decision_key, "", mine).decode()
    missing = json.loads(decision)
    if not missing:
        return None
    registry.groups_missing_peers.add(group.group_name)
    warnings.warn(
        f"tide.fsdp: group rank(s) {missing} of group {group.group_name!r} did not run FSDP module {fqn or '(root)'!r} "
        f"on TIDE within {bound:g} s of this rank's first collective of it (tide.fsdp.enable not called there, or "
        f"on other modules): it takes stock FSDP2 on every rank from now on (stock:peer_not_enabled)",
        stacklevel=2)
    return "peer_not_enabled"


def _missing(store, keys: list[str]) -> str:
    """The group ranks whose key is not in the store, as the decision's JSON list."""
    return json.dumps([r for r, k in enumerate(keys) if not store.check([k])])
