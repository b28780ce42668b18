"""The CPU fault campaign (reference backend, gloo): rounds of random faults in one run of W ranks, each
round on a fresh group, the last one a kill: one rank's bad input (the ops' checks, the typed entry points'
arguments, a meta tensor, a scale unlike its peers'), a stall, a skipped call, a skipped step, a skipped last
call, two threads on a group; the kill before a call, before the rank's first call on the group, in the
exchange or in the collective. :func:`campaign` is a rank function for
:func:`tide.launch.run_ranks_outcomes` (a module of its own, so that ranks import it by name, also when
``bench/fault_campaign.py`` is the main script); :func:`judge_campaign` judges its outcomes
(``tests/faults/test_campaign.py``, ``bench/fault_campaign.py --campaign``).
"""
from __future__ import annotations

import os
import random
import time
import zlib

import torch
import torch.distributed as dist

from fault_scenarios import DIED, fault_time

SOFT_FAULTS = ("bad_input", "stalls", "skips_a_call", "skips_a_step", "skips_the_last_call", "threads")
BAD_INPUTS = ("shape", "non_contiguous", "requires_grad", "world_size", "overlapping_outputs",
              "input_in_an_output", "empty_lists", "functional_zero_d", "unknown_group", "bare_tensor",
              "group_type", "meta_tensor", "scale")
KILLS = ("before_a_call", "before_its_first_call", "in_the_exchange", "in_the_collective")
OPS_PER_ROUND = 6
STEPS_PER_ROUND = 3  # skips_a_step: the round's ops are 3 steps of 2 module calls


def campaign_plan(seed: int, world_size: int, rounds: int) -> list[dict]:
    """The rounds of one campaign run, the same on every rank: every soft fault once first, then at random,
    the last round a kill; each with its faulty rank, its point and its own seed."""
    rng = random.Random(seed)
    plan = []
    for r in range(rounds):
        kind = SOFT_FAULTS[r] if r < len(SOFT_FAULTS) else rng.choice(SOFT_FAULTS)
        kind = "bad_input" if kind == "stalls" and r >= len(SOFT_FAULTS) else kind  # one stall per run is enough
        at = {"skips_the_last_call": OPS_PER_ROUND - 1,
              "skips_a_step": rng.randrange(STEPS_PER_ROUND - 1)}.get(kind, rng.randrange(OPS_PER_ROUND - 1))
        plan.append({"kind": kind, "faulty": rng.randrange(world_size), "at": at, "seed": rng.randrange(1 << 30),
                     "variant": rng.choice(BAD_INPUTS) if kind == "bad_input" else ""})
    # The kill comes before the last op: a peer that died after its last collective had sent its data leaves
    # nothing to fail, so the next op is where its peers must end.
    kill = rng.choice(KILLS)
    at = 0 if kill == "before_its_first_call" else rng.randrange(OPS_PER_ROUND - 1)
    plan.append({"kind": "kill", "faulty": rng.randrange(world_size), "at": at, "seed": rng.randrange(1 << 30),
                 "variant": kill})
    return plan


def _values(seed: int, *key, shape) -> torch.Tensor:
    """Small integers (sums of a few stay exact in fp32, in any order), the same on every rank for ``key``."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((seed, *key)).encode()))
    return torch.randint(-8, 9, shape, generator=gen).float()


def _one_op(group, rnd: dict, i: int, kind: str, shapes, rank: int, thread: str = "", bad: str = "") -> str:
    """Issue op ``i`` of a round (``bad``: this rank's bad input) and check its result against every rank's
    data: ``"ok"`` or ``"wrong"``; raises what the op raises."""
    W, name, seed = group.size(), group.group_name, rnd["seed"]
    w = W + 1 if bad == "world_size" else W
    gname = "no-such-group" if bad == "unknown_group" else name
    if bad in ("bare_tensor", "group_type"):  # the typed entry point, given one tensor or a group's name
        import tide

        shards = [_values(seed, i, thread, rank, j, shape=s) for j, s in enumerate(shapes)]
        outs = [torch.empty(W * s[0], s[1]) for s in shapes]
        typed = tide.ops.all_gather_into_params if kind == "ag" else tide.ops.reduce_scatter_params
        typed(shards[0] if bad == "bare_tensor" else shards, outs, name if bad == "group_type" else group)
        return "wrong"  # refused, or nothing to compare
    if kind == "ag":
        shards = [_values(seed, i, thread, rank, j, shape=s) for j, s in enumerate(shapes)]
        want = [torch.cat([_values(seed, i, thread, p, j, shape=s) for p in range(W)]) for j, s in enumerate(shapes)]
        outs = [torch.full((W * s[0], s[1]), float("nan")) for s in shapes]
        if bad == "shape":
            outs[0] = torch.empty(W * shapes[0][0] + 1, shapes[0][1])
        elif bad == "non_contiguous":
            shards[0] = torch.zeros(2, 4)[:, ::2]
        elif bad == "requires_grad":
            outs[0].requires_grad_()
        elif bad == "overlapping_outputs" and len(outs) > 1:  # the last output starts inside the first
            buf = torch.empty(sum(o.numel() for o in outs))
            outs[-1] = buf[1:1 + outs[-1].numel()].view(outs[-1].shape)
            outs[0] = buf[:outs[0].numel()].view(outs[0].shape)
        elif bad in ("input_in_an_output", "overlapping_outputs"):  # the shard in its output, another rank's rows
            other = (rank + 1) % W
            rows = outs[0][other * shapes[0][0]:(other + 1) * shapes[0][0]]
            rows.copy_(shards[0])
            shards[0] = rows
        elif bad == "empty_lists":
            shards, outs = [], []
        elif bad == "meta_tensor":
            outs[0] = torch.empty_like(outs[0], device="meta")
        if bad == "functional_zero_d":
            torch.ops.tide.all_gather([torch.tensor(1.0)], w, gname)
        elif bad == "" and thread == "" and i % 3 == 2:  # the functional form now and then
            outs = torch.ops.tide.all_gather(shards, w, gname)
        else:
            torch.ops.tide.all_gather_into_params_(shards, outs, w, gname)
        return "ok" if all(torch.equal(o.view(g.shape), g) for o, g in zip(outs, want)) else "wrong"
    grads = [_values(seed, i, thread, rank, j, shape=(W * s[0], s[1])) for j, s in enumerate(shapes)]
    every = [[_values(seed, i, thread, p, j, shape=(W * s[0], s[1])) for j, s in enumerate(shapes)] for p in range(W)]
    want = [sum(every[p][j] for p in range(W))[rank * s[0]:(rank + 1) * s[0]] for j, s in enumerate(shapes)]
    shard_grads = [torch.full(s, float("nan")) for s in shapes]
    if bad == "shape":
        shard_grads[0] = torch.empty(shapes[0][0] + 1, shapes[0][1])
    elif bad == "non_contiguous":
        grads[0] = torch.zeros(2, 4)[:, ::2]
    elif bad == "requires_grad":
        shard_grads[0].requires_grad_()
    elif bad == "overlapping_outputs" and len(shard_grads) > 1:  # every shard grad at the start of one buffer
        buf = torch.empty(sum(s.numel() for s in shard_grads))
        shard_grads = [buf[:s.numel()].view(s.shape) for s in shard_grads]
    elif bad in ("input_in_an_output", "overlapping_outputs"):  # the shard grad is the gradient's own rows
        shard_grads[0] = grads[0][rank * shapes[0][0]:(rank + 1) * shapes[0][0]]
    elif bad == "empty_lists":
        grads, shard_grads = [], []
    elif bad == "meta_tensor":
        grads[0] = torch.empty_like(grads[0], device="meta")
    if bad == "functional_zero_d":
        torch.ops.tide.reduce_scatter([torch.tensor(1.0)], 1.0, None, w, gname)
    elif bad == "" and thread == "" and i % 3 == 2:
        shard_grads = torch.ops.tide.reduce_scatter(grads, 1.0, None, w, gname)
    else:  # scale: this rank's sum would be scaled unlike its peers'
        torch.ops.tide.reduce_scatter_params_(grads, shard_grads, 0.5 if bad == "scale" else 1.0, False, w, gname)
    return "ok" if all(torch.equal(s, g) for s, g in zip(shard_grads, want)) else "wrong"


def _event(i, thread: str, t0: float, status: str, e: BaseException | None = None) -> dict:
    ev = {"i": i, "thread": thread, "t0": t0, "t1": time.time(), "status": status}
    if e is not None:
        ev.update(type=type(e).__name__, msg=str(e))
    return ev


def _run_ops(group, rnd: dict, rank: int, thread: str, events: list, lock=None, fault=None) -> None:
    """The round's ops on this rank until the first error (``fault(i)`` injects this rank's fault before op
    i: returns "skip", a bad input's name, or "")."""
    from tide.meta.call_site import call_identity

    rng = random.Random(rnd["seed"])
    shapes = [(rng.randint(1, 4), rng.randint(1, 6)) for _ in range(rng.randint(1, 3))]
    kinds = [rng.choice(("ag", "rs")) for _ in range(OPS_PER_ROUND)]
    if rnd["variant"] == "scale":  # a scale only a reduce-scatter has
        kinds[rnd["at"]] = "rs"
    per_step = OPS_PER_ROUND // STEPS_PER_ROUND
    for i in range(OPS_PER_ROUND):
        what = fault(i) if fault else ""
        if what == "skip":
            continue
        if rnd["kind"] == "skips_a_call":
            identity = {"step": i}
        elif rnd["kind"] == "skips_a_step":
            identity = {"fqn": f"layers.{i % per_step}", "phase": "forward", "count": i // per_step + 1,
                        "step": i // per_step}
        else:
            identity = {}
        t0 = time.time()
        try:
            with call_identity(**identity):
                status = _one_op(group, rnd, i, kinds[i], shapes, rank, thread, what)
            ev = _event(i, thread, t0, status)
        except Exception as e:  # noqa: BLE001 - every error is recorded and judged
            ev = _event(i, thread, t0, "error", e)
        if lock:
            with lock:
                events.append(ev)
        else:
            events.append(ev)
        if ev["status"] == "error":
            return


def campaign(rank: int, world_size: int, seed: int, rounds: int, fault_file: str | None = None) -> list[dict]:
    """A campaign run on the reference backend (CPU, gloo): the rounds of :func:`campaign_plan`, each on a
    fresh group, the last one a kill (the faulty rank exits). The faulty rank of round k writes the time of
    its fault to ``{fault_file}.{k}``. Returns
    this rank's rounds: the plan's fields plus ``events`` (every op: its status, and an error's type and
    message, with wall times) and ``fault_t`` (when this rank injected the round's fault)."""
    import threading

    import tide  # noqa: F401 (registers the ops)
    from tide.ops import call_watcher, calls
    from tide.timeouts import timeout_for

    out = []
    for k, rnd in enumerate(campaign_plan(seed, world_size, rounds)):
        group = dist.new_group(backend="gloo")
        rec = {**rnd, "events": [], "fault_t": None}
        out.append(rec)
        faulty = rank == rnd["faulty"]
        timeout = timeout_for(group)

        def mark(rec=rec, k=k) -> None:  # the fault's time, in the round's file (a killed rank returns nothing)
            rec["fault_t"] = time.time()
            if fault_file:
                with open(f"{fault_file}.{k}", "w") as f:
                    f.write(repr(rec["fault_t"]))

        def fault(i, rnd=rnd, faulty=faulty, mark=mark, timeout=timeout):
            if not faulty:
                return ""
            kind, at = rnd["kind"], rnd["at"]
            if kind == "skips_a_step":
                per_step = OPS_PER_ROUND // STEPS_PER_ROUND
                if i // per_step != at:
                    return ""
                if i % per_step == 0:
                    mark()
                return "skip"
            if i != at:
                return ""
            mark()
            if kind == "bad_input":
                return rnd["variant"]
            if kind == "stalls":
                time.sleep(timeout + 1.0)
                return ""
            if kind in ("skips_a_call", "skips_the_last_call"):
                return "skip"
            if kind == "kill":
                if rnd["variant"] in ("before_a_call", "before_its_first_call"):
                    os._exit(DIED)
                if rnd["variant"] == "in_the_exchange":  # after publishing its record, before the peers'
                    call_watcher.WATCHER.watch = lambda w: os._exit(DIED)
                else:  # after its collectives were issued
                    calls.Call.wait = lambda self, works: os._exit(DIED)
            return ""

        if rnd["kind"] == "threads":
            lock = threading.Lock()
            rec["fault_t"] = time.time()
            threads = [threading.Thread(target=_run_ops, args=(group, rnd, rank, name, rec["events"], lock),
                                        name=f"campaign-{name}") for name in ("a", "b")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            _run_ops(group, rnd, rank, "", rec["events"], fault=fault)
            if rnd["kind"] == "bad_input":  # the group is still usable: one more call on every rank
                t0 = time.time()
                try:
                    ev = _event("after", "", t0, _one_op(group, rnd, OPS_PER_ROUND, "ag", [(2, 3)], rank))
                except Exception as e:  # noqa: BLE001
                    ev = _event("after", "", t0, "error", e)
                rec["events"].append(ev)
        if rnd["kind"] != "kill":
            dist.destroy_process_group(group)
    return out


LOCAL_BOUND_S = 5.0  # one rank's bad input is refused by its peers within this of the fault


def judge_campaign(outcomes, fault_file: str, bound_s: float) -> dict:
    """How a campaign run ended (``outcomes`` of :func:`tide.launch.run_ranks_outcomes` running
    :func:`campaign`): ``hung`` ranks, ``wrong`` (results that returned without an error but differ from
    the expected data), ``late`` (a survivor whose first error came more than ``bound_s`` after the fault,
    or never; :data:`LOCAL_BOUND_S` after one rank's bad input), ``not_tide`` (errors whose message does
    not start with ``tide``), ``worst_s`` (the slowest survivor's seconds from fault to error) and
    ``rounds`` (how many were judged)."""
    verdict = {"hung": [o.rank for o in outcomes if o.status == "hung"], "wrong": [], "late": [], "not_tide": [],
               "worst_s": 0.0, "rounds": 0, "failed_ranks": []}
    by_rank = {}
    for o in outcomes:
        if o.status == "ok":
            by_rank[o.rank] = o.detail
        elif o.status != "exited" or o.detail != DIED:
            verdict["failed_ranks"].append((o.rank, o.status, str(o.detail)[-2000:]))
    if not by_rank:
        return verdict
    n_rounds = len(next(iter(by_rank.values())))
    for k in range(n_rounds):
        recs = {r: rounds[k] for r, rounds in by_rank.items() if k < len(rounds)}
        rnd = next(iter(recs.values()))
        t0 = fault_time(f"{fault_file}.{k}")
        verdict["rounds"] += 1
        for r, rec in recs.items():
            for ev in rec["events"]:
                if ev["status"] == "wrong":
                    verdict["wrong"].append((k, rnd["kind"], rnd["variant"], r, ev["i"], ev["thread"]))
                if ev["status"] == "error" and not ev["msg"].startswith("tide"):
                    verdict["not_tide"].append((k, rnd["kind"], r, ev["type"], ev["msg"][:300]))
        if rnd["kind"] == "threads":  # every op ends, in a result or an error, within the bound
            for r, rec in recs.items():
                worst = max((ev["t1"] - ev["t0"] for ev in rec["events"]), default=0.0)
                verdict["worst_s"] = max(verdict["worst_s"], worst)
                if worst > bound_s or len(rec["events"]) == 0:
                    verdict["late"].append((k, "threads", r, worst))
            continue
        for r, rec in recs.items():
            if r == rnd["faulty"]:
                continue
            errors = [ev for ev in rec["events"] if ev["status"] == "error"]
            s = None if not errors or t0 is None else errors[0]["t1"] - t0
            if s is not None:
                verdict["worst_s"] = max(verdict["worst_s"], s)
            if s is None or s > (LOCAL_BOUND_S if rnd["kind"] == "bad_input" else bound_s):
                verdict["late"].append((k, rnd["kind"], rnd["variant"], r, s))
            after = [ev for ev in rec["events"] if ev["i"] == "after"]
            if rnd["kind"] == "bad_input" and after and after[0]["status"] != "ok":
                verdict["late"].append((k, "bad_input: group unusable after", rnd["variant"], r, after[0].get("msg")))
    return verdict
