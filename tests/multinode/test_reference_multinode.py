"""The reference backend's multi-node schedule on emulated nodes (gloo, ``LOCAL_WORLD_SIZE``): 2 x 2,
3 x 2 and 2 x 3 ranks. Every rank rebuilds every rank's inputs from seeds, so it knows the exact answer:
all-gathers bit-exact, reduce-scatters bit-exact against the documented fp32 order (node partials in
local order, then nodes in order) and close to a float64 sum. Outputs are poisoned (NaN) before each
call, inputs fresh every trial; the seed is in every assertion message."""
import random

import pytest
import torch

from tide.launch import run_ranks

DTYPES = (torch.float32, torch.bfloat16)


def _inputs(seed, W, rank_of_data, shapes, dtypes):
    gen = torch.Generator().manual_seed(seed * 1000 + rank_of_data)
    return [torch.randn(s, generator=gen).to(dt) for s, dt in zip(shapes, dtypes)]


def _hierarchical(contribs, N, L):
    """fp32 node partials in local order, then summed in node order."""
    total = None
    for n in range(N):
        part = contribs[n * L].to(torch.float32, copy=True)
        for l in range(1, L):
            part.add_(contribs[n * L + l])
        total = part if total is None else total.add_(part)
    return total


def _expected_shard(grads_all, i, shape, rank, N, L, scale, init, accumulate):
    """Rank ``rank``'s shard of param ``i`` in the documented order (flat; padding zero, or ``init`` where
    accumulating), and the float64 sum of its real elements."""
    from tide.meta.layout import rank_row_range, rows_and_row_numel

    W = len(grads_all)
    d0, row = rows_and_row_numel(shape)
    start, stop = rank_row_range(d0, W, rank)
    rows = [grads_all[r][i].reshape(-1)[start * row:stop * row] for r in range(W)]
    exact = _hierarchical(rows, N, L).mul_(scale)
    want = init.reshape(-1).clone() if accumulate else torch.zeros(init.numel())
    want[:exact.numel()] = (want[:exact.numel()] + exact) if accumulate else exact
    return want, sum(x.double() for x in rows) * scale


def _check(rank, world_size, seed, trials, expect_nodes, device_type="cpu"):
    """The schedule's answers on this rank, inputs and outputs on ``device_type`` (tests/cuda runs the
    same check on GPUs); the expected values are computed on the host."""
    import torch.distributed as dist

    import tide
    from tide import topology
    from tide.meta.layout import shard_rows
    from tide.multinode import rails

    dev = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    tide.reset_stats()
    group = dist.group.WORLD
    topo = topology.of_group(group)
    assert (topo.num_nodes, topo.local_size) == expect_nodes, topo
    N, L, W = topo.num_nodes, topo.local_size, world_size
    rng = random.Random(seed)
    for t in range(trials):
        s = seed * 100 + t
        # All-gather: padded shards (c, *rest), bf16 or fp32 into bf16 or fp32 outputs.
        shapes = [(rng.randint(1, 5), rng.randint(1, 7)) for _ in range(rng.randint(1, 4))] + [(rng.randint(1, 3),)]
        in_dt = [rng.choice(DTYPES) for _ in shapes]
        out_dt = [rng.choice(DTYPES) for _ in shapes]
        every = [_inputs(s, W, r, shapes, in_dt) for r in range(W)]
        outs = [torch.full((W * sh[0], *sh[1:]), float("nan"), dtype=dt, device=dev) for sh, dt in zip(shapes, out_dt)]
        tide.ops.all_gather_into_params([x.to(dev) for x in every[rank]], outs, group)
        for i, (o, dt) in enumerate(zip(outs, out_dt)):
            want = torch.cat([every[r][i].to(dt) for r in range(W)])
            assert torch.equal(o.cpu(), want), f"seed {seed} trial {t} rank {rank}: all-gather param {i} differs"
        # Reduce-scatter: unpadded grads, bf16/fp16/fp32 (uneven rows, ranks holding only padding).
        gshapes = [(rng.randint(0, 3 * W + 2), rng.randint(1, 5))
                   for _ in range(rng.randint(1, 4))] + [(rng.randint(1, W),)]
        gdt = [rng.choice(DTYPES + (torch.float16,)) for _ in gshapes]
        grads_all = [_inputs(s + 7, W, r, gshapes, gdt) for r in range(W)]
        scale = rng.choice([1.0, 1.0 / W, rng.uniform(0.1, 2.0)])
        accumulate = rng.random() < 0.4
        init = [torch.randn((shard_rows(sh[0], W), *sh[1:]), generator=torch.Generator().manual_seed(s + rank))
                for sh in gshapes]
        shard_grads = [(x.clone() if accumulate else torch.full_like(x, float("nan"))).to(dev) for x in init]
        grads = [g.to(dev, copy=True) for g in grads_all[rank]]
        tide.ops.reduce_scatter_params(grads, shard_grads, group, scale=scale, accumulate=accumulate)
        for i, (g, g0) in enumerate(zip(grads, grads_all[rank])):  # read where they lie, never written
            assert torch.equal(g.cpu(), g0), f"seed {seed} trial {t} rank {rank}: gradient {i} was modified"
        shard_grads = [x.cpu() for x in shard_grads]
        for i, sh in enumerate(gshapes):
            want, f64 = _expected_shard(grads_all, i, sh, rank, N, L, scale, init[i], accumulate)
            got = shard_grads[i].reshape(-1)
            assert torch.equal(got, want), f"seed {seed} trial {t} rank {rank}: reduce-scatter param {i} differs"
            if not accumulate:
                assert torch.allclose(got[:f64.numel()].double(), f64, rtol=1e-5, atol=1e-5), \
                    f"seed {seed} trial {t} rank {rank}: param {i} far from the float64 sum"
    # An all-gather whose shards have the outputs' dtype: own pieces go out from the shards themselves (on
    # GPUs the own copy runs on a stream of its own beside the rails), rows of 1 to 40 KiB.
    dt = rng.choice(DTYPES)
    shapes = [(rng.randint(1, 40), rng.randint(1, 512)) for _ in range(rng.randint(2, 6))]
    every = [_inputs(seed + 99, W, r, shapes, [dt] * len(shapes)) for r in range(W)]
    outs = [torch.full((W * sh[0], *sh[1:]), float("nan"), dtype=dt, device=dev) for sh in shapes]
    tide.ops.all_gather_into_params([x.to(dev) for x in every[rank]], outs, group)
    for i, o in enumerate(outs):
        assert torch.equal(o.cpu(), torch.cat([every[r][i] for r in range(W)])), \
            f"seed {seed} rank {rank}: same-dtype all-gather param {i} differs"
    # Bytes (uint8 into uint8: float8 payloads, tensor extensions' inputs), each output poisoned with the
    # complement of its expected bytes.
    shapes = [(rng.randint(1, 9), rng.randint(1, 300)) for _ in range(rng.randint(1, 4))]
    every = [[torch.randint(0, 256, sh, generator=torch.Generator().manual_seed(seed * 7 + r), dtype=torch.uint8)
              for sh in shapes] for r in range(W)]
    wants = [torch.cat([every[r][i] for r in range(W)]) for i in range(len(shapes))]
    outs = [torch.bitwise_not(w).to(dev) for w in wants]
    tide.ops.all_gather_into_params([x.to(dev) for x in every[rank]], outs, group)
    for i, (o, w) in enumerate(zip(outs, wants)):
        assert torch.equal(o.cpu(), w), f"seed {seed} rank {rank}: byte all-gather param {i} differs"
    rounds = tide.stats()["multinode"]
    if N > 1:  # the rails carried pieces, by the implementation the group and device call for, and the
        # sums ran on the summing kernel on GPUs, as torch ops on the CPU
        assert rounds.get(f"rail:{rails.implementation(group, dev)}", 0) > 0, rounds
        assert rounds.get("sum:kernel" if device_type == "cuda" else "sum:torch", 0) > 0, rounds
        assert rounds.get("sum:torch" if device_type == "cuda" else "sum:kernel", 0) == 0, rounds
    return trials


@pytest.mark.parametrize("nodes,local", [(2, 2), (3, 2), (2, 3), (2, 1)])
def test_emulated_nodes_run_the_multinode_schedule(nodes, local):
    seed = 4000 + 10 * nodes + local
    print(f"seed {seed}")
    results = run_ranks(_check, nodes * local, seed, 4, (nodes, local), env={"LOCAL_WORLD_SIZE": str(local)},
                        timeout=240)
    assert results == [4] * (nodes * local)


def test_one_node_keeps_the_rank_order():
    """LOCAL_WORLD_SIZE = W: one node, whose order (node partial of all W ranks in local order) is the
    single-node rank order: the same check passes with N = 1."""
    assert run_ranks(_check, 3, 77, 2, (1, 3), env={"LOCAL_WORLD_SIZE": "3"}, timeout=240) == [2] * 3


def _in_small_steps(rank, world_size, seed, expect_nodes, accumulate):
    """The reduce-scatter in many steps (16-byte chunks, 4 per destination per step): the documented fp32
    order bit for bit (written or added), and no exchange receives more than one step's worth, for a model
    4 times larger too."""
    import torch.distributed as dist

    from tide import routes
    from tide.meta.layout import shard_rows
    from tide.multinode import rails, schedule

    group = dist.group.WORLD
    topo = routes.of(group).topology
    assert (topo.num_nodes, topo.local_size) == expect_nodes, topo
    N, L, W = topo.num_nodes, topo.local_size, world_size
    chunk, per_step = 16, 4
    received, exchange = [], rails.exchange

    def recording(group, sends, recvs, leg):
        received.append(sum(count * t.element_size() for _, (t, _, count) in recvs))
        exchange(group, sends, recvs, leg)

    rails.exchange = recording
    try:
        peaks = []
        for size in (4, 16):
            shapes = [(size * (3 * W + 1), 5), (size * W, 3), (7,)]
            grads_all = [_inputs(seed + size, W, r, shapes, [torch.bfloat16] * 3) for r in range(W)]
            init = [torch.randn((shard_rows(sh[0], W), *sh[1:]), generator=torch.Generator().manual_seed(seed + rank))
                    for sh in shapes]
            shard_grads = [x.clone() if accumulate else torch.full_like(x, float("nan")) for x in init]
            received.clear()
            schedule.reduce_scatter(grads_all[rank], shard_grads, 0.5, accumulate, group, routes.of(group),
                                               rs_chunk_bytes=chunk, pace=per_step * chunk)
            for i, sh in enumerate(shapes):
                want, _ = _expected_shard(grads_all, i, sh, rank, N, L, 0.5, init[i], accumulate)
                assert torch.equal(shard_grads[i].reshape(-1), want), f"seed {seed} size {size} rank {rank}: param {i}"
            peaks.append(max(received))
    finally:
        rails.exchange = exchange
    # bf16 contributions for the N partials it sums, or partials arriving / handed: one step's chunks. The
    # partials are fp32 (twice a chunk's bf16 bytes) except with one rank per node, where they stay bf16.
    bound = per_step * max((L - 1) * N * chunk, (N - 1) * (2 if L > 1 else 1) * chunk)
    assert max(peaks) <= bound, (peaks, bound)
    return peaks


@pytest.mark.parametrize("nodes,local,accumulate", [(2, 2, False), (3, 2, True), (2, 3, False), (4, 1, True)])
def test_reduce_scatter_staging_is_bounded_by_the_step_not_the_model(nodes, local, accumulate):
    results = run_ranks(_in_small_steps, nodes * local, 5100 + 10 * nodes + local, (nodes, local), accumulate,
                        env={"LOCAL_WORLD_SIZE": str(local)}, timeout=240)
    assert all(small == large for small, large in results), results  # the peak does not grow with the model


def _with_settings(rank, world_size, envs):
    """An all-gather at 2 x 2 with this rank's multi-node settings (``envs[rank]``): (rail steps by
    implementation, outputs exact) or the error it raised."""
    import os

    import torch.distributed as dist

    import tide
    from tide.multinode import schedule  # noqa: F401 (tide.ops)

    for name in (PACE, RAILS):  # a setting this rank leaves out is unset, whatever the caller's shell set
        os.environ.pop(name, None)
    os.environ.update(envs[rank])
    group = dist.group.WORLD
    shapes = [(6 * world_size, 5), (3 * world_size,)]
    full = [torch.randn(s, generator=torch.Generator().manual_seed(4242 + i)) for i, s in enumerate(shapes)]
    shards = [f.chunk(world_size)[rank].clone() for f in full]
    outs = [torch.full_like(f, float("nan")) for f in full]
    tide.reset_stats()
    try:
        tide.ops.all_gather_into_params(shards, outs, group)
    except (RuntimeError, ValueError) as e:
        return str(e)
    rail_steps = {key: n for key, n in tide.stats()["multinode"].items() if key.startswith("rail")}
    return rail_steps, all(torch.equal(o, f) for o, f in zip(outs, full))


PACE, RAILS = "TIDE_MULTINODE_PACE_BYTES", "TIDE_MULTINODE_RAILS"


def test_the_pace_sets_the_rail_steps_and_every_rank_must_set_the_same():
    """A smaller pace cuts the rail round into more steps with the same result; ranks that set different
    paces all raise, naming the setting, instead of posting sends and receives of different sizes."""
    env = {"LOCAL_WORLD_SIZE": "2"}
    default = run_ranks(_with_settings, 4, [{PACE: str(8 << 20)}] * 4, env=env, timeout=120)
    small = run_ranks(_with_settings, 4, [{PACE: "40"}] * 4, env=env, timeout=120)
    assert all(ok for _, ok in default + small), (default, small)
    # shards of 36 floats: one step at 8 MiB, 4 of 40 bytes
    assert default[0][0] == {"rail:p2p": 1} and small[0][0]["rail:p2p"] > 1, (default, small)
    mixed = run_ranks(_with_settings, 4, [{PACE: str(8 << 20)}] * 2 + [{PACE: "40"}, {PACE: str(8 << 20)}],
                      env=env, timeout=120)
    assert all(isinstance(m, str) and PACE in m for m in mixed), mixed


def test_an_invalid_setting_on_one_rank_raises_on_every_rank_naming_it():
    env = {"LOCAL_WORLD_SIZE": "2"}
    answers = run_ranks(_with_settings, 4, [{}, {PACE: "abc"}, {RAILS: "ring"}, {}], env=env, timeout=120)
    # Every knob is checked at the first op call: the two ranks refuse it, each with its own error, and the
    # others raise with the first refusal's, naming both ranks.
    pace = f"tide: {PACE} must be an integer >= 1, got 'abc'"
    assert pace in answers[1], answers
    assert f"tide: {RAILS} must be one of ('auto', 'p2p', 'nccl'), got 'ring'" in answers[2], answers
    for answer in (answers[0], answers[3]):
        assert "rank 1 (and rank(s) [2])" in answer and pace in answer, answers


def test_the_rails_setting_is_agreed_and_direct_nccl_needs_an_nccl_group():
    """``TIDE_MULTINODE_RAILS=nccl`` or ``auto`` on a gloo group leaves the rails on p2p on every rank (with
    the same result); ranks that ask for different rails all raise, naming the setting (unset is ``auto``);
    an unknown value is refused."""
    env = {"LOCAL_WORLD_SIZE": "2"}
    for asked in ("nccl", "auto"):
        direct = run_ranks(_with_settings, 4, [{RAILS: asked}] * 4, env=env, timeout=120)
        assert all(steps == {"rail:p2p": 1} and ok for steps, ok in direct), (asked, direct)
    mixed = run_ranks(_with_settings, 4, [{RAILS: "nccl"}] + [{RAILS: "p2p"}] * 3, env=env, timeout=120)
    assert all(isinstance(m, str) and RAILS in m for m in mixed), mixed
    unset = run_ranks(_with_settings, 4, [{}] * 3 + [{RAILS: "p2p"}], env=env, timeout=120)
    assert all(isinstance(m, str) and RAILS in m and "auto" in m for m in unset), unset
    unknown = run_ranks(_with_settings, 4, [{RAILS: "mpi"}] * 4, env=env, timeout=120)
    assert all(isinstance(m, str) and "'mpi'" in m for m in unknown), unknown


def _rails_decision(rank, world_size, asked, cannot_run_on):
    """Whether this rank's group agrees on the direct NCCL rails, with ``TIDE_MULTINODE_RAILS=asked`` (None:
    unset), on a group that looks like an NCCL group where the ranks in ``cannot_run_on`` cannot run them."""
    import os
    from unittest import mock

    import torch.distributed as dist

    from tide.multinode import settings

    os.environ.pop(RAILS, None)
    if asked is not None:
        os.environ[RAILS] = asked
    reason = "no NCCL symbols in this process" if rank in cannot_run_on else None
    with mock.patch.object(settings.dist, "get_backend", return_value="nccl"), \
            mock.patch.object(settings.nccl_rails, "unavailable", return_value=reason):
        return settings.agreed(dist.group.WORLD).direct


def test_auto_rails_are_direct_only_where_every_rank_can_run_them():
    """Unset or ``auto``: the direct NCCL rails when every rank of an NCCL group can run them, else p2p on
    every rank alike; ``p2p`` never takes them; ``nccl`` takes them where all can."""
    for asked, cannot, direct in ((None, (), True), ("auto", (), True), ("auto", (1,), False), ("p2p", (), False),
                                  ("nccl", (), True), ("nccl", (0,), False)):
        assert run_ranks(_rails_decision, 2, asked, cannot, timeout=60) == [direct, direct], (asked, cannot)


def _regrouped(rank, world_size):
    """The same group name twice (destroy, init again): the second group agrees on its own settings."""
    import datetime
    import os
    import tempfile

    import torch.distributed as dist

    first = _with_settings(rank, world_size, [{PACE: "40"}] * world_size)
    backend = dist.get_backend()
    dist.destroy_process_group()
    # A file store: a second TCP store on the first one's port can hang the new group's set-up.
    path = os.path.join(tempfile.gettempdir(), f"tide_regroup_{os.environ['MASTER_PORT']}")
    store = dist.FileStore(path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    assert os.environ[PACE] == "40"
    second = _with_settings(rank, world_size, [{PACE: str(8 << 20)}] * world_size)
    dist.barrier()
    if rank == 0:
        os.remove(path)
    return first, second


def test_a_recreated_group_agrees_again():
    for first, second in run_ranks(_regrouped, 4, env={"LOCAL_WORLD_SIZE": "2"}, timeout=120):
        assert first[1] and second[1], (first, second)
        assert first[0]["rail:p2p"] > 1 and second[0] == {"rail:p2p": 1}, (first, second)


def test_a_steps_chunks_of_one_parameter_move_as_one_range():
    """The schedule merges a destination's consecutive chunks of a parameter in a step: the same elements in
    the same order (so the same sums), one range per parameter."""
    from tide.meta.multinode import Topology
    from tide.multinode.plans import rs_schedule

    shapes, item_sizes = ((37, 5), (11,), (64, 3)), (2, 4, 2)
    layout, plan, steps = rs_schedule(shapes, item_sizes, Topology(3, 2), 16, 96)
    for merged, chunks in zip(steps, plan.rs_steps(), strict=True):
        for d, original in chunks.items():
            def elements(cs):
                return [(c.param, c.grad_offset + i, c.shard_offset + i) for c in cs for i in range(c.numel)]

            assert elements(merged[d]) == elements(original), d
            assert [c.param for c in merged[d]] == sorted({c.param for c in original}), d
    assert sum(len(step[0]) for step in plan.rs_steps()) > sum(len(step[0]) for step in steps)  # chunks did merge


def _one_parameter(rank, world_size, seed):
    """A one-parameter reduce-scatter per gradient dtype on nodes of one rank, where each destination's
    part is one range of the gradient and moves without a copy: (gradient unchanged, result exact) each."""
    import torch.distributed as dist

    import tide

    out = []
    for dt in (torch.float32, torch.bfloat16):
        every = [_inputs(seed, world_size, r, [(3 * world_size + 1, 4)], [dt])[0] for r in range(world_size)]
        grad = every[rank].clone()
        shard = torch.full((4, 4), float("nan"))
        tide.ops.reduce_scatter_params([grad], [shard], dist.group.WORLD, scale=0.5)
        want, _ = _expected_shard([[g] for g in every], 0, every[0].shape, rank, world_size, 1, 0.5, shard, False)
        out.append((torch.equal(grad, every[rank]), torch.equal(shard.reshape(-1), want)))
    return out


def test_gradients_are_read_where_they_lie_never_written():
    for per_dtype in run_ranks(_one_parameter, 2, 6061, env={"LOCAL_WORLD_SIZE": "1"}, timeout=120):
        assert per_dtype == [(True, True), (True, True)], per_dtype
