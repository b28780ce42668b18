"""Operator overlap test (one GPU): how much a concurrent reduction slows a GEMM, per reduction grid.

The preprint's operator-level experiment, reproduced on one GPU without a network. Foreground: a bf16
GEMM whose tile count fits one wave of the SMs (and a multi-wave GEMM), or a memory-bound background
kernel. Concurrently, on a second stream: the reduction of a 32 MiB reduce-scatter's data (W = 8 bf16
contributions of 4 MiB summed in fp32 into a 8 MiB fp32 shard) by TIDE-RS's summing kernel on a grid of
G CTAs, in one of two modes that span the whole foreground run:

- ``resident``: one long launch, its CTAs on their SMs from start to end, the way an SM-based NCCL
  reduce-scatter stays resident while the network delivers its data (G = all SMs: a default NCCL
  reduce-scatter; G = 4: NCCL capped at 4 CTAs);
- ``chunked``: short launches back to back, one per 4 MiB chunk (8 x 512 KiB contributions), the way
  TIDE-RS launches its bounded grid only when a chunk has landed by copy engine (G = 8/16/20).

Both modes are run for every G. Not included: network time (the preprint's 6.75 ms RS is dominated by
it) and NCCL's own kernels; reductions here read local HBM only. ``--xgpu`` runs the cross-GPU
experiment instead (``bench/overlap_xgpu.py``: real reduce-scatters over NVLink beside the GEMM). Reported per
(foreground, mode, G): foreground median time alone and concurrent (slowdown %), and the time of one 32 MiB reduction.
Writes under ``--out`` (default bench/out/): overlap.csv and .png.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_ms, default_out, log2_axes, pyplot, require_cuda, run_meta, write_csv  # noqa: E402

RS_BYTES = 32 << 20
GATE_CYCLES = 20_000_000  # ~10 ms at H200 clocks: longer than enqueueing the side stream's launches
CONTRIBUTORS = 8


def one_wave_gemm_shape(sms: int) -> tuple[int, int, int]:
    """M = N with at most ``sms`` 128x128 output tiles (so at most one wave for any cuBLAS tile of
    128x128 or larger), K long enough for ~1 ms."""
    tiles = math.isqrt(sms)
    return tiles * 128, tiles * 128, 1 << 17


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--grids", default="all,4,8,16,20")
    p.add_argument("--xgpu", action="store_true", help="the cross-GPU experiment (bench/overlap_xgpu.py)")
    p.add_argument("--out", default=str(default_out()))
    args = p.parse_args(argv)
    if args.xgpu:
        import overlap_xgpu

        overlap_xgpu.main(args)
        return
    require_cuda("overlap.py")

    from tide import extension

    ext = extension.load()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grids = [sms if g == "all" else int(g) for g in args.grids.split(",")]

    n = RS_BYTES // 2 // CONTRIBUTORS  # bf16 elements per contribution of one 32 MiB reduce-scatter
    chunk_n = n // 8
    big_n = 64 << 20  # resident mode: up to 8 x 128 MiB of contributions per launch
    staging = torch.randn(CONTRIBUTORS * big_n, device=dev).to(torch.bfloat16)
    shard = torch.randn(big_n, device=dev)

    def reduce(ctas, elems):
        ext.sum_rows([shard[:elems]], staging.view(CONTRIBUTORS, big_n)[:, :elems], [], -1, 0.125, False, ctas)

    M, N, K = one_wave_gemm_shape(sms)
    a1, b1 = torch.randn(M, K, device=dev, dtype=torch.bfloat16), torch.randn(K, N, device=dev, dtype=torch.bfloat16)
    a2, b2 = (torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) for _ in range(2))
    big = torch.randn(1 << 28, device=dev)  # 1 GiB fp32: memory-bound background
    big_out = torch.empty_like(big)
    foregrounds = {
        f"gemm_one_wave_{M}x{N}x{K}": lambda: torch.mm(a1, b1),
        "gemm_multi_wave_8192^3": lambda: torch.mm(a2, b2),
        "memory_bound_1GiB_scale": lambda: torch.mul(big, 1.5, out=big_out),
    }
    main_stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
    alone = {}
    for name, fg in foregrounds.items():
        for _ in range(2):
            fg()
        alone[name] = statistics.median(cuda_ms(fg, main_stream) for _ in range(args.reps))
    rows = []
    for g in grids:
        for _ in range(3):
            reduce(g, n)
        rs_alone = statistics.median(cuda_ms(lambda: reduce(g, n), main_stream) for _ in range(args.reps))
        for name, fg in foregrounds.items():
            for mode in ("resident", "chunked"):
                # launches and elements per launch so the side stream outlasts the foreground by ~1.5x
                if mode == "resident":
                    elems = min(big_n, max(n, int(1.5 * alone[name] / rs_alone * n)))
                    launches = max(1, math.ceil(1.5 * alone[name] / (rs_alone * elems / n)))
                else:
                    elems = chunk_n
                    launches = max(2, math.ceil(1.5 * alone[name] / (rs_alone / 8)))
                fg_times, rs_times = [], []
                for _ in range(args.reps):
                    torch.cuda.synchronize()
                    # Gate: both streams start after one short sleep kernel, so the side stream's
                    # launches are all queued (host enqueue is slower than a chunk's reduction) before
                    # the foreground starts beside them.
                    torch.cuda._sleep(GATE_CYCLES)
                    gate = main_stream.record_event()
                    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    with torch.cuda.stream(side):
                        side.wait_event(gate)
                        s0.record(side)
                        for _ in range(launches):
                            reduce(g, elems)
                        s1.record(side)
                    fg_times.append(cuda_ms(fg, main_stream))
                    s1.synchronize()
                    rs_times.append(s0.elapsed_time(s1) * n / (launches * elems))  # ms per 32 MiB reduced
                conc = statistics.median(fg_times)
                rows.append({
                    "foreground": name, "mode": mode, "ctas": g, "grid": "all SMs" if g == sms else str(g),
                    "fg_alone_ms": alone[name], "fg_concurrent_ms": conc,
                    "slowdown_pct": 100 * (conc / alone[name] - 1),
                    "rs32_alone_ms": rs_alone, "rs32_concurrent_ms": statistics.median(rs_times),
                    "launches": launches, "elems_per_launch": elems,
                })
                r = rows[-1]
                print(f"{name:30s} {mode:8s} G={g:3d}: fg {alone[name]:7.3f} -> {conc:7.3f} ms "
                      f"({r['slowdown_pct']:+6.1f}%), 32 MiB reduction {rs_alone * 1e3:6.1f} us alone, "
                      f"{r['rs32_concurrent_ms'] * 1e3:6.1f} us concurrent", flush=True)

    out = Path(args.out)
    meta = run_meta()
    write_csv(out / "overlap.csv", [{**r, **meta} for r in rows])
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in foregrounds:
        for mode, ls in (("resident", "-"), ("chunked", "--")):
            sel = [r for r in rows if r["foreground"] == name and r["mode"] == mode]
            label = f"{name.split('_')[0]}-{'_'.join(name.split('_')[1:3])} {mode}"
            axes[0].plot([r["ctas"] for r in sel], [r["slowdown_pct"] for r in sel], ls=ls, marker="o", label=label)
            axes[1].plot([r["ctas"] for r in sel], [r["rs32_concurrent_ms"] * 1e3 for r in sel], ls=ls, marker="o",
                         label=label)
    axes[0].axhline(3, color="gray", ls=":", label="3% target")
    log2_axes(axes, "reduction grid (CTAs)", ("foreground slowdown (%)", "32 MiB reduction while concurrent (us)"),
              legend_size=6)
    fig.suptitle(f"Operator overlap, {meta['device']}, {meta['date']} (local reduction, no network)")
    fig.tight_layout()
    fig.savefig(out / "overlap.png", dpi=120)
    one_wave = [r for r in rows if r["foreground"].startswith("gemm_one_wave")]
    print("SUMMARY overlap one-wave GEMM slowdown: " +
          ", ".join(f"{r['mode']} G={r['grid']} {r['slowdown_pct']:+.1f}% ({r['rs32_concurrent_ms'] * 1e3:.0f} us/RS)"
                    for r in one_wave))


if __name__ == "__main__":
    main()
