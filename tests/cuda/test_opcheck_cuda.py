"""opcheck of the four ops' C++ CUDA kernels (csrc/transport/dispatch.cpp) on an arena, and their results
against the float64 reference (skipped without CUDA).

Two ranks share one GPU over gloo (or have one each). opcheck runs each op several times (schema, autograd
registration, fake tensors, AOT dispatch); every rank runs the same sequence, so each run is one collective.
The all-gather's outputs are views of an arena slot, so its calls after the first take the C++ steady path;
opcheck's own copies of them lie in no slot and take the reference. Data is fresh per run (the seed is in
every message); outputs are poisoned first.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from tests.cuda import ranks
from tests.opcheck import cases
from tide.launch import run_ranks
from tide.meta.layout import rows_and_row_numel, shard_rows

pytestmark = pytest.mark.cuda

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck_rank(rank: int, ws: int, seed: int) -> dict:
    import tide
    from tide import transport
    from tide.meta import plans

    g = dist.group.WORLD.group_name
    dev = torch.device("cuda", torch.cuda.current_device())
    arena = transport.enable(dist.group.WORLD, slot_bytes=1 << 20)
    tide.reset_stats()
    shapes = [s for s in cases.param_shapes(ws) if s]
    by_rank = [[cases.padded_shard(s, ws, r, torch.float32, cases.rank_generator(seed, r)) for s in shapes]
               for r in range(ws)]
    shards = [s.to(dev) for s in by_rank[rank]]
    layout = plans.all_gather_layout([s.shape for s in shards], [torch.bfloat16] * len(shards), ws)
    outs = arena.slot_views(layout, [torch.bfloat16] * len(shards), arena.slots.acquire())
    results = {}
    for _ in range(2):  # the second call finds the plan: it stays in C++
        for o in outs:
            o.fill_(float("nan"))
        torch.ops.tide.all_gather_into_params_(shards, outs, ws, g)
        for i, o in enumerate(outs):
            want = cases.reference_all_gather([s[i] for s in by_rank], torch.bfloat16)
            assert torch.equal(o.cpu(), want.view(-1)), (seed, rank, "all_gather_into_params_", i)
    results["all_gather_into_params_"] = torch.library.opcheck(
        torch.ops.tide.all_gather_into_params_.default, (shards, outs, ws, g), raise_exception=False)
    grads_by_rank = [[cases.random_grad(s, torch.bfloat16, cases.rank_generator(seed + 1, r))
                      for s in cases.param_shapes(ws)] for r in range(ws)]
    grads = [x.to(dev) for x in grads_by_rank[rank]]
    shard_grads = [torch.full((shard_rows(rows_and_row_numel(s)[0], ws), *s[1:]) if s else (1,), float("nan"),
                              device=dev) for s in cases.param_shapes(ws)]
    for _ in range(2):
        for s in shard_grads:
            s.fill_(float("nan"))
        torch.ops.tide.reduce_scatter_params_(grads, shard_grads, 0.5, False, ws, g)
        for i, got in enumerate(shard_grads):
            _, fp32 = cases.reference_reduce_scatter([gr[i] for gr in grads_by_rank], ws, rank, 0.5)
            assert torch.equal(got.cpu().reshape(-1), fp32.reshape(-1)), (seed, rank, "reduce_scatter_params_", i)
    results["reduce_scatter_params_"] = torch.library.opcheck(
        torch.ops.tide.reduce_scatter_params_.default, (grads, shard_grads, 0.5, True, ws, g), raise_exception=False)
    xs = [s.clone().requires_grad_() for s in shards]
    results["all_gather"] = torch.library.opcheck(torch.ops.tide.all_gather.default, (xs, ws, g),
                                                  raise_exception=False)
    ys = [torch.randn(ws * 3, 4, generator=cases.rank_generator(seed + 2, rank)).to(dev).requires_grad_(),
          torch.randn(ws * 2, generator=cases.rank_generator(seed + 3, rank)).to(dev, torch.bfloat16).requires_grad_()]
    results["reduce_scatter"] = torch.library.opcheck(torch.ops.tide.reduce_scatter.default,
                                                      (ys, 0.25, torch.float32, ws, g), raise_exception=False)
    steady = dict(arena.ext.steady_calls())
    torch.cuda.synchronize()
    transport.disable(g)
    return {"opcheck": {op: {k: str(v) if v != "SUCCESS" else v for k, v in r.items()} for op, r in results.items()},
            "steady": steady}


def test_opcheck_of_the_cpp_kernels_on_an_arena(ext):
    seed = random.SystemRandom().randrange(1 << 30)
    for rank, r in enumerate(run_ranks(opcheck_rank, 2, seed, backend="gloo", device_type="cuda", env=ranks.ENV,
                                       timeout=300)):
        for op, checks in r["opcheck"].items():
            assert tuple(checks) == OPCHECK_UTILS, (seed, rank, op, checks)
            assert all(v == "SUCCESS" for v in checks.values()), f"seed {seed} rank {rank} {op}: {checks}"
        assert r["steady"]["all_gather_into_params_"] >= 1 and r["steady"]["reduce_scatter_params_"] >= 1, (seed, r)
