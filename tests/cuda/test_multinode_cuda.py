"""The multi-node schedule on CUDA tensors (skipped without CUDA): nodes emulated on this machine's GPUs
with ``LOCAL_WORLD_SIZE``. One GPU per rank when there are enough (NCCL moves the rails' pieces),
otherwise ranks share the GPUs over gloo (the pieces are staged through host memory).

- The ops: the CPU test's check (tests/multinode/test_reference_multinode.py) with inputs and outputs on
  the GPU: all-gathers bit-exact, reduce-scatters bit-exact against the documented fp32 order (node
  partials in local order, then nodes in order) and close to a float64 sum, outputs poisoned first.
- FSDP2 with ``TIDE_CUDA_MULTINODE=1`` on 2 nodes x 1 GPU: parity with stock FSDP2 (the tolerances of
  tests/cuda/test_fsdp_cuda.py), every collective counted ``tide_multinode``, no arena created, every op
  call running the schedule, rounds counted on the rails.
- 2 nodes x 2 (4 ranks) with a node arena (tide/transport/node_leg.py): all-gathers into outputs bound in its
  slots push the intra-node leg by copy engine, reduce-scatters sum their node partials there, both
  bit-exact; FSDP2 parity with the blocks bound there, both RS modes (Slot-Reuse reads the gradients
  from the node arena's slot).
- Both with the direct NCCL rails (``TIDE_MULTINODE_RAILS=nccl``, tide/multinode/nccl_rails.py) too: the
  same answers, every rail round counted ``nccl_direct``; closed and opened again (a new communicator,
  fresh store keys), the same once more; spans they cannot move refused with the op's name.
"""
from __future__ import annotations

import re

import pytest
import torch

from tests.cuda import ranks
from tests.cuda.test_fsdp_cuda import _assert_parity, fsdp_cuda
from tests.multinode.test_reference_multinode import _check
from tide.launch import run_ranks

pytestmark = pytest.mark.cuda


def _backend(world_size: int) -> str:
    return "nccl" if torch.cuda.device_count() >= world_size else "gloo"


# 2 x 4 and 4 x 2 need one GPU per rank (an 8-GPU machine): 8 ranks sharing fewer GPUs over gloo
# add nothing to 2 x 2's coverage and take minutes.
@pytest.mark.parametrize("nodes,local", [(2, 1), (2, 2), (2, 4), (4, 2)])
def test_ops_run_the_multinode_schedule_bit_exact(nodes, local):
    ws, seed = nodes * local, 5000 + 10 * nodes + local
    if ws > 4 and torch.cuda.device_count() < ws:
        pytest.skip(f"{nodes} x {local} needs {ws} GPUs, {torch.cuda.device_count()} visible")
    print(f"seed {seed}")
    env = {**ranks.ENV, "LOCAL_WORLD_SIZE": str(local)}
    results = run_ranks(_check, ws, seed, 3, (nodes, local), "cuda", backend=_backend(ws), device_type="cuda",
                        env=env, timeout=300)
    assert results == [3] * ws


def _check_node_arena(rank, world_size, seed, trials):
    """2 x 2 with a node arena: all-gathers into outputs that lie in its slots push the intra-node leg by
    copy engine (node_leg.push_spans), both slots in turn; reduce-scatters sum their node partials there
    (node_leg.reduce_partials); both bit-exact, outputs poisoned first; a span outside the slot is refused
    with the op's name before anything is issued."""
    import math
    import random

    import torch.distributed as dist

    import tide
    from tests.multinode.test_reference_multinode import DTYPES, _expected_shard, _inputs
    from tide.meta.layout import shard_rows
    from tide.meta import plans
    from tide.transport import node_leg as nodes
    from tide import routes

    group, W = dist.group.WORLD, world_size
    dev = torch.device("cuda", torch.cuda.current_device())
    node = nodes.enable(group, slot_bytes=1 << 21)
    assert routes.of(group).node_arena is node and node.world_size == 2, node
    tide.reset_stats()
    rng = random.Random(seed)
    for t in range(trials):
        # Padded shards (c, *rest) of 1 B to 12 KiB, dtypes mixed; the flat outputs at their places in the slot.
        shapes = [(rng.randint(1, 6), rng.randint(1, 700)) for _ in range(rng.randint(1, 5))] + [(rng.randint(1, 3),)]
        in_dt = [rng.choice(DTYPES) for _ in shapes]
        out_dt = [rng.choice(DTYPES) for _ in shapes]
        every = [_inputs(seed * 100 + t, W, r, shapes, in_dt) for r in range(W)]
        layout = plans.all_gather_layout([(math.prod(sh),) for sh in shapes], out_dt, W)
        outs = node.slot_views(layout, out_dt, t % 2)
        for o in outs:
            o.fill_(float("nan"))
        tide.ops.all_gather_into_params([x.to(dev) for x in every[rank]], outs, group)
        for i, (o, dt) in enumerate(zip(outs, out_dt)):
            want = torch.cat([every[r][i].to(dt).reshape(-1) for r in range(W)])
            assert torch.equal(o.cpu(), want), f"seed {seed} trial {t} rank {rank}: all-gather param {i} differs"
        # Reduce-scatter: the node partials summed on the node arena (contributions pushed by copy engine into
        # its staging ring), bit-exact against the documented order; bf16/fp16/fp32, uneven rows.
        gshapes = [(rng.randint(0, 3 * W + 2), rng.randint(1, 300)) for _ in range(rng.randint(1, 4))]
        gshapes.append((rng.randint(1, W),))
        gdt = [rng.choice(DTYPES + (torch.float16,)) for _ in gshapes]
        grads_all = [_inputs(seed * 100 + t + 7, W, r, gshapes, gdt) for r in range(W)]
        scale, accumulate = rng.choice([1.0, 1.0 / W, rng.uniform(0.1, 2.0)]), rng.random() < 0.4
        init = [torch.randn((shard_rows(sh[0], W), *sh[1:]), generator=torch.Generator().manual_seed(t + rank))
                for sh in gshapes]
        shard_grads = [(x.clone() if accumulate else torch.full_like(x, float("nan"))).to(dev) for x in init]
        tide.ops.reduce_scatter_params([g.to(dev) for g in grads_all[rank]], shard_grads, group, scale=scale,
                                       accumulate=accumulate)
        for i, sh in enumerate(gshapes):
            want, _ = _expected_shard(grads_all, i, sh, rank, 2, 2, scale, init[i], accumulate)
            assert torch.equal(shard_grads[i].cpu().reshape(-1), want), \
                f"seed {seed} trial {t} rank {rank}: reduce-scatter param {i} differs"
    legs = tide.stats()["multinode"]
    assert legs.get("intra:copy_engine") == 2 * trials and not any(k.startswith("intra:p2p") for k in legs), legs
    copied = node.counters()["ce_copies"]
    assert copied >= trials, copied
    uses, start = node.native.progress()["ag_uses"], torch.cuda.current_stream().record_event()
    try:
        nodes.push_spans(node, 0, start, [(start, [node.slot_bytes - 4, 8])])
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    assert refused.startswith("tide.all_gather_into_params_: span of 8 bytes at") and "not inside a slot" in refused, \
        refused
    assert node.counters()["ce_copies"] == copied and node.native.progress()["ag_uses"] == uses  # nothing issued
    # A partials plan whose own rounds write 8 elements, called with a shorter buffer or a gradient of the
    # wrong dtype: refused by the extension, naming the op and the argument, before any round is issued.
    rounds = [[[plans.RsPiece(0, 0, 0, 8, 0)]], [[plans.RsPiece(0, 8, 0, 8, 0)]]]
    grad, rounds_before = torch.randn(16, device=dev, dtype=torch.bfloat16), node.native.progress()["rs_rounds"]
    for grads, out, says in (([grad], torch.empty(4, device=dev), "the node partials must be"),
                             ([grad.float()], torch.empty(8, device=dev), "grads[0] must be")):
        try:
            nodes.reduce_partials(node, ("bad call",), grads, out, rounds)
            refused = "no error"
        except ValueError as e:
            refused = str(e)
        assert refused.startswith("tide.reduce_scatter_params_: " + says), refused
    assert node.native.progress()["rs_rounds"] == rounds_before
    torch.cuda.synchronize()
    nodes.disable(group.group_name)
    assert routes.of(group).node_arena is None
    return trials


def test_ops_push_the_intra_node_leg_by_copy_engine():
    ws = 4
    print("seed 5123")
    env = {**ranks.ENV, "LOCAL_WORLD_SIZE": "2"}
    assert run_ranks(_check_node_arena, ws, 5123, 4, backend=_backend(ws), device_type="cuda", env=env,
                     timeout=300) == [4] * ws


def _check_direct(rank, world_size, seed, trials, expect_nodes):
    import torch.distributed as dist

    from tide.multinode import rails

    group, device = dist.group.WORLD, torch.device("cuda", torch.cuda.current_device())
    done = _check(rank, world_size, seed, trials, expect_nodes, "cuda")
    assert rails.implementation(group, device) == "nccl_direct"
    rails.close_direct(group)  # what tide.fsdp.disable does; the next call opens a new communicator
    assert rails.implementation(group, device) == "p2p"
    again = _check(rank, world_size, seed + 1, trials, expect_nodes, "cuda")
    assert rails.implementation(group, device) == "nccl_direct"
    # Spans the direct rails cannot move are refused before NCCL sees them (every rank posts the same bad
    # ones: nothing waits), naming the op, and the rails keep working.
    x = torch.randn(4, 6, device=device)
    for span, says in (((x, 20, 5), "moves elements [20, 25) of a tensor of 24"),
                       ((x.t(), 0, 4), "must be a contiguous tensor")):
        with pytest.raises(ValueError, match=r"tide\.nccl_p2p\.exchange: .*" + re.escape(says)):
            rails.exchange(group, [(1 - rank, span)], [], "rail")
    return done + _check(rank, world_size, seed + 2, 1, expect_nodes, "cuda") + again


def test_ops_bit_exact_on_the_direct_nccl_rails():
    if torch.cuda.device_count() < 2:
        pytest.skip("the direct NCCL rails need one GPU per rank: 2 GPUs")
    env = {**ranks.ENV, "LOCAL_WORLD_SIZE": "1", "TIDE_MULTINODE_RAILS": "nccl"}
    assert run_ranks(_check_direct, 2, 5077, 3, (2, 1), backend="nccl", device_type="cuda", env=env,
                     timeout=300) == [7, 7]


@pytest.mark.parametrize("rails", ["p2p", "nccl"])
def test_fsdp_parity_on_two_emulated_nodes(rails):
    if rails == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("the direct NCCL rails need one GPU per rank: 2 GPUs")
    names = ["in_place_prefetch_raf", "slot_reuse_noprefetch_noraf"]
    env = {**ranks.ENV, "LOCAL_WORLD_SIZE": "1", "TIDE_CUDA_MULTINODE": "1", "TIDE_MULTINODE_RAILS": rails}
    results = run_ranks(fsdp_cuda, 2, names, False, backend=_backend(2), device_type="cuda", env=env, timeout=420)
    for rank, res in enumerate(results):
        for name in names:
            r, what = res[name], f"rank {rank} {name}"
            _assert_parity(what, r)
            t = r["tide"]
            for kind in ("all_gather", "reduce_scatter"):
                assert set(t["stats"][kind]) == {"tide_multinode"}, (what, t["stats"])
            assert t["arenas"] == 0 and "arena:created" not in t["arena"], (what, t["arena"])
            assert t["transport"] and all(k.endswith(":tide_multinode") for k in t["transport"]), \
                (what, t["transport"])
            want = "rail:nccl_direct" if rails == "nccl" else "rail:"
            assert any(k.startswith(want) for k in t["multinode"]), (what, t["multinode"])
            assert (t["direct_rails"], t["direct_rails_after_disable"]) == ((1, 0) if rails == "nccl" else (0, 0)), \
                (what, "direct rails open before / after tide.fsdp.disable")


def test_fsdp_parity_on_two_nodes_of_two():
    """2 nodes x 2 ranks (4 ranks; on 2 GPUs each node's ranks are on both GPUs, so its copies cross NVLink):
    the blocks' outputs bound in the node arena's slots, the intra-node leg by copy engine, both RS modes."""
    names = ["in_place_prefetch_raf", "slot_reuse_prefetch_raf"]
    env = {**ranks.ENV, "LOCAL_WORLD_SIZE": "2", "TIDE_CUDA_MULTINODE": "1"}
    results = run_ranks(fsdp_cuda, 4, names, False, backend=_backend(4), device_type="cuda", env=env, timeout=420)
    for rank, res in enumerate(results):
        for name in names:
            r, what = res[name], f"rank {rank} {name}"
            _assert_parity(what, r)
            t, arena = r["tide"], r["tide"]["arena"]
            assert set(t["stats"]["reduce_scatter"]) == {"tide_multinode"}, (what, t["stats"])
            ag = t["stats"]["all_gather"]
            assert ag.get("tide_multinode", 0) > 0 and set(ag) <= {"tide_multinode", "stock:arena_busy"}, (what, ag)
            assert arena.get("arena:created") == 1 and t["arenas"] == 1 and t["arenas_after_disable"] == 0, \
                (what, arena, t)
            # Every bound all-gather and every reduce-scatter (one step each here) ran its node leg on the node
            # arena; the root's all-gather (not bound) stays point-to-point.
            assert arena.get("ag:bound", 0) > 0 and t["multinode"].get("intra:copy_engine") == \
                arena["ag:bound"] + t["stats"]["reduce_scatter"]["tide_multinode"], (what, arena, t["multinode"])
            assert t["leased_at_loss"] == [False] and t["leased_after_backward"] == [False], (what, t)
            if name.startswith("slot_reuse"):
                assert arena.get("rs:slot_reuse", 0) > 0 and arena.get("rs:grad_into_slot", 0) > 0, (what, arena)
            else:
                assert "rs:slot_reuse" not in arena, (what, arena)
