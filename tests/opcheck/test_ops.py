"""opcheck of every tide op, eager results against a float64 reference, and torch.compile parity.

One run of 2 and one of 3 gloo ranks (tide.launch.run_ranks: a rank that fails or hangs fails the run
within the timeout) goes through the three checks, so that each rank starts dynamo and AOTAutograd once;
the tests each judge their check's part (its result, or its traceback on the rank that raised). Shapes
shard unevenly; data is fresh per test run (the seed is in every assertion message); outputs are
poisoned first.
"""
import random

import pytest
import torch
import torch.distributed as dist

import tide  # noqa: F401  (registers the ops)
from tests import rank_parts
from tide.launch import run_ranks
from tests.opcheck import cases
from tide.meta.layout import rows_and_row_numel, shard_rows

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# Integer tensors cannot require grad: the bytes case checks all but the autograd registration (the op's, the
# same as for floats).
BYTE_OPCHECK_UTILS = tuple(u for u in OPCHECK_UTILS if u != "test_autograd_registration")
WORLD_SIZES = (2, 3)


def _seed() -> int:
    """A fresh seed per test run, printed (pytest shows it with a failure) so the run can be repeated."""
    seed = random.SystemRandom().randrange(1 << 30)
    print(f"random seed {seed}")
    return seed


def _ag_args(ws, rank, seed, shard_dtype, out_dtype, flat_outs):
    shapes = [s for s in cases.param_shapes(ws) if s]  # padded shards are >= 1-d
    shards_by_rank = []
    for r in range(ws):
        gen = cases.rank_generator(seed, r)
        shards_by_rank.append([cases.padded_shard(s, ws, r, shard_dtype, gen) for s in shapes])
    outs = []
    for s in shards_by_rank[rank]:
        shape = (ws * s.numel(),) if flat_outs else (ws * s.shape[0], *s.shape[1:])
        outs.append(cases.poisoned(shape, out_dtype))
    return shards_by_rank, outs


def _ag_byte_args(ws, rank, seed):
    """uint8 shards of every rank and this rank's outputs, each poisoned with the complement of its
    reference (so any byte left unwritten differs)."""
    shapes = [(ws * s[0] + 1, *s[1:]) for s in cases.param_shapes(ws) if s]
    shards_by_rank = [[cases.random_bytes(s, cases.rank_generator(seed, r)) for s in shapes] for r in range(ws)]
    outs = [torch.bitwise_not(torch.cat([sh[i] for sh in shards_by_rank])) for i in range(len(shapes))]
    return shards_by_rank, outs


def _rs_args(ws, rank, seed, grad_dtype):
    shapes = cases.param_shapes(ws)
    grads_by_rank = []
    for r in range(ws):
        gen = cases.rank_generator(seed, r)
        grads_by_rank.append([cases.random_grad(s, grad_dtype, gen) for s in shapes])
    shard_grads = []
    for s in shapes:
        d0, _ = rows_and_row_numel(s)
        shard_grads.append(cases.poisoned((shard_rows(d0, ws), *s[1:]) if s else (1,), torch.float32))
    return grads_by_rank, shard_grads


def _opcheck_all(rank, ws, seed):
    g = dist.group.WORLD.group_name
    results = {}
    shards_by_rank, outs = _ag_args(ws, rank, seed, torch.float32, torch.bfloat16, flat_outs=False)
    results["all_gather_into_params_"] = torch.library.opcheck(
        torch.ops.tide.all_gather_into_params_.default, (shards_by_rank[rank], outs, ws, g), raise_exception=False)
    bytes_by_rank, byte_outs = _ag_byte_args(ws, rank, seed)
    results["all_gather_into_params_:bytes"] = torch.library.opcheck(
        torch.ops.tide.all_gather_into_params_.default, (bytes_by_rank[rank], byte_outs, ws, g),
        test_utils=BYTE_OPCHECK_UTILS, raise_exception=False)
    grads_by_rank, shard_grads = _rs_args(ws, rank, seed, torch.bfloat16)
    results["reduce_scatter_params_"] = torch.library.opcheck(
        torch.ops.tide.reduce_scatter_params_.default, (grads_by_rank[rank], shard_grads, 0.5, True, ws, g),
        raise_exception=False)
    xs = [s.clone().requires_grad_() for s in shards_by_rank[rank]]
    results["all_gather"] = torch.library.opcheck(
        torch.ops.tide.all_gather.default, (xs, ws, g), raise_exception=False)
    ys = [torch.randn(ws * 3, 4, generator=cases.rank_generator(seed + 1, rank)).requires_grad_(),
          torch.randn(ws * 2, generator=cases.rank_generator(seed + 2, rank), dtype=torch.bfloat16).requires_grad_()]
    results["reduce_scatter"] = torch.library.opcheck(
        torch.ops.tide.reduce_scatter.default, (ys, 0.25, torch.float32, ws, g), raise_exception=False)
    _opcheck_graph_ops(rank, ws, seed, g, results)
    return {op: {k: str(v) if v != "SUCCESS" else v for k, v in r.items()} for op, r in results.items()}


def _opcheck_graph_ops(rank, ws, seed, g, results):
    """The graph ops, several dtypes in one call. They are not differentiable: opcheck gets inputs that do not
    require grad, as torch.library.opcheck documents for such ops, and one more run checks, with inputs that
    do, that their Autograd kernel is registered (a backward through their outputs raises: test_bad_input)."""
    shards_by_rank, _ = _ag_args(ws, rank, seed, torch.float32, torch.float32, flat_outs=False)
    shards = [s.to(torch.bfloat16) if i % 2 else s for i, s in enumerate(shards_by_rank[rank])]
    results["all_gather_start"] = torch.library.opcheck(
        torch.ops.tide.all_gather_start.default, (shards, ws, g), raise_exception=False)
    bytes_by_rank, _ = _ag_byte_args(ws, rank, seed)
    results["all_gather_start:bytes"] = torch.library.opcheck(
        torch.ops.tide.all_gather_start.default, (bytes_by_rank[rank], ws, g), test_utils=BYTE_OPCHECK_UTILS,
        raise_exception=False)
    grads_by_rank, _ = _rs_args(ws, rank, seed, torch.bfloat16)
    grads = [x.float() if i % 2 else x for i, x in enumerate(grads_by_rank[rank])]
    for out_dtype in (None, torch.bfloat16):
        results[f"reduce_scatter_start:{out_dtype}"] = torch.library.opcheck(
            torch.ops.tide.reduce_scatter_start.default, (grads, 0.5, out_dtype, ws, g), raise_exception=False)
    results["reduce_scatter_start:requires_grad"] = torch.library.opcheck(
        torch.ops.tide.reduce_scatter_start.default, ([x.clone().requires_grad_() for x in grads], 0.5, None, ws, g),
        test_utils=("test_autograd_registration",), raise_exception=False)


def _expected_utils(case: str) -> tuple:
    if case.endswith(":bytes"):
        return BYTE_OPCHECK_UTILS
    return ("test_autograd_registration",) if case.endswith(":requires_grad") else OPCHECK_UTILS


def test_opcheck_every_op(checked):
    seed = checked[0]
    for rank, results in enumerate(rank_parts.part(checked, "opcheck")):
        assert set(results) == {"all_gather_into_params_", "all_gather_into_params_:bytes", "reduce_scatter_params_",
                                "all_gather", "reduce_scatter", "all_gather_start", "all_gather_start:bytes",
                                "reduce_scatter_start:None", "reduce_scatter_start:torch.bfloat16",
                                "reduce_scatter_start:requires_grad"}
        for op, r in results.items():
            assert tuple(r) == _expected_utils(op), (seed, rank, op, r)
            assert all(v == "SUCCESS" for v in r.values()), f"seed {seed} rank {rank} {op}: {r}"


def _check_semantics(rank, ws, seed):
    g = dist.group.WORLD.group_name
    # all_gather_into_params_: every (shard dtype, out dtype) pair, 2-D and flat outs; exact (a cast is exact
    # to compute, so the result must equal the cast reference bit for bit).
    for shard_dtype, out_dtype, flat in [(torch.float32, torch.bfloat16, False), (torch.bfloat16, torch.bfloat16, True),
                                         (torch.float32, torch.float32, True), (torch.bfloat16, torch.float32, False)]:
        shards_by_rank, outs = _ag_args(ws, rank, seed, shard_dtype, out_dtype, flat)
        torch.ops.tide.all_gather_into_params_(shards_by_rank[rank], outs, ws, g)
        for i, out in enumerate(outs):
            want = cases.reference_all_gather([s[i] for s in shards_by_rank], out_dtype)
            assert torch.equal(out, want.view(out.shape)), (shard_dtype, out_dtype, flat, i)
        seed += 1
    # uint8 shards into uint8 outs: copied byte for byte.
    shards_by_rank, outs = _ag_byte_args(ws, rank, seed)
    torch.ops.tide.all_gather_into_params_(shards_by_rank[rank], outs, ws, g)
    for i, out in enumerate(outs):
        assert torch.equal(out, torch.cat([s[i] for s in shards_by_rank])), ("bytes", i)
    seed += 1
    # reduce_scatter_params_: bf16 and fp32 grads, write and accumulate; float64 reference within the fp32
    # rounding bound, and bit-exact against the promised fp32 rank-order sum.
    for grad_dtype in (torch.bfloat16, torch.float32):
        for accumulate in (False, True):
            scale = 1.0 / ws if accumulate else 0.37
            grads_by_rank, shard_grads = _rs_args(ws, rank, seed, grad_dtype)
            base = [torch.randn(s.shape, generator=cases.rank_generator(seed + 7, rank)) for s in shard_grads]
            if accumulate:
                for s, b in zip(shard_grads, base):
                    s.copy_(b)
            torch.ops.tide.reduce_scatter_params_(grads_by_rank[rank], shard_grads, scale, accumulate, ws, g)
            for i, got in enumerate(shard_grads):
                contributions = [gr[i] for gr in grads_by_rank]
                exact64, fp32 = cases.reference_reduce_scatter(contributions, ws, rank, scale)
                if accumulate:
                    fp32 = base[i] + fp32
                    exact64 = base[i].to(torch.float64) + exact64
                assert torch.equal(got, fp32), (grad_dtype, accumulate, i)
                tol = cases.fp32_sum_tolerance([c.reshape(-1) for c in contributions], scale)
                c_rows = got.reshape(-1).numel()
                err = (got.to(torch.float64).reshape(-1) - exact64.reshape(-1)).abs()
                bound = torch.zeros(c_rows, dtype=torch.float64)
                d0, row = rows_and_row_numel(tuple(contributions[0].shape))
                start = min(rank * shard_rows(d0, ws), d0) * row
                n = min(c_rows, d0 * row - start) if d0 * row > start else 0
                bound[:n] = tol[start:start + n]
                bound += (exact64.abs().reshape(-1) + 1) * 2.0 ** -23  # final rounding (and of the accumulate add)
                assert bool((err <= bound).all()), (grad_dtype, accumulate, i, float(err.max()))
            seed += 1
    # functional pair on padded shapes
    xs = [torch.randn(3, 4, generator=cases.rank_generator(seed, r)) for r in range(ws)]
    (y,) = torch.ops.tide.all_gather([xs[rank]], ws, g)
    assert torch.equal(y, torch.cat(xs))
    zs = [torch.randn(ws * 2, 3, generator=cases.rank_generator(seed + 3, r), dtype=torch.bfloat16) for r in range(ws)]
    (z,) = torch.ops.tide.reduce_scatter([zs[rank]], 2.0, None, ws, g)
    assert z.dtype == torch.bfloat16
    _, fp32 = cases.reference_reduce_scatter(zs, ws, rank, 2.0)
    assert torch.equal(z, fp32.to(torch.bfloat16))
    # autograd: d/dx sum(all_gather(x) * w_rank) = sum_k w_k[rank's rows]; d/dx sum(rs(x) * v_rank) = scale * cat_k v_k
    x = torch.randn(3, 2, generator=cases.rank_generator(seed + 4, rank), requires_grad=True)
    ws_ = [torch.randn(ws * 3, 2, generator=cases.rank_generator(seed + 5, r)) for r in range(ws)]
    (torch.ops.tide.all_gather([x], ws, g)[0] * ws_[rank]).sum().backward()
    want = sum(w.to(torch.float64)[rank * 3:(rank + 1) * 3] for w in ws_)
    assert torch.allclose(x.grad.to(torch.float64), want, rtol=1e-6, atol=1e-6)
    x = torch.randn(ws * 2, 3, generator=cases.rank_generator(seed + 6, rank), requires_grad=True)
    vs = [torch.randn(2, 3, generator=cases.rank_generator(seed + 8, r)) for r in range(ws)]
    (torch.ops.tide.reduce_scatter([x], 0.5, None, ws, g)[0] * vs[rank]).sum().backward()
    assert torch.equal(x.grad, 0.5 * torch.cat(vs))
    return True


def test_results_match_float64_reference(checked):
    assert rank_parts.part(checked, "semantics") == [True] * len(checked[1])


def _check_compile(rank, ws, seed):
    g = dist.group.WORLD.group_name
    torch._dynamo.reset()

    def gather_then_scale(shards, outs):
        torch.ops.tide.all_gather_into_params_(shards, outs, ws, g)
        return [o * 2 for o in outs]

    def reduce_accumulate(grads, shard_grads):
        torch.ops.tide.reduce_scatter_params_(grads, shard_grads, 0.5, True, ws, g)
        return [s + 1 for s in shard_grads]

    def functional_pair(xs):
        ys = torch.ops.tide.all_gather(xs, ws, g)
        zs = torch.ops.tide.reduce_scatter([y.sin() for y in ys], 0.5, torch.float32, ws, g)
        return sum((z * z).sum() for z in zs)

    shards_by_rank, _ = _ag_args(ws, rank, seed, torch.float32, torch.bfloat16, flat_outs=False)
    shards = shards_by_rank[rank]
    eager_outs = [cases.poisoned((ws * s.shape[0], *s.shape[1:]), torch.bfloat16) for s in shards]
    comp_outs = [o.clone() for o in eager_outs]
    want = gather_then_scale(shards, eager_outs)
    got = torch.compile(gather_then_scale, fullgraph=True)(shards, comp_outs)
    assert all(torch.equal(a, b) for a, b in zip(want, got)) and all(
        torch.equal(a, b) for a, b in zip(eager_outs, comp_outs)), "compiled all_gather_into_params_ differs"

    grads_by_rank, shard_grads = _rs_args(ws, rank, seed, torch.bfloat16)
    for s in shard_grads:
        s.copy_(torch.randn(s.shape, generator=cases.rank_generator(seed + 5, rank)))
    comp_shards = [s.clone() for s in shard_grads]
    want = reduce_accumulate(grads_by_rank[rank], shard_grads)
    got = torch.compile(reduce_accumulate, fullgraph=True)(grads_by_rank[rank], comp_shards)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "compiled reduce_scatter_params_ differs"
    assert all(torch.equal(a, b) for a, b in zip(shard_grads, comp_shards)), "compiled mutation differs"

    xs = [torch.randn(3, 4, generator=cases.rank_generator(seed + 9, rank), requires_grad=True),
          torch.randn(2, generator=cases.rank_generator(seed + 11, rank), requires_grad=True)]
    xc = [x.detach().clone().requires_grad_() for x in xs]
    loss = functional_pair(xs)
    loss.backward()
    loss_c = torch.compile(functional_pair, fullgraph=True)(xc)
    loss_c.backward()
    assert torch.allclose(loss, loss_c, rtol=1e-6, atol=1e-6), (float(loss), float(loss_c))
    for a, b in zip(xs, xc):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    return True


def test_torch_compile_fullgraph_matches_eager(checked):
    assert rank_parts.part(checked, "compile") == [True] * len(checked[1])


def _every_check(rank, ws, seed):
    checks = (("semantics", _check_semantics), ("opcheck", _opcheck_all), ("compile", _check_compile))
    return rank_parts.run_each(checks, rank, ws, seed)


@pytest.fixture(scope="module", params=WORLD_SIZES)
def checked(request):
    seed = _seed()
    # TIDE's timeout well above any of these calls, and below the run's: a check that raised on one rank
    # fails the others' next call in minutes, not at the end of the run.
    return seed, run_ranks(_every_check, request.param, seed, timeout=600, env={"TIDE_TIMEOUT_S": "120"})


