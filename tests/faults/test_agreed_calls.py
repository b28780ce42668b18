"""The op contract when ranks or threads get out of step, on the reference backend (CPU, gloo): every
fault is a TIDE error on every rank that can see it, never a wait past the timeout, never wrong data.

One run of 3 ranks (``_out_of_step``, shared by most tests here) goes through the cases on groups of its
own, in order; the tests each judge their part. ``TIDE_TIMEOUT_S`` is 2 s and the process groups' own
timeout 30 s, so a wait that ends at 2 s is TIDE's bound, not gloo's.
"""
from __future__ import annotations

import datetime
import os
import threading
import time

import pytest

from tide.launch import run_ranks_outcomes

TIMEOUT_S = 2.0
PG_TIMEOUT_S = 30.0
ENV = {"TIDE_TIMEOUT_S": str(TIMEOUT_S)}
BAD = ("shape", "world_size", "non_contiguous", "requires_grad_out", "requires_grad_input", "outs_alias",
       "outs_overlap_partly", "out_over_another_shard", "shard_grads_alias", "shard_grad_over_its_grad",
       "empty_lists", "functional_zero_d", "unknown_group", "unknown_group_slow_watchers")


def _call(kind, rank, W, name, bad="", value=None):
    """One all-gather ("ag") or reduce-scatter ("rs") of two params; ``bad`` spoils this rank's input.
    Returns the output (checked by the caller)."""
    import torch

    v = float(rank if value is None else value)
    if kind == "ag":
        shards = [torch.full((2, 3), v), torch.full((1, 4), v)]
        outs = [torch.empty(2 * W, 3), torch.empty(W, 4)]
        w = W
        if bad == "shape":
            outs[1] = torch.empty(W + 1, 4)
        elif bad == "world_size":
            w = W + 1
        elif bad == "non_contiguous":
            shards[0] = torch.full((3, 2), v).t()
        elif bad == "requires_grad_out":
            outs[0].requires_grad_()
        elif bad == "requires_grad_input":
            shards[1].requires_grad_()
        elif bad == "outs_alias":
            buf = torch.empty(6 * W)
            outs = [buf.view(2 * W, 3), buf[:4 * W].view(W, 4)]
        elif bad == "outs_overlap_partly":
            buf = torch.empty(10 * W)
            outs = [buf[:6 * W].view(2 * W, 3), buf[6 * W - 1:10 * W - 1].view(W, 4)]
        elif bad == "out_over_another_shard":
            shards[1] = outs[0].view(-1)[:4].view(1, 4)
        elif bad == "empty_lists":
            shards, outs = [], []
        elif bad.startswith("unknown_group"):  # cannot reach the group's exchange: a notice in the default store
            name = "no-such-group"
        if bad == "functional_zero_d":
            torch.ops.tide.all_gather([torch.tensor(v)], w, name)
        else:
            with torch.enable_grad():
                torch.ops.tide.all_gather_into_params_(shards, outs, w, name)
        return outs
    grads = [torch.full((W, 3), v), torch.full((2 * W, 1), v)]
    shard_grads = [torch.empty(1, 3), torch.empty(2, 1)]
    if bad == "shard_grads_alias":
        buf = torch.empty(3)
        shard_grads = [buf.view(1, 3), buf[:2].view(2, 1)]
    elif bad == "shard_grad_over_its_grad":
        grads[0] = torch.full((W, 3), v)
        shard_grads[0] = grads[0][rank:rank + 1]
    torch.ops.tide.reduce_scatter_params_(grads, shard_grads, 1.0, False, W, name)
    return shard_grads


def _out_of_step(rank, W, marker):
    import torch.distributed as dist

    import tide
    from tide.ops import calls

    res = {}

    def attempt(fn):
        t0 = time.monotonic()
        try:
            out = fn()
            return {"ok": True, "out": [o.tolist() for o in out] if isinstance(out, list) else out,
                    "s": time.monotonic() - t0}
        except Exception as e:  # noqa: BLE001
            return {"ok": False, "type": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}

    # 1. One rank's bad input (rank 1), each case followed by a good call on the same group.
    # unknown_group_slow_watchers: the peers' watchers pause after reading rank 1's notice, before its
    # tombstone lands; rank 1 must not go on (and publish its next call in that slot) until it has.
    from tide.ops.call_groups import GroupState

    read_notice = GroupState.notice

    def slow_notice(self, p, since_wall):
        notice = read_notice(self, p, since_wall)
        if notice is not None:
            time.sleep(1.0)
        return notice

    g = dist.new_group(backend="gloo").group_name
    for case in BAD:
        kind = "rs" if case.startswith("shard_grad") else "ag"
        GroupState.notice = slow_notice if case == "unknown_group_slow_watchers" else read_notice
        res[f"bad:{case}"] = attempt(lambda: _call(kind, rank, W, g, case if rank == 1 else ""))
        res[f"after:{case}"] = attempt(lambda: _call("ag", rank, W, g))
    GroupState.notice = read_notice
    # 2. A skipped call among calls of one layout, each declaring its step: caught at the next call.
    g = dist.new_group(backend="gloo").group_name
    res["identity"] = []
    for step in range(3):
        if rank == 1 and step == 1:
            continue
        with tide.call_identity(step=step):
            res["identity"].append(attempt(lambda: _call("ag", rank, W, g, value=10 * step + rank)))
    # 3. A stall past TIDE_TIMEOUT_S (rank 2 sleeps 2 s more): the others raise at the timeout, naming it;
    # it raises when it arrives; the next call works.
    g = dist.new_group(backend="gloo").group_name
    res["before_stall"] = attempt(lambda: _call("rs", rank, W, g))
    if rank == 2:
        time.sleep(TIMEOUT_S + 2.0)
    res["stall"] = attempt(lambda: _call("ag", rank, W, g))
    res["after_stall"] = attempt(lambda: _call("rs", rank, W, g))
    # 4. Two threads on one group, each 8 calls of its own data.
    g = dist.new_group(backend="gloo").group_name
    res["threads"] = []
    lock = threading.Lock()

    def worker(t):
        for i in range(8):
            r = attempt(lambda: _call("ag", rank, W, g, value=100 * t + 10 * i + rank))
            r["want"] = [[[float(100 * t + 10 * i + p)] * 3 for p in range(W) for _ in range(2)],
                         [[float(100 * t + 10 * i + p)] * 4 for p in range(W)]]
            with lock:
                res["threads"].append(r)

    threads = [threading.Thread(target=worker, args=(t,), name=f"worker-{t}") for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 5. A call, then the default group destroyed and re-created under the same name: TIDE works on it.
    res["before_recreate"] = attempt(lambda: _call("ag", rank, W, dist.group.WORLD.group_name))
    name = dist.group.WORLD.group_name
    dist.destroy_process_group()
    # Rank 0's process serves the store: the others connect again once its old server is gone (were they
    # first, they would find the old group's keys there; that race is torch's, not TIDE's).
    if rank == 0:
        open(marker, "w").close()
    deadline = time.monotonic() + 60
    while rank != 0 and not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    res["recreated_name"] = (name, dist.group.WORLD.group_name)
    res["after_recreate"] = [attempt(lambda: _call(k, rank, W, dist.group.WORLD.group_name))
                             for k in ("ag", "rs", "ag")]
    res["error_types"] = [calls.TidePeerError.__name__, calls.TideConcurrentCallError.__name__]
    return res


@pytest.fixture(scope="module")
def out_of_step(tmp_path_factory):
    marker = str(tmp_path_factory.mktemp("recreate") / "destroyed")
    outcomes = run_ranks_outcomes(_out_of_step, 3, marker, timeout=150, pg_timeout=PG_TIMEOUT_S, env=ENV)
    for o in outcomes:
        assert o.status == "ok", (o.rank, o.status, str(o.detail)[-3000:])
    return [o.detail for o in outcomes]


def _gathered(W, values):
    return [[[float(v)] * 3 for v in values for _ in range(2)], [[float(v)] * 4 for v in values]]


@pytest.mark.parametrize("case", BAD)
def test_one_ranks_bad_input_raises_on_every_rank_and_the_group_stays_usable(out_of_step, case):
    for rank, res in enumerate(out_of_step):
        r = res[f"bad:{case}"]
        assert not r["ok"] and r["type"] in ("ValueError", "TypeError"), (rank, r)
        assert r["s"] < 5, (rank, r)  # at once, not at a timeout
        if rank == 1:
            assert r["msg"].startswith("tide."), r
        else:
            assert "rank 1 of group" in r["msg"] and "refused call" in r["msg"], (rank, r["msg"])
        after = res[f"after:{case}"]
        assert after["ok"] and after["out"] == _gathered(3, range(3)), (rank, case, after)


def test_a_skipped_call_with_a_declared_step_raises_on_every_rank(out_of_step):
    for rank, res in enumerate(out_of_step):
        first, second = res["identity"][:2]
        assert first["ok"] and first["out"] == _gathered(3, [0, 1, 2]), (rank, first)
        assert not second["ok"] and "issued different calls" in second["msg"], (rank, second)
        assert "step 1" in second["msg"] and "step 2" in second["msg"], second["msg"]
        # Nothing paired wrongly: every result that came back is the right one.
        for r in res["identity"]:
            assert not r["ok"] or r["out"] in (_gathered(3, [0, 1, 2]), _gathered(3, [20, 21, 22])), r


def test_a_stall_past_tide_timeout_is_named_on_every_rank(out_of_step):
    for rank in (0, 1):
        r = out_of_step[rank]["stall"]
        assert not r["ok"] and r["type"] == "TideTimeoutError", r
        assert TIMEOUT_S - 0.1 < r["s"] < TIMEOUT_S + 3, r  # TIDE's timeout, not gloo's 30 s
        assert "TIDE_TIMEOUT_S" in r["msg"] and "rank(s) [2] are behind" in r["msg"], r["msg"]
        assert "peer 2 (global rank 2), process " in r["msg"], r["msg"]
        assert "its last call is 1, reduce_scatter_params_(" in r["msg"], r["msg"]
        assert "all_gather_into_params_" in r["msg"] and "group" in r["msg"], r["msg"]
    late = out_of_step[2]["stall"]
    assert not late["ok"] and late["type"] == "TideTimeoutError" and "had given up waiting for it" in late["msg"], late
    for rank, res in enumerate(out_of_step):
        assert res["after_stall"]["ok"], (rank, res["after_stall"])


def test_two_threads_on_one_group_raise_or_get_their_own_data(out_of_step):
    kinds = set()
    for rank, res in enumerate(out_of_step):
        assert len(res["threads"]) == 16, res["threads"]
        for r in res["threads"]:
            if r["ok"]:
                assert r["out"] == r["want"], (rank, r)  # never another thread's or another call's data
            else:
                kinds.add(r["type"])
                assert r["msg"].startswith("tide"), r
                assert r["s"] < TIMEOUT_S + 15, r
    assert kinds <= {"TideConcurrentCallError", "RuntimeError", "TideTimeoutError"}, kinds
    concurrent = [r for res in out_of_step for r in res["threads"] if r.get("type") == "TideConcurrentCallError"]
    for r in concurrent:
        assert "already has a TIDE call in flight on this rank" in r["msg"] and "all_gather_into_params_" in r["msg"]


def test_recreating_the_default_group_starts_tide_afresh(out_of_step):
    for rank, res in enumerate(out_of_step):
        assert res["before_recreate"]["ok"], res["before_recreate"]
        old, new = res["recreated_name"]
        assert old == new, res["recreated_name"]  # the same name, a new group
        assert all(r["ok"] for r in res["after_recreate"]), (rank, [r.get("msg") for r in res["after_recreate"]])
        assert res["after_recreate"][0]["out"] == _gathered(3, range(3))


def _skips_the_second_of_three(rank, W):
    """The issue's case: three identical all-gathers, rank 1 skips the second and ends."""
    import torch
    import torch.distributed as dist

    import tide  # noqa: F401

    got = []
    for i in range(3):
        if rank == 1 and i == 1:
            continue
        out = torch.empty(2)
        torch.ops.tide.all_gather_into_params_([torch.tensor([10.0 * (i + 1) + rank])], [out], 2,
                                               dist.group.WORLD.group_name)
        got.append(out.tolist())
    return got


def test_a_skipped_direct_call_ends_the_unmatched_rank_in_a_named_error():
    """Two direct calls with the same layout cannot be told apart (as with NCCL): rank 1's third call pairs
    with rank 0's second. Rank 0's third call is left unmatched; it raises as soon as rank 1 has ended, naming
    the op, the group and rank 1's last call (or at TIDE's timeout, should rank 1 take longer to end)."""
    start = time.monotonic()
    rank0, rank1 = run_ranks_outcomes(_skips_the_second_of_three, 2, timeout=120, pg_timeout=PG_TIMEOUT_S, env=ENV)
    assert rank1.status == "ok" and rank1.detail == [[10.0, 11.0], [20.0, 31.0]], rank1  # the documented pairing
    assert rank0.status == "error", rank0
    msg = rank0.detail
    assert "all_gather_into_params_ on group '0'" in msg and "at call 3" in msg, msg
    assert ("TidePeerError" in msg and "rank(s) [1] ended" in msg) or (
        "TideTimeoutError" in msg and "rank(s) [1] are behind" in msg), msg
    assert "peer 1 (global rank 1), process " in msg and "its last call is 2, all_gather_into_params_(" in msg, msg
    assert rank0.seconds - rank1.seconds < TIMEOUT_S + 15 and time.monotonic() - start < 100


def _dies_in_a_collective(rank, W):
    import torch
    import torch.distributed as dist

    import tide  # noqa: F401
    from tide.ops import reference

    if rank == 1:  # agreed on its first call, then ends as it would issue its collective: rank 0's fails
        reference._all_gather_single = lambda *args, **kwargs: os._exit(3)
    out = torch.empty(2 * W, 1000)
    for _ in range(3):
        torch.ops.tide.all_gather_into_params_([torch.ones(2, 1000)], [out], W, dist.group.WORLD.group_name)
    return "finished"


def test_a_peer_that_dies_in_a_collective_is_named_with_gloos_error_as_the_cause():
    rank0, rank1 = run_ranks_outcomes(_dies_in_a_collective, 2, timeout=120, pg_timeout=PG_TIMEOUT_S, env=ENV)
    assert rank1.status == "exited" and rank1.detail == 3, rank1
    assert rank0.status == "error", rank0
    msg = rank0.detail
    assert "TidePeerError" in msg and "all_gather_into_params_" in msg and "group '0'" in msg, msg
    assert "its collective failed at call 1: rank(s) [1] ended" in msg, msg
    assert "direct cause of the following exception" in msg, msg  # gloo's error kept as the cause
