"""The graph ops ``all_gather_start`` / ``reduce_scatter_start`` on 2 and 3 gloo ranks: results against a
float64 reference (fresh random data, uneven shapes, several dtypes in one call), completion through
``torch.ops._c10d_functional.wait_tensor``, and traced graphs (``torch.compile(backend="aot_eager")`` and
``make_fx``) that match eager.

One run per world size goes through the three checks, so each rank starts dynamo once; each test judges its
check's part. The seed is in every assertion message.
"""
import random

import pytest
import torch

from tests.opcheck import cases
from tests import rank_parts
from tide.launch import run_ranks
from tide.meta.layout import rows_and_row_numel, shard_rows

WORLD_SIZES = (2, 3)
SHARD_DTYPES = (torch.float32, torch.bfloat16, torch.uint8, torch.float16)
GRAD_DTYPES = (torch.bfloat16, torch.float32)


def _registry_size() -> int:
    return torch._C._distributed_c10d._get_work_registry_size()


def _shards(ws, seed):
    """Every rank's padded shards: uneven shapes, a dtype per parameter (bytes included)."""
    shapes = [s for s in cases.param_shapes(ws) if s]
    by_rank = []
    for r in range(ws):
        gen = cases.rank_generator(seed, r)
        by_rank.append([cases.random_bytes(cases.padded_shard(s, ws, r, torch.float32, gen).shape, gen)
                        if dt == torch.uint8 else cases.padded_shard(s, ws, r, dt, gen)
                        for s, dt in zip(shapes, SHARD_DTYPES * len(shapes))])
    return by_rank


def _grads(ws, seed):
    """Every rank's unpadded gradients (uneven d0, a 0-d one), bf16 and fp32 in one call."""
    shapes = cases.param_shapes(ws)
    return [[cases.random_grad(s, dt, cases.rank_generator(seed, r))
             for s, dt in zip(shapes, GRAD_DTYPES * len(shapes))] for r in range(ws)]


def _poison_freed_memory(nbytes) -> None:
    """NaN-filled blocks of the outputs' sizes, freed at once: the allocator likely hands them back to the op,
    so bytes it leaves unwritten show up."""
    blocks = [cases.poisoned((-(-n // 4),), torch.float32) for n in nbytes]
    del blocks


def _check_results(rank, ws, seed):
    g = torch.distributed.group.WORLD.group_name
    shards_by_rank = _shards(ws, seed)
    _poison_freed_memory([ws * s.numel() * s.element_size() for s in shards_by_rank[rank]])
    outs = torch.ops.tide.all_gather_start(shards_by_rank[rank], ws, g)
    for i, out in enumerate(outs):
        assert out is torch.ops._c10d_functional.wait_tensor(out), (seed, i)
        want = torch.cat([s[i] for s in shards_by_rank])
        assert out.dtype == shards_by_rank[rank][i].dtype and torch.equal(out, want), (seed, "all_gather_start", i)

    grads_by_rank = _grads(ws, seed + 1)
    for out_dtype in (None, torch.bfloat16):
        shard_numels = [shard_rows(d0, ws) * row for d0, row in (rows_and_row_numel(tuple(gr.shape))
                                                                 for gr in grads_by_rank[rank])]
        _poison_freed_memory([4 * n for n in shard_numels])
        got = torch.ops.tide.reduce_scatter_start(grads_by_rank[rank], 0.37, out_dtype, ws, g)
        for i, shard in enumerate(got):
            torch.ops._c10d_functional.wait_tensor(shard)
            contributions = [gr[i] for gr in grads_by_rank]
            exact64, fp32 = cases.reference_reduce_scatter(contributions, ws, rank, 0.37)
            assert shard.dtype == (out_dtype or torch.float32) and shard.shape == fp32.shape, (seed, i, shard.shape)
            # exactly reduce_scatter_params_'s fp32 rank-order sum (padding rows zero), then the cast
            assert torch.equal(shard, fp32.to(shard.dtype)), (seed, out_dtype, i)
            if out_dtype is None:  # and that sum is within the fp32 rounding bound of the exact one
                tol = float(cases.fp32_sum_tolerance([c.reshape(-1) for c in contributions], 0.37).max())
                err = (shard.to(torch.float64) - exact64).abs()
                assert bool((err <= tol + (exact64.abs() + 1) * 2.0 ** -23).all()), (seed, i, float(err.max()))
    return True


def _check_completion(rank, ws, seed):
    """wait_tensor returns the output itself and takes the call's work out of torch's registry; on CPU the
    work is complete from the start."""
    from tide.ops.works import TideWork

    g = torch.distributed.group.WORLD.group_name
    shards = _shards(ws, seed + 2)[rank][:3]
    before = _registry_size()
    outs = torch.ops.tide.all_gather_start(shards, ws, g)
    assert _registry_size() == before + len(outs), (seed, _registry_size(), before)
    view = outs[0][1:]
    assert torch.ops._c10d_functional.wait_tensor(view) is view  # a view finds its output's work
    assert _registry_size() == before + len(outs) - 1
    for out in outs[1:]:
        assert torch.ops._c10d_functional.wait_tensor(out) is out
    assert _registry_size() == before
    assert torch.ops._c10d_functional.wait_tensor(outs[1]) is outs[1]  # waited already: returns at once
    work = TideWork()
    assert work.is_completed() and work.wait() is True
    grads = [gr.requires_grad_() for gr in _grads(ws, seed + 3)[rank][:2]]
    reduced = torch.ops.tide.reduce_scatter_start(grads, 1.0, None, ws, g)
    for shard in reduced:
        torch.ops._c10d_functional.wait_tensor(shard)
    assert _registry_size() == before
    with pytest.raises(RuntimeError, match=r"backward through tide\.reduce_scatter_start\.default"):
        sum(s.sum() for s in reduced).backward()
    return True


def _gather_and_reduce(shards, grads, ws, g):
    """A graph's use of the ops: each output waited on by the graph's own wait_tensor before it is read."""
    wait = torch.ops._c10d_functional.wait_tensor
    gathered = [wait(o) for o in torch.ops.tide.all_gather_start(shards, ws, g)]
    reduced = [wait(s) for s in torch.ops.tide.reduce_scatter_start(grads, 0.5, torch.bfloat16, ws, g)]
    return [o.float() * 2 for o in gathered] + [s + 1 for s in reduced]


def _check_traced(rank, ws, seed):
    from torch.fx.experimental.proxy_tensor import make_fx

    g = torch.distributed.group.WORLD.group_name
    torch._dynamo.reset()
    shards = [s for s in _shards(ws, seed + 4)[rank] if s.dtype != torch.uint8]
    grads = _grads(ws, seed + 5)[rank]
    before = _registry_size()

    def fn(shards, grads):
        return _gather_and_reduce(shards, grads, ws, g)

    want = fn(shards, grads)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(shards, grads)
    gm = make_fx(fn)(shards, grads)
    targets = {n.target for n in gm.graph.nodes}
    assert {torch.ops.tide.all_gather_start.default, torch.ops.tide.reduce_scatter_start.default,
            torch.ops._c10d_functional.wait_tensor.default} <= targets, (seed, targets)
    traced = gm(shards, grads)
    for got in (compiled, traced):
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(want, got)), seed
    assert _registry_size() == before, (seed, "a graph left works unwaited", _registry_size(), before)
    return True


def _every_check(rank, ws, seed):
    checks = (("results", _check_results), ("completion", _check_completion), ("traced", _check_traced))
    return rank_parts.run_each(checks, rank, ws, seed)


@pytest.fixture(scope="module", params=WORLD_SIZES)
def checked(request):
    seed = random.SystemRandom().randrange(1 << 30)
    print(f"random seed {seed}")
    return seed, run_ranks(_every_check, request.param, seed, timeout=300, env={"TIDE_TIMEOUT_S": "60"})


def test_results_match_the_float64_reference(checked):
    assert rank_parts.part(checked, "results") == [True] * len(checked[1])


def test_wait_tensor_completes_each_output(checked):
    assert rank_parts.part(checked, "completion") == [True] * len(checked[1])


def test_traced_graphs_match_eager(checked):
    assert rank_parts.part(checked, "traced") == [True] * len(checked[1])
