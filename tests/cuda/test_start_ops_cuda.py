"""The graph ops ``all_gather_start`` / ``reduce_scatter_start`` on CUDA (skipped without CUDA): two ranks
share one GPU over gloo, without an arena (the reference backend) and with one (the reduce-scatter on the
transport, the all-gather into a free arena slot by TIDE-AG; with every slot held, outputs larger than a
slot, or inside a CUDA-graph capture while the eager lease is held, into allocator outputs on the direct
lane), each result bit-exact against the CPU reference of the same data, the arena's slots and the
allocator's free memory poisoned before each call; the works complete through ``wait_tensor``; opcheck;
and compiled graphs (``aot_eager`` and Inductor) equal to eager. Data is fresh per run (the seed is in
every message).
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from tests.cuda import ranks
from tests.opcheck import cases
from tide.launch import run_ranks

pytestmark = pytest.mark.cuda

# opcheck's aot_dispatch utility reads the outputs without the graph op's wait: on CUDA they are ready only at the
# wait (the call runs on a side stream), so that utility runs on CPU only (tests/opcheck), where calls are synchronous.
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")
SHARD_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
GRAD_DTYPES = (torch.bfloat16, torch.float32)


def _registry_size() -> int:
    return torch._C._distributed_c10d._get_work_registry_size()


def _inputs(ws, seed):
    """Every rank's padded shards and unpadded gradients (CPU), uneven, several dtypes in one call."""
    shapes = cases.param_shapes(ws)
    shards, grads = [], []
    for r in range(ws):
        gen = cases.rank_generator(seed, r)
        shards.append([cases.random_bytes(cases.padded_shard(s, ws, r, torch.float32, gen).shape, gen)
                       if dt == torch.uint8 else cases.padded_shard(s, ws, r, dt, gen)
                       for s, dt in zip([s for s in shapes if s], SHARD_DTYPES * len(shapes))])
        grads.append([cases.random_grad(s, dt, gen) for s, dt in zip(shapes, GRAD_DTYPES * len(shapes))])
    return shards, grads


def _check_calls(rank, ws, seed, dev, what):
    import tide

    g = dist.group.WORLD.group_name
    wait = torch.ops._c10d_functional.wait_tensor
    shards_by_rank, grads_by_rank = _inputs(ws, seed)
    tide.reset_stats()
    _poison_slots(g)
    before = _registry_size()
    outs = torch.ops.tide.all_gather_start([s.to(dev) for s in shards_by_rank[rank]], ws, g)
    assert _registry_size() == before + len(outs), (seed, what)
    for i, out in enumerate(outs):
        assert wait(out) is out
        ranks.assert_bits(f"seed {seed} {what} all_gather_start param {i}", out,
                          torch.cat([s[i] for s in shards_by_rank]))
    for out_dtype in (None, torch.bfloat16):
        got = torch.ops.tide.reduce_scatter_start([x.to(dev) for x in grads_by_rank[rank]], 0.37, out_dtype, ws, g)
        for i, shard in enumerate(got):
            wait(shard)
            _, fp32 = cases.reference_reduce_scatter([gr[i] for gr in grads_by_rank], ws, rank, 0.37)
            ranks.assert_bits(f"seed {seed} {what} reduce_scatter_start param {i} out_dtype {out_dtype}", shard,
                              fp32.to(out_dtype or torch.float32))
    assert _registry_size() == before, (seed, what)
    torch.cuda.synchronize()
    return tide.stats()["ops"]


def _poison_slots(group_name: str) -> None:
    """The arena's slots, and free blocks of the caching allocator (where direct-lane outputs come from)."""
    from tide import transport

    a = transport.get(group_name)
    if a is not None:
        ranks.poison(a.region()[a.slots_off:a.ring_off])
    for nbytes in (4 << 10, 256 << 10, 4 << 20):  # small- and large-pool blocks, freed poisoned
        ranks.poison(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))


def _check_slot_reuse(rank, ws, seed, dev) -> dict:
    """Outputs alive hold their slot: with both slots held a third call gathers into allocator outputs on the
    direct lane; once the first call's outputs die its slot serves again; a call larger than a slot takes the
    direct lane; so does a call captured into a CUDA graph while the eager lease is held, replayed on fresh
    data."""
    import tide
    from tide import transport

    g = dist.group.WORLD.group_name
    tide.reset_stats()
    want, held = [transport.get(g).slots.held()], []
    for k in range(4):
        if k == 3:
            del held[0]  # the first call's outputs die: their slot is free again
        _poison_slots(g)
        shards = [torch.randn(5 + k, 3, generator=cases.rank_generator(seed + k, q)) for q in range(ws)]
        (out,) = torch.ops.tide.all_gather_start([shards[rank].to(dev)], ws, g)
        torch.ops._c10d_functional.wait_tensor(out)
        ranks.assert_bits(f"seed {seed} slot reuse call {k}", out, torch.cat(shards))
        held.append(out)
        want.append(transport.get(g).slots.held())
    _poison_slots(g)
    n = transport.get(g).slot_bytes // 4 + 1
    big = [torch.randn(n, generator=cases.rank_generator(seed + 9, q)) for q in range(ws)]
    (out,) = torch.ops.tide.all_gather_start([big[rank].to(dev)], ws, g)
    torch.ops._c10d_functional.wait_tensor(out)
    ranks.assert_bits(f"seed {seed} call larger than a slot", out, torch.cat(big))
    direct_uses = transport.get(g).native.progress()["ag_uses"][-1]
    captured = _check_captured_direct(rank, ws, seed + 11, dev)  # both slots still held
    return {"held": want, "ops": tide.stats()["ops"], "direct_uses": direct_uses, "captured": captured}


def _check_captured_direct(rank, ws, seed, dev) -> int:
    """One all-gather captured while both slots are held by live outputs and the eager lease is held (the
    direct lane, leased in the graph's pool), replayed twice on fresh shards; the replays that matched bit
    for bit."""
    g = dist.group.WORLD.group_name
    static = torch.empty(7, 5, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out,) = torch.ops.tide.all_gather_start([static], ws, g)
        torch.ops._c10d_functional.wait_tensor(out)
    matched = 0
    for k in range(2):
        shards = [torch.randn(7, 5, generator=cases.rank_generator(seed + k, q)) for q in range(ws)]
        static.copy_(shards[rank])
        ranks.poison(out)
        graph.replay()
        torch.cuda.synchronize()
        ranks.assert_bits(f"seed {seed} captured direct lane replay {k}", out, torch.cat(shards))
        matched += 1
    return matched


def _fn(shards, grads, ws, g):
    wait = torch.ops._c10d_functional.wait_tensor
    gathered = [wait(o) for o in torch.ops.tide.all_gather_start(shards, ws, g)]
    reduced = [wait(s) for s in torch.ops.tide.reduce_scatter_start(grads, 0.5, torch.bfloat16, ws, g)]
    return [o.float() * 2 for o in gathered] + [s + 1 for s in reduced]


def _check_compiled(rank, ws, seed, dev):
    g = dist.group.WORLD.group_name
    shards_by_rank, grads_by_rank = _inputs(ws, seed)
    shards = [s.to(dev) for s in shards_by_rank[rank] if s.dtype != torch.uint8]
    grads = [x.to(dev) for x in grads_by_rank[rank]]
    want = _fn(shards, grads, ws, g)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        got = torch.compile(lambda s, x: _fn(s, x, ws, g), backend=backend, fullgraph=True)(shards, grads)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), (seed, backend)
    torch.cuda.synchronize()
    return True


def _check_inputs_held(ws, dev) -> dict:
    """A call runs on a side stream and holds its inputs until its wait: an input its caller drops stays
    allocated until then, and the caller's stream is unchanged."""
    g = dist.group.WORLD.group_name
    stream = torch.cuda.current_stream()
    grads = [torch.randn(4096, 2048, device=dev).bfloat16()]  # 16 MiB
    nbytes = grads[0].untyped_storage().nbytes()
    (shard,) = torch.ops.tide.reduce_scatter_start(grads, 1.0, None, ws, g)
    del grads
    held = torch.cuda.memory_allocated()
    torch.ops._c10d_functional.wait_tensor(shard)
    freed = held - torch.cuda.memory_allocated()
    return {"freed_at_wait": freed == nbytes, "same_stream": torch.cuda.current_stream() == stream}


def start_ops_rank(rank: int, ws: int, seed: int) -> dict:
    from tide import transport

    g = dist.group.WORLD.group_name
    dev = torch.device("cuda", torch.cuda.current_device())
    out = {"no_arena": _check_calls(rank, ws, seed, dev, "no arena")}
    transport.enable(dist.group.WORLD, slot_bytes=1 << 20)
    out["arena"] = _check_calls(rank, ws, seed + 1, dev, "arena")
    out["arena_again"] = _check_calls(rank, ws, seed + 2, dev, "arena, same layouts")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # issued on a side stream, waited on the default one
        (gathered,) = torch.ops.tide.all_gather_start([torch.full((3, 2), float(rank), device=dev)], ws, g)
    torch.ops._c10d_functional.wait_tensor(gathered)
    out["side_stream"] = gathered.cpu().tolist()
    del gathered  # its slot is free again
    out["compiled"] = _check_compiled(rank, ws, seed + 3, dev)
    out["inputs_held"] = _check_inputs_held(ws, dev)
    out["slot_reuse"] = _check_slot_reuse(rank, ws, seed + 5, dev)
    shards_by_rank, grads_by_rank = _inputs(ws, seed + 4)
    out["opcheck"] = {
        "all_gather_start": torch.library.opcheck(torch.ops.tide.all_gather_start.default,
                                                  ([s.to(dev) for s in shards_by_rank[rank]], ws, g),
                                                  test_utils=OPCHECK_UTILS, raise_exception=False),
        "reduce_scatter_start": torch.library.opcheck(torch.ops.tide.reduce_scatter_start.default,
                                                      ([x.to(dev) for x in grads_by_rank[rank]], 0.5, None, ws, g),
                                                      test_utils=OPCHECK_UTILS, raise_exception=False)}
    out["opcheck"] = {op: {k: str(v) if v != "SUCCESS" else v for k, v in r.items()}
                      for op, r in out["opcheck"].items()}
    torch.cuda.synchronize()
    transport.disable(g)
    return out


def test_graph_ops_on_cuda(ext):
    seed = random.SystemRandom().randrange(1 << 30)
    ws = 2
    for rank, r in enumerate(run_ranks(start_ops_rank, ws, seed, backend="gloo", device_type="cuda", env=ranks.ENV,
                                       timeout=500)):
        assert r["no_arena"]["reduce_scatter_start:allocator"] == 2, (seed, r["no_arena"])
        assert r["no_arena"]["all_gather_into_params_:stock:no_arena"] == 1, (seed, r["no_arena"])
        assert r["no_arena"]["reduce_scatter_params_:stock:no_arena"] == 2, (seed, r["no_arena"])
        assert r["no_arena"]["all_gather_start:reference:no_arena"] == 1, (seed, r["no_arena"])
        for part in ("arena", "arena_again"):
            assert r[part]["all_gather_start:slot"] == 1, (seed, part, r[part])
            assert r[part].get("all_gather_into_params_:tide") == 1, (seed, part, r[part])  # TIDE-AG, zero-copy
            assert r[part].get("reduce_scatter_params_:tide") == 2, (seed, part, r[part])  # on the transport
        slots = r["slot_reuse"]
        assert slots["held"] == [0, 1, 2, 2, 2], (seed, slots)
        assert slots["ops"]["all_gather_start:slot"] == 3, (seed, slots["ops"])
        assert slots["ops"]["all_gather_start:allocator:slot_too_small"] == 1, (seed, slots["ops"])
        # the captured call: its slots' region leased eagerly (or, in symmetric mode, no slot free)
        captured_why = slots["ops"]["all_gather_start:allocator:no_free_slot"] - 1
        assert captured_why + slots["ops"].get("all_gather_start:allocator:lease_across_capture", 0) == 1, (seed, slots)
        assert not any(":reference" in k for k in slots["ops"]), (seed, slots["ops"])
        assert slots["direct_uses"] == 2 and slots["captured"] == 2, (seed, slots)
        assert r["side_stream"] == [[float(q)] * 2 for q in range(ws) for _ in range(3)], (seed, r["side_stream"])
        assert r["compiled"] is True
        assert r["inputs_held"] == {"freed_at_wait": True, "same_stream": True}, (seed, r["inputs_held"])
        for op, checks in r["opcheck"].items():
            assert tuple(checks) == OPCHECK_UTILS and all(v == "SUCCESS" for v in checks.values()), \
                (seed, rank, op, checks)
