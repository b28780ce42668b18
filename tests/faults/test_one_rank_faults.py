"""Faults that start on one rank, or before a group's first TIDE call, on the reference backend (CPU, gloo):
every one ends on every rank in an error naming the op, the argument or the peer, within ``TIDE_TIMEOUT_S``
+ 15 s of the call that cannot complete (a local refusal: its peers within 5 s), or works. The process
groups' own timeout is 60 s and ``TIDE_TIMEOUT_S`` 3 s, so an error before 18 s is TIDE's bound, not gloo's.
After a refusal that was local, the group stays usable: each case ends with a good call checked against the
float64 reference.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tide.launch import run_ranks_outcomes

TIMEOUT_S = 3.0
PG_TIMEOUT_S = 60.0
LOCAL_BOUND_S = 5.0  # a peer of a rank whose refusal was local raises within this of its call
BOUND_S = TIMEOUT_S + 15.0
ENV = {"TIDE_TIMEOUT_S": str(TIMEOUT_S)}


def _attempt(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
        return {"ok": True, "s": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - the test judges the type and words
        return {"ok": False, "type": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}


def _good_call(rank: int, W: int, group) -> bool:
    """An all-gather and a reduce-scatter of fresh random data into poisoned outputs, checked against float64."""
    import torch

    import tide

    gen = torch.Generator().manual_seed(1234)
    full = [torch.randn(W * 3, 5, generator=gen), torch.randn(W * 2 - 1, 3, generator=gen)]
    shards = [torch.zeros(3, 5), torch.zeros(2, 3)]
    for s, f in zip(shards, full):
        rows = f[rank * s.shape[0]:(rank + 1) * s.shape[0]]
        s[:rows.shape[0]] = rows
    outs = [torch.full((W * 3, 5), float("nan")), torch.full((W * 2, 3), float("nan"))]
    tide.ops.all_gather_into_params(shards, outs, group)
    ok = all(torch.equal(o[:f.shape[0]], f) for o, f in zip(outs, full))
    grads = [(f * (rank + 1)).bfloat16() for f in full]
    shard_grads = [torch.full((3, 5), float("nan")), torch.full((2, 3), float("nan"))]
    tide.ops.reduce_scatter_params(grads, shard_grads, group, scale=0.5)
    for g, s, f in zip(grads, shard_grads, full):
        want = sum((f * (r + 1)).bfloat16().double() for r in range(W)) * 0.5
        rows = want[rank * s.shape[0]:(rank + 1) * s.shape[0]]
        ok &= torch.allclose(s[:rows.shape[0]].double(), rows, rtol=1e-6, atol=1e-6)
        ok &= bool((s[rows.shape[0]:] == 0).all())
    return ok


def _two_params(W: int):
    import torch

    return [torch.randn(2, 3), torch.randn(1, 4)], [torch.full((2 * W, 3), float("nan")),
                                                    torch.full((W, 4), float("nan"))]


def local_refusal(rank: int, W: int, case: str) -> dict:
    """Rank 1 makes ``case``'s mistake in one call, the others call correctly; then every rank calls correctly."""
    import torch
    import torch.distributed as dist

    import tide

    group = dist.new_group(backend="gloo")
    shards, outs = _two_params(W)
    grads = [torch.randn(W, 3).bfloat16(), torch.randn(2 * W, 1).bfloat16()]
    shard_grads = [torch.empty(1, 3), torch.empty(2, 1)]
    bad = rank == 1
    if case == "scale":
        call = lambda: tide.ops.reduce_scatter_params(grads, shard_grads, group, scale=1.0 if bad else 1.0 / W)
    elif case == "bare_tensor":
        call = lambda: tide.ops.all_gather_into_params(shards[0] if bad else shards, outs, group)
    elif case == "group_type":
        call = lambda: tide.ops.all_gather_into_params(shards, outs, group.group_name if bad else group)
    elif case == "meta_tensor":
        meta = [torch.empty_like(o, device="meta") for o in outs]
        call = lambda: tide.ops.all_gather_into_params(shards, meta if bad else outs, group)
    elif case == "timeout_knob":
        def call():
            if bad:
                os.environ["TIDE_TIMEOUT_S"] = "soon"
            try:
                tide.ops.all_gather_into_params(shards, outs, group)
            finally:
                os.environ["TIDE_TIMEOUT_S"] = str(TIMEOUT_S)
    else:
        raise ValueError(case)
    return {"bad": _attempt(call), "after": _good_call(rank, W, group)}


LOCAL_CASES = {  # what every rank's error must name
    "scale": ("issued different calls", "scale="),
    "bare_tensor": ("shards must be a list of tensors",),
    "group_type": ("group must be a torch.distributed.ProcessGroup",),
    "meta_tensor": ("meta",),
    "timeout_knob": ("TIDE_TIMEOUT_S",),
}


@pytest.mark.parametrize("case", sorted(LOCAL_CASES))
def test_one_ranks_mistake_raises_on_every_rank_at_once(case):
    outcomes = run_ranks_outcomes(local_refusal, 2, case, timeout=120, pg_timeout=PG_TIMEOUT_S, env=ENV)
    for o in outcomes:
        assert o.status == "ok", o
        bad = o.detail["bad"]
        assert not bad["ok"] and bad["s"] < LOCAL_BOUND_S, (o.rank, bad)
        for words in LOCAL_CASES[case]:
            assert words in bad["msg"], (o.rank, bad)
        if o.rank == 0:  # the peer that called correctly names the rank that refused
            assert "rank 1" in bad["msg"], bad
        assert o.detail["after"], o


def every_rank_unknown_group(rank: int, W: int, how: str) -> dict:
    """Every rank names a group it does not know (destroyed, or never created); then a good call."""
    import torch
    import torch.distributed as dist

    import tide  # noqa: F401 (registers the ops)

    group = dist.new_group(backend="gloo")
    name = group.group_name
    if how == "destroyed":
        dist.destroy_process_group(group)
    else:
        name = "no-such-group"
    shards, outs = _two_params(W)
    bad = _attempt(lambda: torch.ops.tide.all_gather_into_params_(shards, outs, W, name))
    return {"bad": bad, "after": _good_call(rank, W, dist.new_group(backend="gloo"))}


@pytest.mark.parametrize("how", ["destroyed", "unknown"])
def test_a_group_no_rank_knows_raises_at_once(how):
    # No TIDE_TIMEOUT_S: the bound is the process groups' 60 s, which no rank may wait for.
    outcomes = run_ranks_outcomes(every_rank_unknown_group, 2, how, timeout=120, pg_timeout=PG_TIMEOUT_S)
    for o in outcomes:
        assert o.status == "ok", o
        bad = o.detail["bad"]
        assert not bad["ok"] and bad["s"] < LOCAL_BOUND_S \
            and "does not name a registered process group" in bad["msg"], bad
        assert o.detail["after"], o


def dies_before_first_call(rank: int, W: int) -> dict:
    """Rank 1 calls on one group, then dies before its first call on a second; rank 0 calls on the second."""
    import torch.distributed as dist

    first, second = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    assert _good_call(rank, W, first)
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)
    shards, outs = _two_params(W)
    import tide

    return _attempt(lambda: tide.ops.all_gather_into_params(shards, outs, second))


def test_a_peer_that_dies_before_its_first_call_on_a_group_is_named_as_ended():
    outcomes = run_ranks_outcomes(dies_before_first_call, 2, timeout=120, pg_timeout=PG_TIMEOUT_S, env=ENV)
    assert outcomes[1].status == "exited" and outcomes[1].detail == 3, outcomes[1]
    got = outcomes[0].detail
    assert outcomes[0].status == "ok" and not got["ok"], outcomes[0]
    assert got["type"] == "TidePeerError" and "rank(s) [1] ended" in got["msg"], got
    assert got["s"] < TIMEOUT_S, got  # named as ended, not at the timeout


def calls_after_the_others_left(rank: int, W: int) -> dict:
    """Rank 1 stalls past rank 0's timeout, then calls; rank 0, the store's host, raises and leaves."""
    import torch.distributed as dist

    import tide

    shards, outs = _two_params(W)
    if rank == 1:
        time.sleep(TIMEOUT_S + 6)
    got = _attempt(lambda: tide.ops.all_gather_into_params(shards, outs, dist.group.WORLD))
    if rank == 0:
        print(repr(got), flush=True)
        os._exit(0)  # the store's server goes with this process
    return got


def test_a_peer_that_calls_after_the_others_left_raises_within_the_bound():
    outcomes = run_ranks_outcomes(calls_after_the_others_left, 2, timeout=120, pg_timeout=PG_TIMEOUT_S, env=ENV)
    late = outcomes[1]
    assert late.status == "ok", late
    assert not late.detail["ok"] and late.detail["s"] < BOUND_S, late.detail
    assert late.detail["type"] in ("TidePeerError", "TideTimeoutError"), late.detail


def threaded_op_call(_unused=None) -> list:
    """Two ranks as threads of this process (torch's threaded test backend) each call a TIDE op."""
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import spawn_threads_and_init_comms

    out = []

    @spawn_threads_and_init_comms(world_size=2)
    def body(self):
        shards, outs = _two_params(2)
        import tide

        out.append(_attempt(lambda: tide.ops.all_gather_into_params(shards, outs, dist.group.WORLD)))

    body(None)
    return out


def test_ranks_that_are_threads_are_refused_at_once():
    # In a process of its own: the threaded backend replaces torch.distributed's world for the process.
    code = ("import json; from tests.faults.test_one_rank_faults import threaded_op_call; "
            "print(json.dumps(threaded_op_call()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **ENV}, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(got) == 2, got
    for g in got:
        assert not g["ok"] and g["s"] < LOCAL_BOUND_S and "threads of one process" in g["msg"], g


def enabled_on_one_rank(rank: int, W: int) -> dict:
    """Two trainings of the same model: stock on every rank, then with ``tide.fsdp.enable`` on rank 0 only."""
    import warnings

    import numpy as np

    from tests.fsdp.workers import _train
    from tide.models import PRESETS

    cfg = PRESETS["tiny"]
    _, _, stock = _train(cfg, rank, use_tide=False, steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, mixed = _train(cfg, rank, use_tide=rank == 0, steps=2)
    same = stock["losses"] == mixed["losses"] and all(
        np.array_equal(a, b) for a, b in zip(stock["params"] + stock["grads"], mixed["params"] + mixed["grads"]))
    return {"same": same, "stats": mixed["stats"], "warnings": [str(w.message) for w in caught]}


def test_enable_on_one_rank_only_trains_as_stock_on_every_rank():
    outcomes = run_ranks_outcomes(enabled_on_one_rank, 2, timeout=240, pg_timeout=PG_TIMEOUT_S, env=ENV)
    for o in outcomes:
        assert o.status == "ok", o
        assert o.detail["same"], o.rank  # bit for bit what stock FSDP2 gives
    tide_rank = outcomes[0].detail
    for kind in ("all_gather", "reduce_scatter"):
        paths = tide_rank["stats"][kind]
        assert set(paths) == {"stock:peer_not_enabled"}, paths
    said = [w for w in tide_rank["warnings"] if "stock:peer_not_enabled" in w]
    assert said and "group rank(s) [1]" in said[0], tide_rank["warnings"]
