"""Overlap across GPUs (``overlap.py --xgpu``): a 32 MiB reduce-scatter back to back beside a one-wave GEMM.

On each of the GPUs (one rank per GPU, NCCL), a bf16 GEMM of 1408 x 32768 x 3072 (132 output tiles of
128 x 256: one wave on an H200's 132 SMs) runs back to back on the compute stream while reduce-scatters
of the collectives bench's 8-parameter group (32 MiB of bf16 gradients per rank) run back to back on a
side stream. Both streams start behind one sleep kernel, so the side stream's work is queued before the
GEMMs start. Variants: ``nccl_rs_bf16`` (NCCL's default kernels), ``nccl_rs_fp32_4ctas`` (fp32, NCCL
capped to 4 CTAs), ``stock_fsdp2_rs_fp32`` (FSDP2's ``chunk_cat`` into fp32 + NCCL fp32) and ``tide_rs``
(TIDE-RS In-Place into fp32 shards). Reported per variant: the GEMM's slowdown, the reduce-scatter's time
alone and beside the GEMM (per call, the slowest rank). Writes ``overlap_xgpu.csv`` and ``.png``.
"""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, require_cuda, run_meta, write_csv  # noqa: E402

RS_MIB = 32
GEMM_MKN = (1408, 32768, 3072)
GATE_CYCLES = 40_000_000  # ~20 ms at H200 clocks: longer than enqueueing the side stream's calls
VARIANTS = ("nccl_rs_bf16", "nccl_rs_fp32_4ctas", "stock_fsdp2_rs_fp32", "tide_rs")


def _per_call_ms(fn, calls: int, stream) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        a.record(stream)
        for _ in range(calls):
            fn()
        b.record(stream)
    b.synchronize()
    return a.elapsed_time(b) / calls


def beside(fn, calls: int, gemm, gemms: int, main, side, line_up=lambda: None) -> tuple[float, float]:
    """``calls`` calls of ``fn`` back to back on ``side`` beside ``gemms`` GEMMs on ``main``, both queued
    behind one sleep kernel: (ms per GEMM, ms per call of ``fn``). ``line_up`` runs before the gate (the
    ranks' barrier)."""
    torch.cuda.synchronize()
    line_up()
    torch.cuda._sleep(GATE_CYCLES)
    gate = main.record_event()
    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    side.wait_event(gate)
    with torch.cuda.stream(side):
        s0.record(side)
        for _ in range(calls):
            fn()
        s1.record(side)
    gemm_ms = _per_call_ms(gemm, gemms, main)
    s1.synchronize()
    return gemm_ms, s0.elapsed_time(s1) / calls


GEMMS = 20  # GEMMs back to back per sample


def one_wave_gemm(dev: torch.device, reps: int):
    """The bench's one-wave bf16 GEMM (``GEMM_MKN``) on ``dev``, warmed up: ``(gemm, main, side, alone)``,
    with the current stream as main, a high-priority side stream, and the median ms per GEMM of
    ``reps`` samples of ``GEMMS`` back to back."""
    M, K, N = GEMM_MKN
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream(priority=-1)
    gemm = lambda: torch.mm(a, b)  # noqa: E731
    for _ in range(3):
        gemm()
    return gemm, main, side, statistics.median(_per_call_ms(gemm, GEMMS, main) for _ in range(reps))


def _capped_group(max_ctas: int):
    opts = dist.ProcessGroupNCCL.Options()
    if hasattr(opts.config, "max_ctas"):
        opts.config.min_ctas = 1
        opts.config.max_ctas = max_ctas
    return dist.new_group(backend="nccl", pg_options=opts)


def _rank(rank, world_size, reps):
    import tide  # noqa: F401
    import tide.transport
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # noqa: F401  (torch.ops.fsdp.*)

    from collectives import group_shapes
    from tide.meta.layout import GroupLayout

    dev = torch.device("cuda", torch.cuda.current_device())
    layout = GroupLayout(group_shapes(RS_MIB << 20, world_size), [2] * 8, world_size)
    grads = [torch.randn(p.shape, device=dev).to(torch.bfloat16) for p in layout.params]
    shard_grads = [torch.empty((p.shard_rows, 1024), device=dev) for p in layout.params]
    total = sum(p.shard_numel for p in layout.params)
    gn = dist.group.WORLD.group_name
    tide.transport.enable(dist.group.WORLD, slot_bytes=0)
    capped = _capped_group(4)
    in_bf16 = torch.randn(world_size * total, device=dev).to(torch.bfloat16)
    out_bf16 = torch.empty(total, device=dev, dtype=torch.bfloat16)
    in32 = torch.empty(world_size * total, device=dev)
    out32 = torch.empty(total, device=dev)
    variants = {
        "nccl_rs_bf16": lambda: dist.reduce_scatter_tensor(out_bf16, in_bf16),
        "nccl_rs_fp32_4ctas": lambda: dist.reduce_scatter_tensor(out32, in32, group=capped),
        "stock_fsdp2_rs_fp32": lambda: (torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=world_size,
                                                                 out=in32.view(world_size, -1)),
                                        dist.reduce_scatter_tensor(out32, in32)),
        "tide_rs": lambda: torch.ops.tide.reduce_scatter_params_(grads, shard_grads, 1.0 / world_size, False,
                                                                 world_size, gn),
    }
    gemm, main, side, gemm_alone = one_wave_gemm(dev, reps)
    if rank == 0:
        print(f"overlap_xgpu: GEMM alone {gemm_alone:.3f} ms", flush=True)
    rows = []
    for name, fn in variants.items():
        if rank == 0:
            print(f"overlap_xgpu: {name}", flush=True)
        for _ in range(3):
            with torch.cuda.stream(side):
                fn()
        torch.cuda.synchronize()
        dist.barrier()
        rs_alone = statistics.median(_per_call_ms(fn, 10, side) for _ in range(reps))
        # Every rank must issue the same number of collectives: agree on the largest count.
        calls = torch.tensor([max(2, math.ceil(1.3 * GEMMS * gemm_alone / rs_alone))], device=dev)
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
        calls = int(calls.item())
        gemm_beside, rs_beside = zip(*(beside(fn, calls, gemm, GEMMS, main, side, line_up=dist.barrier)
                                       for _ in range(reps)))
        rows.append({"variant": name, "gemm_alone_ms": gemm_alone, "gemm_beside_ms": statistics.median(gemm_beside),
                     "rs_ms_alone": rs_alone, "rs_ms_beside": statistics.median(rs_beside), "rs_calls": calls})
    tide.transport.disable(gn)
    return rows


def main(args) -> None:
    require_cuda("overlap.py --xgpu", gpus=2)
    from tide.launch import CUDA_RANK_ENV, run_ranks

    gpus = torch.cuda.device_count()
    per_rank = run_ranks(_rank, gpus, args.reps, backend="nccl", device_type="cuda", env=CUDA_RANK_ENV, timeout=540)
    meta = run_meta(gpus=gpus, ranks=gpus, gemm_mkn="x".join(map(str, GEMM_MKN)), rs_mib=RS_MIB)
    rows = []
    for i, r in enumerate(per_rank[0]):
        worst = {k: max(pr[i][k] for pr in per_rank) for k in ("gemm_beside_ms", "rs_ms_alone", "rs_ms_beside")}
        alone = max(pr[i]["gemm_alone_ms"] for pr in per_rank)
        rows.append({"variant": r["variant"], "gemm_slowdown_pct": 100 * (worst["gemm_beside_ms"] / alone - 1),
                     "rs_ms_alone": worst["rs_ms_alone"], "rs_ms_beside": worst["rs_ms_beside"], "gpus": gpus,
                     "date": meta["date"], "gemm_alone_ms": alone, "gemm_beside_ms": worst["gemm_beside_ms"],
                     "rs_calls": r["rs_calls"], **meta})
        print(f"{r['variant']:22s} GEMM {alone:.3f} -> {worst['gemm_beside_ms']:.3f} ms "
              f"({rows[-1]['gemm_slowdown_pct']:+.1f}%), RS {worst['rs_ms_alone'] * 1e3:.0f} us alone, "
              f"{worst['rs_ms_beside'] * 1e3:.0f} us beside", flush=True)
    out = Path(args.out)
    write_csv(out / "overlap_xgpu.csv", rows)
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        names = [r["variant"] for r in rows]
        axes[0].barh(names, [r["gemm_slowdown_pct"] for r in rows])
        axes[0].axvline(3, color="gray", ls="--", label="3% target")
        axes[0].set_xlabel("one-wave GEMM slowdown (%)")
        axes[0].legend(fontsize=7)
        axes[1].barh([f"{n} alone" for n in names], [r["rs_ms_alone"] * 1e3 for r in rows])
        axes[1].barh([f"{n} beside" for n in names], [r["rs_ms_beside"] * 1e3 for r in rows])
        axes[1].set_xlabel(f"{RS_MIB} MiB reduce-scatter (us)")
        for ax in axes:
            ax.tick_params(axis="y", labelsize=7)
            ax.grid(True, alpha=0.3)
        fig.suptitle(f"Overlap across {gpus} GPUs, {meta['device']}, {meta['date']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "overlap_xgpu.png", dpi=120)
    print("SUMMARY overlap_xgpu: " + ", ".join(
        f"{r['variant']} GEMM {r['gemm_slowdown_pct']:+.1f}% "
        f"RS {r['rs_ms_alone'] * 1e3:.0f}/{r['rs_ms_beside'] * 1e3:.0f} us"
        for r in rows))
