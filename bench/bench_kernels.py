"""Throughput of TIDE's two kernels on one GPU (local HBM): the TIDE-RS summing kernel against its CTA
count, and the TIDE-AG own-shard cast.

Summing kernel: K = 8 (and 2: TIDE-RS at W = 2) bf16 contributions of n = 32 Mi elements each (far beyond
the 60 MB L2) summed in fp32 into an fp32 shard, on 1 to 132 CTAs. Bytes counted: every byte read plus every byte
written, K*2n + 4n (+ 4n more when accumulating, a read-modify-write).

Cast kernel: ``--cast-mib`` MiB of output (default 128) cast from fp32 to bf16 and copied bf16 to bf16
on the grid the transport gives it (4 CTAs per SM at most), against torch's own ``copy_`` of the same
tensors; bytes read + written. Times: CUDA events around each launch, median of ``--reps`` after
warm-up; random data, never zeros. Writes ``kernels.csv`` and ``kernels.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_ms, pyplot, require_cuda, run_meta, write_csv, default_out  # noqa: E402

CAST_CTAS_PER_SM = 4  # tide.transport.arena.CAST_CTAS_PER_SM


def _median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    return statistics.median(cuda_ms(fn) for _ in range(reps))


def sum_rows(ext, k: int, n: int, ctas_list, reps: int) -> list[dict]:
    base = torch.randn(k * n, device="cuda").to(torch.bfloat16)
    rows = []
    for accumulate in (True, False):
        out = torch.randn(n, device="cuda")
        nbytes = k * n * 2 + 4 * n * (2 if accumulate else 1)
        for ctas in ctas_list:
            ms = _median_ms(lambda: ext.sum_rows(outs=[out], rows=base.view(k, n), owns=[], own_row=-1, scale=1.0,
                                                 accumulate=accumulate, ctas=ctas), reps)
            rows.append({"kernel": "sum_contributions",
                         "case": f"K={k} bf16->fp32 {'accumulate' if accumulate else 'write'}",
                         "ctas": ctas, "bytes": nbytes, "ms": ms, "tb_per_s": nbytes / (ms * 1e-3) / 1e12})
            print(f"sum  {rows[-1]['case']:28s} ctas={ctas:4d}  {rows[-1]['tb_per_s']:.3f} TB/s", flush=True)
    return rows


def cast_rows(ext, out_mib: int, reps: int) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = (out_mib << 20) // 2  # bf16 output elements
    rows = []
    for src_dtype in (torch.float32, torch.bfloat16):
        src = torch.randn(n, device="cuda").to(src_dtype)
        dst = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        nbytes = n * (src.element_size() + 2)
        for impl, fn in (("tide_cast", lambda: ext.cast_into(dst=dst, src=src, max_ctas=CAST_CTAS_PER_SM * sms)),
                         ("torch_copy_", lambda: dst.copy_(src))):
            ms = _median_ms(fn, reps)
            name = f"{str(src_dtype).removeprefix('torch.')}->bf16 {out_mib} MiB out"
            rows.append({"kernel": impl, "case": name, "ctas": CAST_CTAS_PER_SM * sms if impl == "tide_cast" else 0,
                         "bytes": nbytes, "ms": ms, "tb_per_s": nbytes / (ms * 1e-3) / 1e12})
            print(f"cast {impl:12s} {name:28s} {rows[-1]['tb_per_s']:.3f} TB/s ({ms * 1e3:.1f} us)", flush=True)
        if not torch.equal(dst.view(torch.int16), src.to(torch.bfloat16).view(torch.int16)):
            raise AssertionError(f"bench_kernels: the cast of {src_dtype} differs from torch's")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", default="8,2", help="contribution counts, comma-separated")
    p.add_argument("--n", type=int, default=32 << 20)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--ctas", default="1,2,4,8,12,16,20,24,32,48,66,132")
    p.add_argument("--cast-mib", type=int, default=128)
    p.add_argument("--out", default=str(default_out()))
    args = p.parse_args(argv)
    require_cuda("bench_kernels.py")
    from tide import extension

    ext = extension.load()
    rows = [r for k in args.k.split(",") for r in sum_rows(ext, int(k), args.n, [int(c) for c in args.ctas.split(",")],
                                                           args.reps)]
    rows += cast_rows(ext, args.cast_mib, args.reps)
    meta = run_meta(gpus=torch.cuda.device_count())
    out = Path(args.out)
    write_csv(out / "kernels.csv", [{**r, **meta} for r in rows])
    plt = pyplot()
    if plt is not None:
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
        for case in dict.fromkeys(r["case"] for r in rows if r["kernel"] == "sum_contributions"):
            pts = [(r["ctas"], r["tb_per_s"]) for r in rows if r["case"] == case]
            ax.plot(*zip(*pts), marker="o", label=case)
        ax.axhline(0.45, color="gray", ls="--", label="NVLink ingress ~0.45 TB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("CTAs (512 threads)")
        ax.set_ylabel("TB/s (bytes read + written)")
        ax.set_title("TIDE-RS summing kernel")
        ax.legend(fontsize=7)
        cast = [r for r in rows if r["kernel"] != "sum_contributions"]
        bx.barh([f"{r['kernel']} {r['case']}" for r in cast], [r["tb_per_s"] for r in cast])
        bx.axvline(2.5, color="gray", ls="--", label="target 2.5 TB/s")
        bx.set_xlabel("TB/s (bytes read + written)")
        bx.set_title("TIDE-AG own-shard cast")
        bx.legend(fontsize=7)
        bx.tick_params(axis="y", labelsize=7)
        for a in (ax, bx):
            a.grid(True, alpha=0.3)
        fig.suptitle(f"{meta['device']}, torch {meta['torch']}, {meta['date']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "kernels.png", dpi=120)
    by = {(r["kernel"], r["case"], r["ctas"]): r["tb_per_s"] for r in rows}
    acc = "K=8 bf16->fp32 accumulate"
    w2 = "K=2 bf16->fp32 write"
    casts = ", ".join(f"{r['kernel']} {r['case']} {r['tb_per_s']:.2f} TB/s" for r in rows
                      if r["kernel"] != "sum_contributions")
    print(f"SUMMARY kernels: sum 8 CTAs {by.get(('sum_contributions', acc, 8), float('nan')):.2f} TB/s, "
          f"16 CTAs {by.get(('sum_contributions', acc, 16), float('nan')):.2f} TB/s (accumulate); K=2 16 CTAs "
          f"{by.get(('sum_contributions', w2, 16), float('nan')):.2f} TB/s (write); {casts}")
    return rows


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
