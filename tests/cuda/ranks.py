"""Rank functions of the CUDA transport tests (spawned by tide.launch.run_ranks; importable without CUDA).

Every check compares the CUDA transport with the reference backend bit for bit: the reference runs
on CPU copies of the same inputs over the same gloo group (``torch.ops.tide.*`` on CPU tensors), the
CUDA outputs are poisoned (NaN) before each call, and inputs are fresh random data each time.
"""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fault_scenarios  # noqa: E402

# Multicast stays off everywhere; several ranks may share one GPU through symmetric memory over gloo.
ENV = {
    "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
}

AG_DTYPES = (torch.float32, torch.bfloat16)
RS_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.uint8: torch.uint8}
BYTE_POISON = 0xA5  # a uint8 output's poison (a byte left unwritten shows unless its data byte is the same)


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(BYTE_POISON if t.dtype == torch.uint8 else float("nan"))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape \
        and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def assert_bits(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not bits_equal(got, want):
        g, w = got.detach().cpu().float(), want.detach().cpu().float()
        bad = ~((g == w) | (g.isnan() & w.isnan()))
        raise AssertionError(f"{what}: {int(bad.sum())} of {g.numel()} elements differ "
                             f"(first at {bad.flatten().nonzero()[:5].flatten().tolist()}; "
                             f"got {g.flatten()[bad.flatten()][:5].tolist()}, "
                             f"want {w.flatten()[bad.flatten()][:5].tolist()})")


def random_shapes(rng: random.Random, world_size: int, n_params: int, allow_0d: bool) -> list[tuple]:
    shapes = []
    for _ in range(n_params):
        kind = rng.random()
        if allow_0d and kind < 0.05:
            shapes.append(())
        elif kind < 0.4:
            shapes.append((rng.randint(1, 4 * world_size + 7),))
        else:
            shapes.append((rng.randint(1, 3 * world_size + 5), rng.randint(1, 67)))
    return shapes


def _data(shape, dtype, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def ag_case(rng: random.Random, world_size: int, rank: int, seed: int, n_params: int):
    """Padded shards (this rank's, CPU) and the out dtypes of one random all-gather."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    shard_shapes = []
    for s in random_shapes(rng, world_size, n_params, allow_0d=False):
        c = -(-s[0] // world_size)
        shard_shapes.append((c, *s[1:]))
    # A fifth of the params are bytes (uint8 into uint8: float8 payloads, tensor extensions' inputs).
    is_bytes = [rng.random() < 0.2 for _ in shard_shapes]
    shard_dtypes = [torch.uint8 if b else rng.choice(AG_DTYPES) for b in is_bytes]
    out_dtypes = [torch.uint8 if b else rng.choice(AG_DTYPES) for b in is_bytes]
    shards = [torch.randint(0, 256, sh, generator=gen, dtype=torch.uint8) if dt == torch.uint8 else _data(sh, dt, gen)
              for sh, dt in zip(shard_shapes, shard_dtypes)]
    return shards, out_dtypes


def rs_case(rng: random.Random, world_size: int, rank: int, seed: int, n_params: int):
    """Unpadded grads (CPU), initial shard grads (CPU, random: used when accumulating), scale, accumulate."""
    from tide.meta.layout import rows_and_row_numel, shard_rows

    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    shapes = random_shapes(rng, world_size, n_params, allow_0d=True)
    dtype_all = rng.choice(RS_DTYPES + (None,))  # None: a mix of dtypes within the group
    grads, shards = [], []
    for s in shapes:
        dt = dtype_all or rng.choice(RS_DTYPES)
        grads.append(_data(s, dt, gen))
        d0, _ = rows_and_row_numel(s)
        shards.append(torch.randn((shard_rows(d0, world_size), *s[1:]), generator=gen))
    scale = rng.choice([1.0, 1.0 / world_size, rng.uniform(0.01, 3.0)])
    accumulate = rng.random() < 0.4
    return grads, shards, scale, accumulate


def ref_all_gather(shards_cpu, out_dtypes, world_size, group_name):
    outs = [poison(torch.empty((world_size * s.numel(),), dtype=dt)) for s, dt in zip(shards_cpu, out_dtypes)]
    torch.ops.tide.all_gather_into_params_(shards_cpu, outs, world_size, group_name)
    return outs


def ref_reduce_scatter(grads_cpu, shards_cpu, scale, accumulate, world_size, group_name):
    outs = [s.clone() if accumulate else torch.full_like(s, float("nan")) for s in shards_cpu]
    torch.ops.tide.reduce_scatter_params_(grads_cpu, outs, scale, accumulate, world_size, group_name)
    return outs


def cuda_all_gather(arena, shards_cpu, out_dtypes, world_size, group_name, bound: bool):
    dev = arena.device
    shards = [s.to(dev) for s in shards_cpu]
    if bound:
        from tide.meta import plans

        layout = plans.all_gather_layout([s.shape for s in shards], out_dtypes, world_size)
        outs = arena.slot_views(layout, out_dtypes, arena.slots.acquire())  # nothing holds slots: round robin
    else:
        outs = [torch.empty((world_size * s.numel(),), dtype=dt, device=dev) for s, dt in zip(shards, out_dtypes)]
    for o in outs:
        poison(o)
    torch.ops.tide.all_gather_into_params_(shards, outs, world_size, group_name)
    return [o.clone() for o in outs] if bound else outs  # a bound slot is reused K calls later


def cuda_reduce_scatter(arena, grads_cpu, shards_cpu, scale, accumulate, world_size, group_name, where):
    """The op on gradients in fresh tensors (``where="autograd"``) or at their places in a free arena slot
    (``"slot"``, where FSDP's Slot-Reuse hooks put them)."""
    dev = arena.device
    if where == "slot":
        grads = arena.grad_views([g.shape for g in grads_cpu], [g.dtype for g in grads_cpu], arena.slots.acquire())
        for g, c in zip(grads, grads_cpu):
            g.copy_(c)
    else:
        grads = [g.to(dev) for g in grads_cpu]
    outs = [s.to(dev) if accumulate else torch.full(s.shape, float("nan"), device=dev) for s in shards_cpu]
    torch.ops.tide.reduce_scatter_params_(grads, outs, scale, accumulate, world_size, group_name)
    return outs


def _enable(group, slot_bytes, ring_bytes):
    from tide import transport

    return transport.enable(group, slot_bytes=slot_bytes, rs_ring_bytes=ring_bytes)


def bitexact(rank: int, world_size: int, seed: int, trials: int) -> dict:
    """Random all-gathers (bound and unbound outputs) and reduce-scatters (gradients in fresh tensors or in
    a slot), each checked."""
    import tide

    tide.reset_stats()
    group = dist.group.WORLD
    name = group.group_name
    arena = _enable(group, 4 << 20, 64 << 10)  # a tiny ring: chunks span several rounds and wrap it
    rng = random.Random(seed)  # same stream on every rank: shapes, dtypes and modes agree
    checked = 0
    for t in range(trials):
        shards, out_dtypes = ag_case(rng, world_size, rank, seed + t, rng.randint(1, 14))
        bound = rng.random() < 0.5
        got = cuda_all_gather(arena, shards, out_dtypes, world_size, name, bound)
        want = ref_all_gather(shards, out_dtypes, world_size, name)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_bits(f"rank {rank} trial {t} all_gather param {i} (bound={bound})", g, w)
        grads, init, scale, acc = rs_case(rng, world_size, rank, seed + t, rng.randint(1, 14))
        where = rng.choice(("autograd", "slot"))
        got = cuda_reduce_scatter(arena, grads, init, scale, acc, world_size, name, where)
        want = ref_reduce_scatter(grads, init, scale, acc, world_size, name)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_bits(f"rank {rank} trial {t} reduce_scatter param {i} (grads in {where}, acc={acc})", g, w)
        checked += 2
    torch.cuda.synchronize()
    return {"checked": checked, "stats": tide.stats()["ops"], "ring_depth": arena.ring_depth,
            "cast_ctas": arena.cast_ctas}


def stress(rank: int, world_size: int, seed: int, steps: int) -> dict:
    """A random sequence of AG/RS calls over several groups (the world, whose duplicate shares its arena,
    and pairs), gradients in fresh tensors or in a slot, bound and unbound outputs, issued back to back and
    checked at the end."""
    import tide
    from tide import transport

    tide.reset_stats()
    groups = [dist.group.WORLD, dist.new_group(backend="gloo")]
    pairs = [dist.new_group([r, r + 1], backend="gloo") for r in range(0, world_size - 1, 2)] if world_size >= 4 else []
    if pairs:
        groups.append(pairs[rank // 2] if rank // 2 < len(pairs) else None)
    arenas = {0: _enable(groups[0], 2 << 20, (16 << 10) * world_size)}
    arenas[1] = transport.get(groups[1].group_name)  # the same ranks in the same order: the same arena
    assert arenas[1] is arenas[0]
    if len(groups) > 2 and groups[2] is not None:
        arenas[2] = _enable(groups[2], 2 << 20, (16 << 10) * 2 * 3)
    rng = random.Random(seed)
    pending = []
    for step in range(steps):
        gi = rng.randrange(len(groups))
        op = rng.choice(("ag", "rs"))
        n_params = rng.randint(1, 10)
        flavour = rng.random()
        case_rng = random.Random(rng.random())
        if groups[gi] is None or gi not in arenas:
            continue
        g, arena = groups[gi], arenas[gi]
        W, r, name = g.size(), g.rank(), g.group_name
        if op == "ag":
            shards, out_dtypes = ag_case(case_rng, W, r, seed * 7 + step, n_params)
            got = cuda_all_gather(arena, shards, out_dtypes, W, name, bound=flavour < 0.5)
            pending.append((f"step {step} ag group {gi}", got, (shards, out_dtypes, W, name), "ag"))
        else:
            grads, init, scale, acc = rs_case(case_rng, W, r, seed * 7 + step, n_params)
            where = "slot" if flavour < 0.5 else "autograd"
            got = cuda_reduce_scatter(arena, grads, init, scale, acc, W, name, where)
            pending.append((f"step {step} rs group {gi} grads in {where}", got, (grads, init, scale, acc, W, name),
                            "rs"))
    torch.cuda.synchronize()
    # References in issue order (each group's ranks issue the same sequence of reference collectives).
    for what, got, args, op in pending:
        want = ref_all_gather(*args) if op == "ag" else ref_reduce_scatter(*args)
        for i, (gt, w) in enumerate(zip(got, want)):
            assert_bits(f"rank {rank} {what} param {i}", gt, w)
    return {"checked": len(pending), "stats": tide.stats()["ops"]}


def repeated_calls(rank: int, world_size: int, seed: int, repeats: int) -> dict:
    """The same plans called again and again on one arena (a duplicate of the world group): all-gathers
    alternating over both slots (bound outputs) and into unbound outputs (the reference path),
    reduce-scatters of the same gradient tensors, of fresh ones and of gradients in either slot; a small
    ring of depth 2, so the pushes wrap it and wait for its flow control. Every result is checked bit for
    bit."""
    import tide
    from tide import transport
    from tide.meta import plans

    tide.reset_stats()
    group = dist.new_group(backend="gloo")
    name = group.group_name
    arena = transport.enable(group, slot_bytes=1 << 20, rs_ring_bytes=(8 << 10) * world_size, ring_depth=2)
    dev = arena.device
    rng = random.Random(seed)  # the same cases on every rank
    shards, out_dtypes = ag_case(rng, world_size, rank, seed, 9)
    layout = plans.all_gather_layout([s.shape for s in shards], out_dtypes, world_size)
    grads_cpu, init, scale, _ = rs_case(rng, world_size, rank, seed + 1, 11)
    shards_d = [s.to(dev) for s in shards]
    grads_d = [g.to(dev) for g in grads_cpu]
    checked, slots, marked = 0, set(), []
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    for t in range(repeats):
        # All-gather: new data in the same shard tensors, outputs bound in the next slot (2 of 3 calls)
        # or unbound.
        new = [torch.randn(s.shape, generator=gen).to(s.dtype) for s in shards]
        for d, n in zip(shards_d, new):
            d.copy_(n)
        bound = t % 3 != 2
        if bound:
            slot = arena.slots.acquire()
            slots.add(slot)
            outs = arena.slot_views(layout, out_dtypes, slot)
        else:
            outs = [torch.empty((world_size * s.numel(),), dtype=dt, device=dev) for s, dt in zip(new, out_dtypes)]
        for o in outs:
            poison(o)
        uses = arena.slots.uses(slot) if bound else 0
        torch.ops.tide.all_gather_into_params_(shards_d, outs, world_size, name)
        if bound:  # the op records its use of the slot: the next all-gather there waits for it
            marked.append(arena.slots.uses(slot) - uses)
        got = [o.clone() for o in outs]
        want = ref_all_gather(new, out_dtypes, world_size, name)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_bits(f"rank {rank} repeat {t} all_gather param {i} (bound={bound})", g, w)
        # Reduce-scatter: the same tensors refilled (t % 3 == 0), fresh tensors (1) or the gradients in a
        # slot (2, alternating slots); accumulate or not.
        new = [torch.randn(g.shape, generator=gen).to(g.dtype) for g in grads_cpu]
        where = ("same tensors", "fresh tensors", f"slot {t % 2}")[t % 3]
        if t % 3 == 0:
            for d, n in zip(grads_d, new):
                d.copy_(n)
            grads = grads_d
        elif t % 3 == 1:
            grads = [n.to(dev) for n in new]
        else:
            grads = arena.grad_views([g.shape for g in new], [g.dtype for g in new], t % 2)
            for d, n in zip(grads, new):
                d.copy_(n)
        acc = t % 4 == 1
        outs = [s.to(dev) if acc else torch.full(s.shape, float("nan"), device=dev) for s in init]
        torch.ops.tide.reduce_scatter_params_(grads, outs, scale, acc, world_size, name)
        want = ref_reduce_scatter(new, init, scale, acc, world_size, name)
        for i, (g, w) in enumerate(zip(outs, want)):
            assert_bits(f"rank {rank} repeat {t} reduce_scatter param {i} (grads: {where}, acc={acc})", g, w)
        checked += 2
    torch.cuda.synchronize()
    return {"checked": checked, "slots": sorted(slots), "marked": marked, "counters": arena.counters(),
            "stats": tide.stats()["ops"], "steady": dict(arena.ext.steady_calls())}


def lease_cycles(rank: int, world_size: int, seed: int, cycles: int) -> dict:
    """Ops across releases of the data region (tide/transport/lease.py): each cycle all-gathers into a
    slot and reduce-scatters through the ring (new data, checked bit for bit), then releases, so the next
    cycle leases again. Slot views taken in cycle 1 keep that lease's memory alive past its release:
    their bytes must come through the later cycles untouched (no peer writes into a region it no
    longer leases). Store keys of old leases are deleted. In the symmetric fallback (no lease is ever
    released) the ops alone are checked."""
    import tide  # noqa: F401
    from tide import transport
    from tide.meta import plans

    group = dist.new_group(backend="gloo")
    name = group.group_name
    arena = transport.enable(group, slot_bytes=1 << 20, rs_ring_bytes=(8 << 10) * world_size, ring_depth=2)
    rng = random.Random(seed)  # the same cases on every rank
    kept, kept_copy, addresses = None, None, []
    for cycle in range(cycles):
        shards, out_dtypes = ag_case(rng, world_size, rank, seed + cycle, 5)
        got = cuda_all_gather(arena, shards, out_dtypes, world_size, name, bound=True)
        addresses.append(arena.leases.held.data_ptr())
        for i, (g, w) in enumerate(zip(got, ref_all_gather(shards, out_dtypes, world_size, name))):
            assert_bits(f"rank {rank} cycle {cycle} all_gather param {i}", g, w)
        grads, init, scale, acc = rs_case(rng, world_size, rank, seed + 100 + cycle, 7)
        got = cuda_reduce_scatter(arena, grads, init, scale, acc, world_size, name, "autograd")
        for i, (g, w) in enumerate(zip(got, ref_reduce_scatter(grads, init, scale, acc, world_size, name))):
            assert_bits(f"rank {rank} cycle {cycle} reduce_scatter param {i}", g, w)
        if cycle == 1 and arena.leases.mode == "allocator":
            layout = plans.all_gather_layout([s.shape for s in shards], out_dtypes, world_size)
            kept = arena.slot_views(layout, out_dtypes, arena.slots.acquire())
            for k in kept:
                k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(seed + rank)).to(k.dtype))
            kept_copy = [k.clone() for k in kept]
        arena.release()  # no barrier: the flags alone keep peers out of a released region
    torch.cuda.synchronize()
    store = dist.distributed_c10d._get_default_store()
    old_keys = [f"{arena.store_prefix}/lease{n}/{rank}" for n in range(1, cycles - 1)]
    return {"leases": arena.leases.count, "mode": arena.leases.mode, "addresses": addresses,
            "kept_intact": kept is not None and all(bits_equal(k, c) for k, c in zip(kept, kept_copy)),
            "old_keys_left": [k for k in old_keys if store.check([k])]}


def grads_in_slot(rank: int, world_size: int, seed: int) -> dict:
    """A reduce-scatter of gradients at their places in a slot (where the FSDP hooks put them) issues
    exactly the copies and kernels of one from autograd's tensors (ring depth 1: every round waits for
    the one before), and leaves the slot busy until it has read them. Every call is checked bit for bit."""
    import tide  # noqa: F401
    from tide import transport

    group = dist.new_group(backend="gloo")
    name = group.group_name
    arena = transport.enable(group, slot_bytes=1 << 20, rs_ring_bytes=(8 << 10) * world_size, ring_depth=1)
    dev = arena.device
    rng = random.Random(seed)
    grads_cpu, init, scale, _ = rs_case(rng, world_size, rank, seed, 7)
    grads_cpu = [g.to(torch.bfloat16) for g in grads_cpu]
    sets = {"autograd": [g.to(dev) for g in grads_cpu],
            "slot": arena.grad_views([g.shape for g in grads_cpu], [g.dtype for g in grads_cpu], 1)}
    gen = torch.Generator().manual_seed(seed * 17 + rank)
    keys = ("ce_copies", "kernels", "flags")
    deltas, busy = [], []
    for step, which in enumerate(["autograd", "slot", "autograd", "slot"]):
        new = [torch.randn(g.shape, generator=gen).to(g.dtype) for g in grads_cpu]
        for d, n in zip(sets[which], new):
            d.copy_(n)
        outs = [torch.full(s.shape, float("nan"), device=dev) for s in init]
        before, uses_before = arena.counters(), arena.slots.uses(1)
        torch.ops.tide.reduce_scatter_params_(sets[which], outs, scale, False, world_size, name)
        after = arena.counters()
        want = ref_reduce_scatter(new, init, scale, False, world_size, name)
        for i, (g, w) in enumerate(zip(outs, want)):
            assert_bits(f"rank {rank} step {step} (grads in {which}) reduce_scatter param {i}", g, w)
        deltas.append({"where": which, **{k: after[k] - before[k] for k in keys}})
        busy.append(arena.slots.uses(1) != uses_before)
    torch.cuda.synchronize()
    return {"deltas": deltas, "slot_marked_busy": busy}


def bad_input(rank: int, world_size: int) -> dict:
    """Bad arguments to the CUDA kernels of both ops: each raises at once (TypeError / ValueError whose
    message names the op and the argument) on every rank alike, and the arena still works after."""
    import tide  # noqa: F401
    from tide import transport

    group = dist.group.WORLD
    name = group.group_name
    transport.enable(group, slot_bytes=1 << 20)
    dev = torch.device("cuda", torch.cuda.current_device())
    W = world_size
    grads = [torch.randn(2 * W + 1, 3, device=dev).bfloat16(), torch.randn(5, device=dev).bfloat16()]
    shard_grads = [torch.empty(3, 3, device=dev), torch.empty(-(-5 // W), device=dev)]
    shards = [torch.randn(2, 3, device=dev), torch.randn(4, device=dev).bfloat16()]
    outs = [torch.empty(2 * W, 3, device=dev), torch.empty(4 * W, device=dev, dtype=torch.bfloat16)]
    rs, ag = torch.ops.tide.reduce_scatter_params_, torch.ops.tide.all_gather_into_params_
    cases = {
        "rs_int_grad": (lambda: rs([grads[0].int(), grads[1]], shard_grads, 1.0, False, W, name),
                        TypeError, "grads[0]"),
        "rs_bf16_shard": (lambda: rs(grads, [shard_grads[0].bfloat16(), shard_grads[1]], 1.0, False, W, name),
                          TypeError, "shard_grads[0]"),
        "rs_noncontiguous": (lambda: rs([grads[0], grads[1]], [shard_grads[0].t(), shard_grads[1]], 1.0, False, W,
                                        name), ValueError, "shard_grads[0]"),
        "rs_shape": (lambda: rs(grads, [shard_grads[0], torch.empty(9, device=dev)], 1.0, False, W, name),
                     ValueError, "shard_grads[1]"),
        "rs_length": (lambda: rs(grads, shard_grads[:1], 1.0, False, W, name), ValueError, "shard_grads has 1"),
        "rs_cpu_tensor": (lambda: rs([grads[0], grads[1].cpu()], shard_grads, 1.0, False, W, name), ValueError,
                          "grads[1]"),
        "rs_world_size": (lambda: rs(grads, shard_grads, 1.0, False, W + 1, name), ValueError, "world_size"),
        "ag_out_shape": (lambda: ag(shards, [outs[0], torch.empty(3, device=dev)], W, name), ValueError, "outs[1]"),
        "ag_0d_shard": (lambda: ag([shards[0], torch.randn((), device=dev)], outs, W, name), ValueError, "shards[1]"),
        "ag_int_out": (lambda: ag(shards, [outs[0].int(), outs[1]], W, name), TypeError, "outs[0]"),
    }
    # An error raised inside the extension (TORCH_CHECK, a number in its message) reaches Python as a
    # RuntimeError instead of crashing the process (see num() in csrc/kernels.h).
    ext = transport.get(name).ext
    cases["extension_error"] = (lambda: ext.Arena(rank=5, world=2, flag_bases=[0, 0], device=0, num_slots=0,
                                                  slot_bytes=0, ring_depth=1, entry_bytes=16, sum_ctas=1, cast_ctas=1),
                                RuntimeError, "rank 5 not in [0, 2)")
    # bind_outputs checks every output in its one extension call before binding any.
    arena = transport.get(name)
    loose = [torch.empty(W * s.numel(), device=dev, dtype=o.dtype) for s, o in zip(shards, outs)]
    loose_ptrs = [t.data_ptr() for t in loose]
    cases["bind_2d_output"] = (lambda: arena.bind_outputs([loose[0], loose[1].view(W, -1)], 0), ValueError, "1-D")
    cases["bind_cpu_output"] = (lambda: arena.bind_outputs([loose[0], loose[1].cpu()], 0), ValueError, "device")
    messages = {}
    for case, (fn, exc, arg) in cases.items():
        try:
            fn()
            messages[case] = "no error"
        except exc as e:
            msg = str(e).splitlines()[0]
            op = {"rs": "reduce_scatter_params_", "ag": "all_gather_into_params_",
                  "bi": "transport.bind_outputs"}.get(case[:2], "Arena")
            messages[case] = "ok" if msg.startswith(f"tide.{op}:") and arg in msg else f"bad message: {msg}"
        except Exception as e:  # the wrong exception type
            messages[case] = f"{type(e).__name__}: {e}"
    # The arena is untouched: a valid call of each op still agrees with the reference.
    shard_cpu = [s.cpu() for s in shards]
    want = ref_all_gather(shard_cpu, [o.dtype for o in outs], W, name)
    flat = [torch.full((W * s.numel(),), float("nan"), device=dev, dtype=o.dtype) for s, o in zip(shards, outs)]
    ag(shards, flat, W, name)
    after_ok = all(bits_equal(f, w) for f, w in zip(flat, want))
    got = [torch.full(s.shape, float("nan"), device=dev) for s in shard_grads]
    rs(grads, got, 0.5, False, W, name)
    want = ref_reduce_scatter([g.cpu() for g in grads], [s.cpu() for s in shard_grads], 0.5, False, W, name)
    after_ok = after_ok and all(bits_equal(g, w) for g, w in zip(got, want))
    messages["bind_nothing_bound"] = "ok" if [t.data_ptr() for t in loose] == loose_ptrs else "bound before the error"
    # Bound for real, the outputs live in the arena and the all-gather writes them in place.
    arena.bind_outputs(loose, 0)
    base = arena.leases.held.data_ptr()
    in_arena = all(base <= t.data_ptr() < base + arena.data_bytes for t in loose)
    for t in loose:
        t.fill_(float("nan"))
    ag(shards, loose, W, name)
    want = ref_all_gather(shard_cpu, [o.dtype for o in outs], W, name)
    after_ok = after_ok and in_arena and all(bits_equal(t, w) for t, w in zip(loose, want))
    torch.cuda.synchronize()
    return {"messages": messages, "after_ok": after_ok}


def _chrome_kernels(prof, path: str) -> list[dict]:
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    return [{"cat": e.get("cat"), "name": e.get("name")} for e in events
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def profile_zero_sm(rank: int, world_size: int, trace_dir: str) -> dict:
    """GPU activity of TIDE-AG with bf16 shards (no cast), with fp32 shards into bf16 outputs (the
    own-shard cast) and of one TIDE-RS (after a warm-up), from torch.profiler."""
    import tide  # noqa: F401
    from torch.profiler import ProfilerActivity, profile

    from tide.meta import plans

    group = dist.group.WORLD
    name = group.group_name
    arena = _enable(group, 4 << 20, 1 << 20)
    rng = random.Random(5)
    shards, out_dtypes = ag_case(rng, world_size, rank, 11, 8)
    out_dtypes = [torch.bfloat16] * len(shards)
    grads, init, _, _ = rs_case(rng, world_size, rank, 12, 8)
    grads = [g.to(torch.bfloat16) for g in grads]
    dev = arena.device
    layout = plans.all_gather_layout([s.shape for s in shards], out_dtypes, world_size)
    grads_d = [g.to(dev) for g in grads]
    shard_out = [torch.empty(s.shape, device=dev) for s in init]
    out = {"gpus": torch.cuda.device_count()}
    for case, dtype in (("ag_bf16", torch.bfloat16), ("ag_fp32_to_bf16", torch.float32)):
        shards_d = [s.to(dev, dtype) for s in shards]
        for _ in range(2):  # warm-up: extension, plans, first-use driver work
            torch.ops.tide.all_gather_into_params_(shards_d,
                                                   arena.slot_views(layout, out_dtypes, arena.slots.acquire()),
                                                   world_size, name)
        outs = arena.slot_views(layout, out_dtypes, arena.slots.acquire())
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.ops.tide.all_gather_into_params_(shards_d, outs, world_size, name)
            torch.cuda.synchronize()
        dist.barrier()
        out[case] = _chrome_kernels(prof, os.path.join(trace_dir, f"{case}_rank{rank}.json"))
    for _ in range(2):
        torch.ops.tide.reduce_scatter_params_(grads_d, shard_out, 1.0, False, world_size, name)
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof_rs:
        torch.ops.tide.reduce_scatter_params_(grads_d, shard_out, 1.0, False, world_size, name)
        torch.cuda.synchronize()
    dist.barrier()
    out["rs"] = _chrome_kernels(prof_rs, os.path.join(trace_dir, f"rs_rank{rank}.json"))
    out["counters"] = arena.counters()
    return out


def fallbacks(rank: int, world_size: int) -> dict:
    """One NCCL rank: stock path without an arena, the TIDE path, and under CUDA-graph capture into outputs
    bound in an eager lease the stock path, captured."""
    import tide
    from tide import transport
    from tide.transport import probe

    tide.reset_stats()
    group = dist.group.WORLD
    name = group.group_name
    dev = torch.device("cuda", torch.cuda.current_device())
    shards = [torch.randn(5, 3, device=dev), torch.randn(7, device=dev, dtype=torch.bfloat16)]
    want = [s.float().flatten() for s in shards]

    def run(outs):
        for o in outs:
            o.fill_(float("nan"))
        torch.ops.tide.all_gather_into_params_(shards, outs, 1, name)

    outs = [torch.empty(15, device=dev), torch.empty(7, device=dev)]
    run(outs)  # no arena yet: stock
    no_arena_ok = all(bits_equal(o, w) for o, w in zip(outs, want))
    transport.enable(group, slot_bytes=1 << 16).bind_outputs(outs, 0)
    run(outs)  # TIDE
    tide_ok = all(bits_equal(o, w) for o, w in zip(outs, want))
    # Captured into a graph while the outputs lie in the eager lease: stock collectives (NCCL), replayed.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(outs)  # warm-up outside capture on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.tide.all_gather_into_params_(shards, outs, 1, name)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    graph_ok = all(bits_equal(o, w) for o, w in zip(outs, want))
    rendezvous_in_capture = "allowed"
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        try:
            transport.Arena(group, 1 << 16)
        except RuntimeError as e:  # raised before any CUDA work, so the capture stays valid
            rendezvous_in_capture = str(e)
    torch.cuda.synchronize()
    return {
        "no_arena_ok": no_arena_ok,
        "tide_ok": tide_ok,
        "graph_ok": graph_ok,
        "rendezvous_in_capture": rendezvous_in_capture,
        "stats": tide.stats()["ops"],
        "multicast_allowed": probe.multicast_allowed(),
        "env": {k: os.environ.get(k) for k in ENV},
    }


def disable_frees(rank: int, world_size: int) -> dict:
    """Device memory free before enable, after enable and after disable (every rank measures between
    barriers, so on a shared GPU all ranks' arenas come and go together); twice, so a leak would grow."""
    import gc

    import tide  # noqa: F401
    from tide import transport

    group = dist.group.WORLD
    free = []

    def measure():
        gc.collect()
        torch.cuda.synchronize()
        dist.barrier()  # every rank has closed its mappings of its peers' leases
        torch.cuda.empty_cache()  # a released lease is in the allocator's cache
        dist.barrier()
        free.append(torch.cuda.mem_get_info()[0])
        dist.barrier()

    measure()
    arena_bytes = 0
    for _ in range(2):
        arena = transport.enable(group, slot_bytes=256 << 20, rs_ring_bytes=64 << 20)
        arena_bytes = arena.symmetric_bytes + arena.data_bytes
        cuda_all_gather(arena, [torch.randn(64, 8)], [torch.bfloat16], world_size, group.group_name, bound=True)
        del arena
        measure()
        transport.disable(group.group_name)
        measure()
    return {"free": free, "arena_bytes": arena_bytes, "gpus": torch.cuda.device_count()}


def recover_after_error(rank: int, world_size: int) -> dict:
    """After a desynchronisation error (rank 1 issues another layout as the arena's first plan: both ranks
    raise before anything is issued), the arena is released without hanging, and a fresh group gets a
    new arena whose ops agree with the reference."""
    import tide  # noqa: F401
    from tide import transport

    W = world_size
    dev = torch.device("cuda", torch.cuda.current_device())
    first = dist.new_group(backend="gloo")
    arena = transport.enable(first, slot_bytes=1 << 20)
    rows = 5 if rank == 1 else 4
    shards = [torch.randn(rows, 3, device=dev)]
    outs = arena.slot_views(plans_layout([s.shape for s in shards], [torch.float32], W), [torch.float32],
                            arena.slots.acquire())
    try:
        torch.ops.tide.all_gather_into_params_(shards, outs, W, first.group_name)
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    first_bytes = arena.symmetric_bytes + arena.data_bytes
    del arena, outs

    def free_memory():
        torch.cuda.synchronize()
        dist.barrier()  # on a shared GPU every rank's arena goes at once
        torch.cuda.empty_cache()  # a released lease is in the allocator's cache
        dist.barrier()
        free = torch.cuda.mem_get_info()[0]
        dist.barrier()
        return free

    before = free_memory()
    transport.disable(first.group_name)
    dist.destroy_process_group(first)
    freed = free_memory() - before
    second = dist.new_group(backend="gloo")
    arena = transport.enable(second, slot_bytes=1 << 20)
    cpu = [torch.randn(4, 3)]
    outs = arena.slot_views(plans_layout([s.shape for s in cpu], [torch.float32], W), [torch.float32],
                            arena.slots.acquire())
    torch.ops.tide.all_gather_into_params_([c.to(dev) for c in cpu], outs, W, second.group_name)
    want = ref_all_gather(cpu, [torch.float32], W, second.group_name)
    torch.cuda.synchronize()
    return {"error": error, "freed": freed, "arena_bytes": first_bytes, "gpus": torch.cuda.device_count(),
            "after_ok": all(bits_equal(o, w) for o, w in zip(outs, want))}


def plans_layout(shapes, dtypes, world_size):
    from tide.meta import plans

    return plans.all_gather_layout(shapes, dtypes, world_size)


def stalled_peer(rank: int, world_size: int, fault_file: str) -> str:
    """One all-gather on both ranks (its plan agreed); then rank 1 stops issuing, past rank 0's timeout
    + 15 s, while rank 0 all-gathers again with the same plan and waits for the GPU."""
    import tide  # noqa: F401
    from tide import transport

    group = dist.group.WORLD
    arena = transport.enable(group, slot_bytes=1 << 20)
    dev = arena.device
    shards = [torch.randn(4, 3, device=dev).bfloat16(), torch.randn(5, device=dev).bfloat16()]
    layout = plans_layout([s.shape for s in shards], [torch.bfloat16] * 2, world_size)
    for call in range(2):
        if rank == fault_scenarios.FAULTY_RANK and call == 1:
            fault_scenarios.stall(fault_file)
        outs = arena.slot_views(layout, [torch.bfloat16] * 2, arena.slots.acquire())
        torch.ops.tide.all_gather_into_params_(shards, outs, world_size, group.group_name)
        torch.cuda.synchronize()
    return "finished"


def mismatched_layout(rank: int, world_size: int) -> str:
    """Each rank enables an arena with its own ring depth: every rank must refuse, naming the setting."""
    from tide import transport

    os.environ["TIDE_RS_RING_DEPTH"] = str(2 + rank)
    try:
        transport.enable(dist.group.WORLD, slot_bytes=1 << 20)
    except RuntimeError as e:
        return str(e)
    return "enabled"


def swapped_graph_calls(rank: int, world_size: int) -> str:
    """Rank 0 issues two graph all-gathers in one order, its peers in the other (different layouts): the rank
    that compares second refuses; a rank that issued waits for the refusing rank's part."""
    import tide  # noqa: F401
    from tide import transport

    group = dist.group.WORLD
    arena = transport.enable(group, slot_bytes=1 << 20)
    dev = arena.device
    calls = [[torch.randn(3, 5, device=dev).bfloat16()], [torch.randn(2, 7, device=dev)]]
    if rank != 0:
        calls.reverse()
    for shards in calls:
        for out in torch.ops.tide.all_gather_start(shards, world_size, group.group_name):
            torch.ops._c10d_functional.wait_tensor(out)
        torch.cuda.synchronize()
    return "finished"
