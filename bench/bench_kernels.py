"""Throughput of TIDE-RS's summing kernel vs its CTA count (local HBM, the H200 test machine).

K = 8 bf16 contributions of n = 32 Mi elements each (512 MiB, far beyond the 60 MB L2) are summed in
fp32 into an fp32 shard. Bytes counted: every byte read plus every byte written, i.e. K*2n + 4n
(write) and + 4n more when accumulating (read-modify-write). Times: CUDA events around each launch,
median of --reps after warm-up. Writes bench/results/sum_kernel.csv and .png.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def run(k: int, n: int, ctas_list, reps: int, dtype=torch.bfloat16):
    from tide.transport import build

    ext = build.load()
    base = torch.randn(k * n, device="cuda").to(dtype)  # random data, never zeros
    rows = []
    for accumulate in (True, False):
        out = torch.randn(n, device="cuda")
        nbytes = k * n * base.element_size() + 4 * n * (2 if accumulate else 1)
        for ctas in ctas_list:
            for _ in range(3):
                ext.sum_strided(out, base, k, n * base.element_size(), n, 1.0, accumulate, ctas)
            times = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                ext.sum_strided(out, base, k, n * base.element_size(), n, 1.0, accumulate, ctas)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            t = statistics.median(times)
            rows.append({"k": k, "n": n, "dtype": str(dtype).removeprefix("torch."), "accumulate": accumulate,
                         "ctas": ctas, "seconds": t, "bytes": nbytes, "tb_per_s": nbytes / t / 1e12,
                         "spread": (max(times) - min(times)) / t})
            print(f"K={k} acc={int(accumulate)} ctas={ctas:4d}  {rows[-1]['tb_per_s']:.3f} TB/s  "
                  f"({t * 1e3:.3f} ms, spread {rows[-1]['spread']:.1%})", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--n", type=int, default=32 << 20)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--ctas", default="1,2,4,8,12,16,20,24,32,48,66,132")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    rows = run(args.k, args.n, [int(c) for c in args.ctas.split(",")], args.reps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda}
    with open(out / "sum_kernel.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + list(meta))
        w.writeheader()
        for r in rows:
            w.writerow({**r, **meta})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for acc in (True, False):
            pts = [(r["ctas"], r["tb_per_s"]) for r in rows if r["accumulate"] == acc]
            ax.plot(*zip(*pts), marker="o", label=f"K={args.k} bf16 -> fp32, {'accumulate' if acc else 'write'}")
        ax.axhline(0.45, color="gray", ls="--", label="NVLink ingress ~0.45 TB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("CTAs (512 threads)")
        ax.set_ylabel("TB/s (bytes read + written)")
        ax.set_title(f"TIDE-RS summing kernel, {meta['gpu']}, {meta['date']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "sum_kernel.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no PNG")
    by = {(r["accumulate"], r["ctas"]): r["tb_per_s"] for r in rows}
    print(f"SUMMARY sum_kernel K={args.k}: 8 CTAs {by.get((True, 8), float('nan')):.2f} TB/s, "
          f"16 CTAs {by.get((True, 16), float('nan')):.2f} TB/s (accumulate); "
          f"16 CTAs {by.get((False, 16), float('nan')):.2f} TB/s (write)")
    return rows


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
