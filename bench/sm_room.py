"""Is there room on an SM beside a one-wave GEMM? A summing grid's shape against the GEMM's wave.

The cross-GPU overlap target asks TIDE-RS to slow a one-wave GEMM by <= 3 % while
taking <= 1.5x NCCL's time alone. A summing CTA that cannot be resident beside a GEMM CTA either waits
for the wave to end (its time beside grows by up to a GEMM) or, once resident, pushes GEMM tiles into a
second wave. A CTA small enough to fit in what the GEMM's CTA leaves of an SM (registers, threads,
shared memory) may do neither. This probe runs the sum TIDE-RS does at 32 MiB on 2 ranks (two 16 MiB
bf16 sources into fp32) with grids of several shapes (threads per CTA, register cap, CTAs) on one GPU
beside the overlap bench's GEMM (``overlap_xgpu.GEMM_MKN``), and reports for each shape: its time alone;
its time per call back to back beside 20 GEMMs (the overlap bench's method, whose calls outlast the
GEMMs); one call issued at a random point of a GEMM, to its end (about its time alone when it fits
beside the GEMM's CTAs, about one GEMM more when it waits for them); and the GEMM's slowdown. Its
answers: docs/performance.md, "SM room beside a one-wave GEMM". Writes ``sm_room.csv`` and ``.png``.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out, pyplot, require_cuda, run_meta, write_csv  # noqa: E402
from overlap_xgpu import GATE_CYCLES, GEMM_MKN, GEMMS, _per_call_ms, beside, one_wave_gemm  # noqa: E402

ELEMENTS = 8 << 20  # 16 MiB of bf16 per source: one rank's shard of a 32 MiB reduce-scatter on 2 ranks
# (threads per CTA, register cap, vectors per source in flight per thread, CTAs): today's TIDE-RS grid
# first, then grids of one small CTA per SM.
SHAPES = ((512, 128, 8, 16), (32, 32, 1, 132), (32, 32, 2, 132), (32, 32, 2, 264), (64, 32, 2, 132), (128, 32, 2, 132),
          (32, 64, 8, 132), (64, 64, 8, 132), (128, 64, 8, 132), (256, 64, 8, 132))

KERNEL = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

// out[i] = float(a[i]) + float(b[i]), four bf16 per source per vector, U vectors per source in flight.
template <int T, int R, int U>
__global__ void __launch_bounds__(T) __maxnreg__(R)
sum2(const uint2* __restrict__ a, const uint2* __restrict__ b, float4* __restrict__ out, int64_t n) {
  const int64_t nt = static_cast<int64_t>(gridDim.x) * T;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * T + threadIdx.x; base < n; base += nt * U) {
    uint2 va[U], vb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + u * nt;
      if (i < n) { va[u] = __ldcs(a + i); vb[u] = __ldcs(b + i); }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + u * nt;
      if (i >= n) continue;
      float4 r;
      r.x = __uint_as_float(va[u].x << 16) + __uint_as_float(vb[u].x << 16);
      r.y = __uint_as_float(va[u].x & 0xffff0000u) + __uint_as_float(vb[u].x & 0xffff0000u);
      r.z = __uint_as_float(va[u].y << 16) + __uint_as_float(vb[u].y << 16);
      r.w = __uint_as_float(va[u].y & 0xffff0000u) + __uint_as_float(vb[u].y & 0xffff0000u);
      __stcs(out + i, r);
    }
  }
}

template <int T, int R, int U>
std::vector<int64_t> run(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& out, int64_t ctas,
                         bool launch) {
  auto* k = sum2<T, R, U>;
  if (launch) {
    k<<<ctas, T, 0, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const uint2*>(a.data_ptr()), reinterpret_cast<const uint2*>(b.data_ptr()),
        reinterpret_cast<float4*>(out.data_ptr()), a.numel() / 4);
    return {};
  }
  cudaFuncAttributes attr;
  cudaFuncGetAttributes(&attr, k);
  return {attr.numRegs, static_cast<int64_t>(attr.localSizeBytes)};
}

// launch=false: the kernel's (registers, local bytes) instead of a launch.
std::vector<int64_t> sum2_shape(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& out,
                                int64_t threads, int64_t regs, int64_t unroll, int64_t ctas, bool launch) {
#define SHAPE(T, R, U) if (threads == T && regs == R && unroll == U) return run<T, R, U>(a, b, out, ctas, launch);
  SHAPE(512, 128, 8) SHAPE(32, 32, 1) SHAPE(32, 32, 2) SHAPE(64, 32, 2) SHAPE(128, 32, 2)
  SHAPE(32, 64, 8) SHAPE(64, 64, 8) SHAPE(128, 64, 8) SHAPE(256, 64, 8)
#undef SHAPE
  TORCH_CHECK(false, "sm_room: no kernel for threads=", threads, " regs=", regs, " unroll=", unroll);
}
"""


def _latency_mid_gemm(fn, gemm, main_stream, side, rng) -> float:
    """Milliseconds from issuing one call of ``fn`` at a random point of a GEMM (back to back with others)
    to its end: about its time alone if its CTAs fit beside the GEMM's, plus the rest of the GEMM if not."""
    torch.cuda.synchronize()
    torch.cuda._sleep(GATE_CYCLES)
    ends = []
    for _ in range(6):
        gemm()
        ends.append(main_stream.record_event())
    while not ends[1].query():
        pass
    until = time.perf_counter() + rng.uniform(0, 300e-6)
    while time.perf_counter() < until:
        pass
    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        s0.record(side)
        fn()
        s1.record(side)
    torch.cuda.synchronize()
    return s0.elapsed_time(s1)


def _gemm_kernel_name(gemm) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gemm()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return names[0] if names else "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=str(default_out()))
    args = p.parse_args()
    require_cuda("sm_room.py")
    from torch.utils.cpp_extension import load_inline

    declaration = ("std::vector<int64_t> sum2_shape(const torch::Tensor& a, const torch::Tensor& b, "
                   "torch::Tensor& out, int64_t threads, int64_t regs, int64_t unroll, int64_t ctas, bool launch);")
    ext = load_inline("tide_sm_room", cpp_sources=declaration, cuda_sources=KERNEL, functions=["sum2_shape"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)
    dev = torch.device("cuda", 0)
    a = torch.randn(ELEMENTS, device=dev).to(torch.bfloat16)
    b = torch.randn(ELEMENTS, device=dev).to(torch.bfloat16)
    out = torch.empty(ELEMENTS, device=dev)
    expect = a.float() + b.float()
    M, K, N = GEMM_MKN
    gemm, main_stream, side, gemm_alone = one_wave_gemm(dev, args.reps)
    gemm_name = _gemm_kernel_name(gemm)
    print(f"sm_room: GEMM {M}x{K}x{N} alone {gemm_alone * 1e3:.0f} us: {gemm_name}", flush=True)
    meta = run_meta(gpus=1, gemm_mkn="x".join(map(str, GEMM_MKN)), gemm_kernel=gemm_name)
    rng = random.Random(0)
    rows = []
    for threads, regs, unroll, ctas in SHAPES:
        used_regs, local_bytes = ext.sum2_shape(a, b, out, threads, regs, unroll, ctas, False)
        fn = lambda: ext.sum2_shape(a, b, out, threads, regs, unroll, ctas, True)  # noqa: E731
        out.fill_(float("nan"))
        with torch.cuda.stream(side):
            fn()
        side.synchronize()
        if not torch.equal(out, expect):
            raise SystemExit(f"sm_room: the {threads}x{ctas} grid summed wrongly")
        alone = statistics.median(_per_call_ms(fn, 20, side) for _ in range(args.reps))
        latency = statistics.median(_latency_mid_gemm(fn, gemm, main_stream, side, rng) for _ in range(20))
        calls = max(2, int(1.3 * GEMMS * gemm_alone / alone))
        gemm_beside, sum_beside = zip(*(beside(fn, calls, gemm, GEMMS, main_stream, side) for _ in range(args.reps)))
        row = {"threads": threads, "reg_cap": regs, "regs": used_regs, "local_bytes": local_bytes, "unroll": unroll,
               "ctas": ctas, "sum_us_alone": alone * 1e3, "sum_us_beside": statistics.median(sum_beside) * 1e3,
               "sum_us_mid_gemm": latency * 1e3,
               "gemm_slowdown_pct": 100 * (statistics.median(gemm_beside) / gemm_alone - 1),
               "gemm_us_alone": gemm_alone * 1e3, **meta}
        rows.append(row)
        print(f"{threads:4d} threads x {ctas:3d} CTAs, {used_regs} regs ({local_bytes} B local): sum "
              f"{row['sum_us_alone']:.0f} us alone, {row['sum_us_beside']:.0f} back to back beside, "
              f"{row['sum_us_mid_gemm']:.0f} issued mid-GEMM; GEMM "
              f"{row['gemm_slowdown_pct']:+.1f}%", flush=True)
    out_dir = Path(args.out)
    write_csv(out_dir / "sm_room.csv", rows)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.8))
        for r in rows:
            ax.scatter(r["gemm_slowdown_pct"], r["sum_us_mid_gemm"])
            ax.annotate(f"{r['threads']}x{r['ctas']} r{r['regs']}", (r["gemm_slowdown_pct"], r["sum_us_mid_gemm"]),
                        fontsize=7)
        ax.set_xlabel("one-wave GEMM slowdown (%)")
        ax.set_ylabel("one sum issued mid-GEMM, to its end (us)")
        ax.grid(True, alpha=0.3)
        ax.set_title(f"Summing grids beside a one-wave GEMM, {meta['device']}, {meta['date']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out_dir / "sm_room.png", dpi=120)
    print("SUMMARY sm_room: " + ", ".join(
        f"{r['threads']}x{r['ctas']} {r['sum_us_alone']:.0f}/{r['sum_us_beside']:.0f}/{r['sum_us_mid_gemm']:.0f} us "
        f"GEMM {r['gemm_slowdown_pct']:+.1f}%"
        for r in rows))


if __name__ == "__main__":
    main()
