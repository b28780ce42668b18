"""TIDE-AG / TIDE-RS against the collectives they replace, 1 MiB to 1 GiB.

Every rank holds one param group of 8 bf16 parameters with uneven dim-0 shards whose gathered size is
the message size S. Variants, per message size:

- ``tide_ag``: ``torch.ops.tide.all_gather_into_params_`` of bf16 shards into outputs bound in an arena
  slot (zero-copy, the FSDP2 path; copy engines only); ``tide_ag_cast``: the same from fp32 shards (FSDP2's
  mixed precision: the own-shard cast pipelined with the pushes); ``tide_rs``:
  ``torch.ops.tide.reduce_scatter_params_`` of the bf16 grads into fp32 shard grads (In-Place mode).
- with one GPU per rank (NCCL): ``nccl_ag`` / ``nccl_rs_bf16`` (``torch.distributed`` on flat buffers,
  NCCL's default kernels); ``nccl_ce_ag``: NCCL's own zero-SM copy-engine all-gather (``bench/nccl_ce.py``:
  CTA policy zero, buffers in NCCL symmetric memory; run in processes of its own, since torch symmetric
  memory has one backend per process); ``fsdp2_ag`` / ``fsdp2_ag_cast`` (FSDP2's copy-in + NCCL
  all-gather + copy-out with its own ops, from bf16 / fp32 shards) and ``fsdp2_rs_fp32`` (``chunk_cat``
  into fp32 + NCCL fp32 reduce-scatter).
- ranks sharing one GPU (gloo group + symmetric memory): only the TIDE variants and ``reference_*`` (the
  ops' gloo reference, CPU-staged). **These are not NVLink numbers**: every "peer" copy is a same-GPU
  SM copy, and all ranks share one GPU's HBM.
- ``--local-world-size L`` (L < ranks): nodes of L ranks **emulated** on this machine, the multi-node
  schedule against NCCL on the same ranks: ``tide_ag_multinode`` / ``tide_rs_multinode`` (the ops with no
  arena: recursive doubling on the rails, fp32 node partials, every round point-to-point,
  ``tide/multinode/rails.py``) and, with one GPU per rank, ``nccl_ag`` / ``nccl_rs_bf16``. The "rails"
  here are NVLink (or one GPU), not a network: this shows the schedule's cost and correctness on GPUs,
  not what it gains across real nodes. The schedule's settings come from the environment
  (``TIDE_MULTINODE_PACE_BYTES``, ``TIDE_MULTINODE_RAILS``) and are the CSV's ``pace_bytes`` and ``rails``
  columns. Writes ``collectives_multinode.csv`` and ``.png``, and
  ``collectives_multinode_profile.csv``: where one call of each TIDE variant spends its time, rank 0 (the
  torch.profiler's ``key_averages``: the 12 largest host and the 12 largest GPU entries by self time,
  their call counts, and the call's wall time).

busbw as nccl-tests defines it: ``S / t * (W-1)/W`` where S is the all-gather's output bytes (bf16)
and the reduce-scatter's input bytes per rank (bf16 grads; the fp32 variants move 2x the bytes for the
same S). t is the time per call of ``inner`` calls back to back, as nccl-tests times a collective: 50
calls at 1 MiB down to 8 from 32 MiB, so the ranks' skew after a barrier and the first call's start are
amortised. With 2 calls from 256 MiB the first call would weigh half: on 2 x H200, bench/timeline.py's
TIDE-AG took 419 us per call over 3 calls after a barrier, and 371 us from one call's start to the next. t is the
slowest rank's median over ``--reps``. SM time: the summed duration of non-memcpy/memset GPU kernels one call launches
(torch.profiler). Host time (``host_us``): the slowest rank's median time to issue one call in those loops; where it
reaches t, the host sets the pace, not the GPU. Writes ``collectives.csv`` and ``.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_ms, default_out, log2_axes, pyplot, require_cuda, run_meta, write_csv  # noqa: E402

N_PARAMS = 8


def group_shapes(total_bytes: int, world_size: int) -> list[tuple[int, int]]:
    """8 bf16 params of 1024-element rows, uneven dim 0, gathered size about ``total_bytes``."""
    rows = max(N_PARAMS, total_bytes // 2 // 1024)
    base = [rows * w // 36 for w in range(1, N_PARAMS + 1)]  # weights 1..8 sum to 36
    base[-1] += rows - sum(base)
    return [(max(1, r + (i % 3) - 1), 1024) for i, r in enumerate(base)]  # +-1 row: uneven shards


def inner_calls(size_mib: int) -> int:
    return max(8, min(50, 256 // max(1, size_mib)))


def median_times(fn, reps: int, inner: int) -> tuple[float, float]:
    """Medians over ``reps`` samples of ``inner`` back-to-back calls after a barrier: (GPU milliseconds per
    call, by CUDA events; host microseconds to issue one call). A host time at or above the GPU time
    means the host, not the GPU, sets the pace."""
    fn()
    times, issue = [], []

    def calls():
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        issue.append((time.perf_counter() - t0) / inner * 1e6)

    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        times.append(cuda_ms(calls) / inner)
    return statistics.median(times), statistics.median(issue)


_profiler_started = False


def line_up() -> None:
    """Every rank idle, its profiler started once, and past a barrier before one profiled call: otherwise
    a kernel that waits for a peer (NCCL's) counts the peer's lateness, or the peer's profiler start-up,
    as its own time (1.4 s of "SM time" at 1 MiB in a first profiled call on 2 x H200)."""
    global _profiler_started
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    if not _profiler_started:
        with profile(activities=[ProfilerActivity.CUDA]):
            torch.cuda.synchronize()
        _profiler_started = True
    dist.barrier()
    torch.cuda.synchronize()


def sm_time_us(fn) -> float:
    from torch.profiler import ProfilerActivity, profile

    line_up()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not any(
                k in e.name.lower() for k in ("memcpy", "memset")):
            total += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return total


PROFILE_TOP = 12


def profile_rows(fn, variant: str, size: int) -> list[dict]:
    """Where one call of ``fn`` spends its time (torch.profiler, self times): the largest host and GPU
    entries, for a schedule whose per-call cost is not yet understood."""
    from torch.profiler import ProfilerActivity, profile

    line_up()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    averages = prof.key_averages()
    gpu = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
    rows = []
    for side, key in (("host", lambda e: e.self_cpu_time_total), ("gpu", gpu)):
        for e in sorted(averages, key=key, reverse=True)[:PROFILE_TOP]:
            if key(e) > 0:
                rows.append({"variant": variant, "size_mib": size, "side": side, "name": e.key[:120],
                             "self_us": key(e), "calls": e.count, "call_wall_us": wall_us})
    return rows


def _measure(variants: dict, size: int, reps: int) -> list[dict]:
    rows = []
    for name, (fn, nbytes) in variants.items():
        ms, host_us = median_times(fn, reps, inner_calls(size))
        rows.append({"variant": name, "size_mib": size, "bytes": nbytes, "ms": ms, "sm_us": sm_time_us(fn),
                     "host_us": host_us})
    return rows


def _rank_main(rank, world_size, sizes_mib, reps, one_gpu_per_rank):
    import tide  # noqa: F401
    import tide.transport
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # noqa: F401  (torch.ops.fsdp.*)

    from tide.meta.layout import GroupLayout
    from tide.ops import reference

    dev = torch.device("cuda", torch.cuda.current_device())
    gn = dist.group.WORLD.group_name
    layouts = {s: GroupLayout(group_shapes(s << 20, world_size), [2] * N_PARAMS, world_size) for s in sizes_mib}
    arena = tide.transport.enable(dist.group.WORLD, layouts=list(layouts.values()))
    rows = []
    for size, layout in layouts.items():
        params = layout.params
        numels = [p.shard_numel for p in params]
        total = sum(numels)
        shards32 = [torch.randn(n, device=dev) for n in numels]
        shards = [s.to(torch.bfloat16) for s in shards32]
        outs = [torch.empty(p.out_numel, device=dev, dtype=torch.bfloat16) for p in params]
        arena.bind_outputs(outs, 0)
        grads = [torch.randn(p.shape, device=dev).to(torch.bfloat16) for p in params]
        shard_grads = [torch.empty((p.shard_rows, 1024), device=dev) for p in params]
        ag_bytes = world_size * total * 2
        rs_bytes = sum(g.numel() for g in grads) * 2
        variants = {
            "tide_ag": (lambda: torch.ops.tide.all_gather_into_params_(shards, outs, world_size, gn), ag_bytes),
            "tide_ag_cast": (lambda: torch.ops.tide.all_gather_into_params_(shards32, outs, world_size, gn), ag_bytes),
            "tide_rs": (lambda: torch.ops.tide.reduce_scatter_params_(grads, shard_grads, 1.0 / world_size, False,
                                                                      world_size, gn), rs_bytes),
        }
        if one_gpu_per_rank:
            flat_in = torch.randn(total, device=dev).to(torch.bfloat16)
            flat_out = torch.empty(world_size * total, device=dev, dtype=torch.bfloat16)
            rs_in_bf16 = torch.randn(world_size * total, device=dev).to(torch.bfloat16)
            rs_out_bf16 = torch.empty(total, device=dev, dtype=torch.bfloat16)
            rs_in32 = torch.empty(world_size * total, device=dev)
            rs_out32 = torch.empty(total, device=dev)

            def fsdp2_ag(inputs):
                inp, out = torch.ops.fsdp.all_gather_copy_in(inputs, flat_out, numels, total, rank)
                dist.all_gather_into_tensor(out, inp)
                torch.ops.fsdp.split_with_sizes_copy(out.view(world_size, -1), numels, dim=1,
                                                     out=[o.view(world_size, -1) for o in outs])

            def fsdp2_rs():
                torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=world_size, out=rs_in32.view(world_size, -1))
                dist.reduce_scatter_tensor(rs_out32, rs_in32)

            variants.update({
                "nccl_ag": (lambda: dist.all_gather_into_tensor(flat_out, flat_in), ag_bytes),
                "nccl_rs_bf16": (lambda: dist.reduce_scatter_tensor(rs_out_bf16, rs_in_bf16), rs_bytes),
                "fsdp2_ag": (lambda: fsdp2_ag(shards), ag_bytes),
                # FSDP2's mixed-precision copy-in casts the fp32 shards into the flat bf16 buffer.
                "fsdp2_ag_cast": (lambda: fsdp2_ag([s.to(torch.bfloat16) for s in shards32]), ag_bytes),
                "fsdp2_rs_fp32": (fsdp2_rs, rs_bytes),
            })
        elif size <= 64:
            variants["reference_ag"] = (lambda: reference.all_gather_into_params_(shards, outs, world_size, gn),
                                        ag_bytes)
            variants["reference_rs"] = (lambda: reference.reduce_scatter_params_(
                grads, shard_grads, 1.0 / world_size, False, world_size, gn), rs_bytes)
        rows += _measure(variants, size, reps)
        del outs
    tide.transport.disable(gn)
    return rows


def _rank_multinode(rank, world_size, sizes_mib, reps, one_gpu_per_rank):
    """The multi-node schedule's ops (the group spans the emulated nodes: no arena) and NCCL's flat ones;
    (rows, profile rows of the TIDE variants)."""
    import tide  # noqa: F401
    from tide.meta.layout import GroupLayout

    dev = torch.device("cuda", torch.cuda.current_device())
    gn = dist.group.WORLD.group_name
    rows, profiled = [], []
    for size in sizes_mib:
        params = GroupLayout(group_shapes(size << 20, world_size), [2] * N_PARAMS, world_size).params
        total = sum(p.shard_numel for p in params)
        shards = [torch.randn(p.shard_numel, device=dev).to(torch.bfloat16) for p in params]
        outs = [torch.empty(p.out_numel, device=dev, dtype=torch.bfloat16) for p in params]
        grads = [torch.randn(p.shape, device=dev).to(torch.bfloat16) for p in params]
        shard_grads = [torch.empty((p.shard_rows, 1024), device=dev) for p in params]
        ag_bytes, rs_bytes = world_size * total * 2, sum(g.numel() for g in grads) * 2
        variants = {
            "tide_ag_multinode": (lambda: torch.ops.tide.all_gather_into_params_(shards, outs, world_size, gn),
                                  ag_bytes),
            "tide_rs_multinode": (lambda: torch.ops.tide.reduce_scatter_params_(
                grads, shard_grads, 1.0 / world_size, False, world_size, gn), rs_bytes),
        }
        if one_gpu_per_rank:
            flat_in = torch.randn(total, device=dev).to(torch.bfloat16)
            flat_out = torch.empty(world_size * total, device=dev, dtype=torch.bfloat16)
            rs_in = torch.randn(world_size * total, device=dev).to(torch.bfloat16)
            rs_out = torch.empty(total, device=dev, dtype=torch.bfloat16)
            variants["nccl_ag"] = (lambda: dist.all_gather_into_tensor(flat_out, flat_in), ag_bytes)
            variants["nccl_rs_bf16"] = (lambda: dist.reduce_scatter_tensor(rs_out, rs_in), rs_bytes)
        rows += _measure(variants, size, reps)
        for name in ("tide_ag_multinode", "tide_rs_multinode"):  # every rank calls: they are collectives
            profiled += profile_rows(variants[name][0], name, size)
    from tide.multinode.rails import implementation
    from tide.multinode.settings import agreed as multinode_settings

    agreed = {"pace_bytes": multinode_settings(dist.group.WORLD).pace, "rails": implementation(dist.group.WORLD, dev)}
    return [{**r, **agreed} for r in rows], profiled


def _rank_nccl_ce(rank, world_size, sizes_mib, reps):
    import nccl_ce

    dev = torch.device("cuda", torch.cuda.current_device())
    group = nccl_ce.new_group()
    side = torch.cuda.Stream()
    rows = []
    for size in sizes_mib:
        total = sum(p.shard_numel for p in _layout(size, world_size).params)
        out = nccl_ce.empty(world_size * total, torch.bfloat16, dev)
        out.normal_()
        inp = out[rank * total:(rank + 1) * total]

        def ce(out=out, inp=inp):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                nccl_ce.all_gather(out, inp, group)  # NCCL 2.28 refuses the legacy stream for CE collectives
            torch.cuda.current_stream().wait_stream(side)

        rows += _measure({"nccl_ce_ag": (ce, world_size * total * 2)}, size, reps)
    return rows


def _layout(size: int, world_size: int):
    from tide.meta.layout import GroupLayout

    return GroupLayout(group_shapes(size << 20, world_size), [2] * N_PARAMS, world_size)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=None, help="default: the GPU count if >= 2, else 4")
    p.add_argument("--sizes", default="1,4,16,64,256,1024", help="message sizes in MiB")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--local-world-size", type=int, default=None,
                   help="emulate nodes of this many ranks: the multi-node schedule against NCCL on the same ranks")
    p.add_argument("--out", default=str(default_out()))
    args = p.parse_args(argv)
    require_cuda("collectives.py")
    from tide.launch import CUDA_RANK_ENV, run_ranks

    gpus = torch.cuda.device_count()
    ranks = args.ranks or (gpus if gpus >= 2 else 4)
    one_gpu_per_rank = gpus >= ranks
    backend = "nccl" if one_gpu_per_rank else "gloo"
    sizes = [int(s) for s in args.sizes.split(",")]
    L = args.local_world_size
    if L is not None and not (1 <= L < ranks and ranks % L == 0):
        p.error(f"--local-world-size must divide --ranks ({ranks}) and be smaller, got {L}")
    mode = "one GPU per rank (NVLink)" if one_gpu_per_rank else f"{ranks} ranks sharing {gpus} GPU: NOT NVLink numbers"
    if L is not None:
        env = {**CUDA_RANK_ENV, "LOCAL_WORLD_SIZE": str(L)}
        results = run_ranks(_rank_multinode, ranks, sizes, args.reps, one_gpu_per_rank, backend=backend,
                            device_type="cuda", env=env, timeout=540)
        per_rank = [rows for rows, _ in results]
        mode = f"{ranks // L} nodes x {L} EMULATED on one host ({mode}): not network numbers"
        name = "collectives_multinode"
        write_csv(Path(args.out) / f"{name}_profile.csv", results[0][1])
    else:
        per_rank = run_ranks(_rank_main, ranks, sizes, args.reps, one_gpu_per_rank, backend=backend,
                             device_type="cuda", env=CUDA_RANK_ENV, timeout=540)
        import nccl_ce

        why_not = nccl_ce.available() if one_gpu_per_rank else "ranks share a GPU"
        if why_not is None:
            ce = run_ranks(_rank_nccl_ce, ranks, sizes, args.reps, backend="nccl", device_type="cuda",
                           env=CUDA_RANK_ENV, timeout=300)
            per_rank = [a + b for a, b in zip(per_rank, ce)]
        else:
            print(f"collectives.py: no nccl_ce_ag row: {why_not}")
        name = "collectives"
    meta = run_meta(gpus=gpus, ranks=ranks, backend=backend, mode=mode, local_world_size=L or ranks)
    rows = []
    for i, r in enumerate(per_rank[0]):
        t = max(pr[i]["ms"] for pr in per_rank)
        busbw = r["bytes"] / (t / 1e3) * (ranks - 1) / ranks / 1e9
        rows.append({**r, "ms": t, "busbw_GBps": busbw, "sm_us": max(pr[i]["sm_us"] for pr in per_rank),
                     "host_us": max(pr[i]["host_us"] for pr in per_rank), **meta})
        print(f"{r['variant']:18s} {r['size_mib']:5d} MiB  {t:8.3f} ms  busbw {busbw:8.1f} GB/s  "
              f"SM {rows[-1]['sm_us']:9.1f} us  host {rows[-1]['host_us']:7.1f} us", flush=True)
    out = Path(args.out)
    write_csv(out / f"{name}.csv", rows)
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for variant in dict.fromkeys(r["variant"] for r in rows):
            sel = [r for r in rows if r["variant"] == variant]
            ax = axes[0] if "_ag" in variant else axes[1]
            ax.plot([r["size_mib"] for r in sel], [r["busbw_GBps"] for r in sel], marker="o", label=variant)
        log2_axes(axes, "message size S (MiB)", ["busbw (GB/s)"] * 2, ("all-gather", "reduce-scatter"))
        fig.suptitle(f"{meta['device']} x{gpus}, {mode}, {meta['date']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=120)
    for size in sorted({min(sizes), 16, 256, max(sizes)} & set(sizes)):
        sel = [r for r in rows if r["size_mib"] == size]
        print(f"SUMMARY {name} ({mode}, {size} MiB): " +
              ", ".join(f"{r['variant']} {r['busbw_GBps']:.0f} GB/s {r['ms'] * 1e3:.0f} us SM {r['sm_us']:.0f} us "
                        f"host {r['host_us']:.0f} us" for r in sel))


if __name__ == "__main__":
    main()
