"""Fault scenarios: a peer that dies, skips a collective or issues another plan, on any device.

Rank functions for :func:`tide.launch.run_ranks_outcomes`, shared by the fault tests (``tests/faults/``
on CPU, ``tests/cuda/test_faults.py``, which put ``bench/`` on ``sys.path``) and the campaign
(``bench/fault_campaign.py``). Rank 1 is the
faulty rank; it writes the wall-clock time of its fault to ``fault_file`` (when given) just before
injecting it, so the time every other rank takes to end can be measured from the fault.

- :func:`op_sequence`: a seeded random mix of TIDE ops (the same on every rank), outputs bound in the
  arena's slots on CUDA. At op ``fault_at`` rank 1 dies (on CPU before issuing it, so the peers are inside
  the collective; on CUDA right after issuing it, so its copies are in flight), stalls there while alive
  (past the peers' timeout + 15 s, then dies), skips it, or issues it with another layout.
- :func:`fsdp_steps`: FSDP2 training steps on TIDE (either reduce-scatter mode). Rank 1 dies in its
  ``fault_at``-th all-gather or reduce-scatter (the seam's transport hooks, as above), or between steps;
  on CPU it may also skip a whole step (``skips_a_step``: the step ``tide.train`` declares is caught).

The CPU fault campaign (rounds of random faults in one run) is ``bench/fault_rounds.py``.
"""
from __future__ import annotations

import os
import random
import time

import torch
import torch.distributed as dist

OP_SCENARIOS = ("dies_in_all_gather", "dies_in_reduce_scatter", "stalls", "skips_a_collective", "other_plan")
STEP_SCENARIOS = ("dies_in_all_gather", "dies_in_reduce_scatter", "dies_between_steps")
CPU_STEP_SCENARIOS = ("skips_a_step",)  # the reference backend's exchange catches it; the CUDA path has none
FAULTY_RANK = 1
DIED = 3  # the faulty rank's exit code when it dies


def _fault(fault_file: str | None) -> None:
    if fault_file:
        with open(fault_file, "w") as f:
            f.write(repr(time.time()))


def die(fault_file: str | None) -> None:
    """Record the fault's time, then end this process at once (no teardown: its GPU work is cut off)."""
    _fault(fault_file)
    os._exit(DIED)


def stall(fault_file: str | None) -> None:
    """Stop issuing while alive, past the peers' bound (their timeout + 15 s), then die."""
    from tide.timeouts import timeout_for

    _fault(fault_file)
    time.sleep(timeout_for(dist.group.WORLD) + 16)
    os._exit(DIED)


def _device(device_type: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def op_sequence(rank: int, world_size: int, device_type: str, scenario: str, seed: int, fault_at: int,
                fault_file: str | None = None) -> str:
    """``fault_at + 3`` TIDE ops over the world group from a few layouts (so plans are both new and reused);
    rank 1 injects ``scenario`` at op ``fault_at``. Returns ``"finished"``."""
    import tide  # noqa: F401 (registers the ops)
    from tide.meta import plans

    if scenario not in OP_SCENARIOS:
        raise ValueError(f"fault_scenarios.op_sequence: scenario must be one of {OP_SCENARIOS}, got {scenario!r}")
    dev, W, name = _device(device_type), world_size, dist.group.WORLD.group_name
    rng = random.Random(seed)  # the same sequence on every rank
    kinds = [rng.choice(("ag", "rs")) for _ in range(fault_at + 3)]
    if scenario in ("dies_in_all_gather", "dies_in_reduce_scatter"):
        kinds[fault_at] = "ag" if scenario == "dies_in_all_gather" else "rs"
    layouts = [[(rng.randint(1, 9), rng.randint(1, 33)) for _ in range(rng.randint(1, 4))] for _ in range(2)]
    picks = [rng.randrange(len(layouts)) for _ in kinds]
    arena = None
    if dev.type == "cuda":
        from tide import transport

        most = max(plans.all_gather_layout(l, [torch.bfloat16] * len(l), W).slot_bytes for l in layouts)
        arena = transport.enable(dist.group.WORLD, slot_bytes=most + (64 << 10))  # room for another plan
    for i, kind in enumerate(kinds):
        faulty = rank == FAULTY_RANK and i == fault_at
        rows = [(r + (1 if faulty and scenario == "other_plan" else 0), c) for r, c in layouts[picks[i]]]
        if faulty and scenario == "skips_a_collective":
            _fault(fault_file)
            continue
        if faulty and scenario == "other_plan":
            _fault(fault_file)
        if faulty and scenario.startswith("dies_in") and dev.type == "cpu":
            die(fault_file)
        if faulty and scenario == "stalls":
            stall(fault_file)
        if kind == "ag":
            shards = [torch.randn(r, c, device=dev).bfloat16() for r, c in rows]
            if arena is not None:
                layout = plans.all_gather_layout([s.shape for s in shards], [torch.bfloat16] * len(shards), W)
                outs = arena.slot_views(layout, [torch.bfloat16] * len(shards), arena.slots.acquire())
            else:
                outs = [torch.empty(W * s.numel(), dtype=torch.bfloat16, device=dev) for s in shards]
            torch.ops.tide.all_gather_into_params_(shards, outs, W, name)
        else:
            grads = [torch.randn(W * r, c, device=dev).bfloat16() for r, c in rows]
            shard_grads = [torch.empty(r, c, device=dev) for r, c in rows]
            torch.ops.tide.reduce_scatter_params_(grads, shard_grads, 1.0 / W, False, W, name)
        if faulty and scenario.startswith("dies_in"):
            die(fault_file)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return "finished"


def fsdp_steps(rank: int, world_size: int, device_type: str, scenario: str, rs_mode: str, fault_at: int,
               steps: int, fault_file: str | None = None) -> str:
    """``steps`` FSDP2 training steps of the tiny model on TIDE; rank 1 injects ``scenario`` at its
    ``fault_at``-th all-gather or reduce-scatter, or before step ``fault_at``. Returns ``"finished"``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from tide.fsdp import seam
    from tide.models import PRESETS
    from tide.train import fsdp_model, train_step

    if scenario not in STEP_SCENARIOS + CPU_STEP_SCENARIOS:
        raise ValueError(f"fault_scenarios.fsdp_steps: scenario must be one of {STEP_SCENARIOS + CPU_STEP_SCENARIOS}, "
                         f"got {scenario!r}")
    dev = _device(device_type)
    cfg = PRESETS["tiny"]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dev.type == "cuda" else None
    # FSDP2 over the world group, whose timeout the caller set: a default mesh makes a group of its own with
    # the backend's default timeout (10 min for NCCL), which would bound TIDE's waits too.
    mesh = DeviceMesh.from_group(dist.group.WORLD, dev.type)
    model = fsdp_model(cfg, device=dev, mp_policy=mp, use_tide=True, rs_mode=rs_mode, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if rank == FAULTY_RANK and scenario.startswith("dies_in"):
        hook = "all_gather_into_outputs" if scenario == "dies_in_all_gather" else "reduce_scatter_into_shards"
        issue, calls = getattr(seam, hook), [0]

        def dying(*args):
            calls[0] += 1
            if calls[0] == fault_at and dev.type == "cpu":
                die(fault_file)
            issue(*args)
            if calls[0] == fault_at:
                die(fault_file)

        setattr(seam, hook, dying)
    for step in range(steps):
        if scenario == "dies_between_steps" and rank == FAULTY_RANK and step == fault_at:
            die(fault_file)
        if scenario == "skips_a_step" and rank == FAULTY_RANK and step == fault_at:
            _fault(fault_file)
            continue
        train_step(model, optim, cfg, step, rank, device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return "finished"


def fault_time(fault_file: str) -> float | None:
    """When the faulty rank injected its fault (wall clock), or None if it never did."""
    try:
        with open(fault_file) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def judge(outcomes, fault_file: str) -> dict:
    """How one fault run ended (``outcomes`` from :func:`tide.launch.run_ranks_outcomes`): ``hung`` (ranks
    killed at the deadline), ``errors`` (every rank but the faulty one ended in an error: an exception, or
    TIDE's watchdog exit, its backstop's included), ``s_to_error`` (seconds from the fault to the last of
    those ends), ``faulty`` (how the faulty rank ended)."""
    from tide.transport.watchdog import BACKSTOP_EXIT_CODE, EXIT_CODE

    # Ends that say why: an exception, or TIDE's watchdog exit (its report on stderr; the backstop's stacks).
    ended_by_a_watchdog = (EXIT_CODE, BACKSTOP_EXIT_CODE)
    others = [o for o in outcomes if o.rank != FAULTY_RANK]
    t0 = fault_time(fault_file)
    return {
        "hung": [o.rank for o in outcomes if o.status == "hung"],
        "errors": all(o.status == "error" or (o.status == "exited" and o.detail in ended_by_a_watchdog)
                      for o in others),
        "s_to_error": None if t0 is None else max(o.ended_at for o in others) - t0,
        "faulty": next(o for o in outcomes if o.rank == FAULTY_RANK),
    }
