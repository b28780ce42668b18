"""TIDE-RS's summing grid, one CTA per SM (the default) against 16: the evidence its targets ask for.

TIDE-RS's SM time must stay at most a quarter of NCCL bf16's at 256 MiB with busbw at or above it, and it
must slow a one-wave GEMM by <= 3 % while its time beside the GEMM stays <= 1.5x NCCL bf16's time alone. A one-wave GEMM
holds every SM, so a summing grid waits for its wave to end and then delays the next GEMM's CTAs on the SMs it takes:
the shortest burst over every SM delays it least (``sm_room.py``). This script measures both settings of
``TIDE_RS_CTAS`` in one run, alternated ``--rounds`` times so that the machine's drift falls on both:

- the cross-GPU overlap (``overlap.py --xgpu``): the GEMM's slowdown beside TIDE-RS and beside NCCL bf16,
  TIDE-RS's time beside the GEMM over NCCL bf16's time alone;
- the reduce-scatter's busbw and SM time at 256 MiB and 1 GiB, against NCCL bf16's (``collectives.py``).

Each measurement runs in a process of its own (the arena reads ``TIDE_RS_CTAS`` when it is created).
Writes ``rs_ctas.csv`` (one row per setting, round and measurement) and ``rs_ctas.png``.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out, pyplot, require_cuda, run_meta, write_csv  # noqa: E402

HERE = Path(__file__).resolve().parent
RS_VARIANTS = ("tide_rs", "nccl_rs_bf16")


def _measure(script: list[str], ctas: int, csv_name: str) -> list[dict]:
    """Run ``script`` (a bench script and its arguments) with ``TIDE_RS_CTAS=ctas``; its CSV's rows."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "TIDE_RS_CTAS": str(ctas)}
        subprocess.run([sys.executable, str(HERE / script[0]), *script[1:], "--out", out], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        with open(Path(out) / csv_name) as f:
            return list(csv.DictReader(f))


def _overlap_rows(ctas: int, rnd: int, reps: int) -> list[dict]:
    rows = {r["variant"]: r for r in _measure(["overlap.py", "--xgpu", "--reps", str(reps)], ctas, "overlap_xgpu.csv")}
    nccl_alone = float(rows["nccl_rs_bf16"]["rs_ms_alone"])
    return [{"rs_ctas": ctas, "round": rnd, "measure": "overlap", "variant": v, "size_mib": 32,
             "gemm_slowdown_pct": float(rows[v]["gemm_slowdown_pct"]),
             "rs_us_alone": 1e3 * float(rows[v]["rs_ms_alone"]),
             "rs_us_beside": 1e3 * float(rows[v]["rs_ms_beside"]),
             "beside_over_nccl_alone": float(rows[v]["rs_ms_beside"]) / nccl_alone, "busbw_GBps": "", "sm_us": ""}
            for v in RS_VARIANTS]


def _collective_rows(ctas: int, rnd: int, sizes: str) -> list[dict]:
    return [{"rs_ctas": ctas, "round": rnd, "measure": "collectives", "variant": r["variant"],
             "size_mib": int(r["size_mib"]), "gemm_slowdown_pct": "", "rs_us_alone": 1e3 * float(r["ms"]),
             "rs_us_beside": "", "beside_over_nccl_alone": "", "busbw_GBps": float(r["busbw_GBps"]),
             "sm_us": float(r["sm_us"])}
            for r in _measure(["collectives.py", "--sizes", sizes, "--reps", "5"], ctas, "collectives.csv")
            if r["variant"] in RS_VARIANTS]


def _plot(rows: list[dict], settings: list[int], out: Path, meta: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    tide = [r for r in rows if r["variant"] == "tide_rs"]
    nccl = [r for r in rows if r["variant"] == "nccl_rs_bf16"]
    for c in settings:
        ov = [r for r in tide if r["rs_ctas"] == c and r["measure"] == "overlap"]
        axes[0].plot([r["round"] for r in ov], [r["gemm_slowdown_pct"] for r in ov], "o-", label=f"TIDE-RS, {c} CTAs")
        axes[1].plot([r["round"] for r in ov], [r["beside_over_nccl_alone"] for r in ov], "o-",
                     label=f"TIDE-RS, {c} CTAs")
        co = [r for r in tide if r["rs_ctas"] == c and r["measure"] == "collectives"]
        axes[2].plot([f"{r['size_mib']} MiB r{r['round']}" for r in co], [r["busbw_GBps"] for r in co], "o",
                     label=f"TIDE-RS, {c} CTAs")
    ov = [r for r in nccl if r["measure"] == "overlap"]
    axes[0].plot([r["round"] for r in ov], [r["gemm_slowdown_pct"] for r in ov], "x", color="gray", label="NCCL bf16")
    co = [r for r in nccl if r["measure"] == "collectives"]
    axes[2].plot([f"{r['size_mib']} MiB r{r['round']}" for r in co], [r["busbw_GBps"] for r in co], "x", color="gray",
                 label="NCCL bf16")
    axes[0].axhline(3, color="gray", ls="--", lw=0.8)
    axes[1].axhline(1.5, color="gray", ls="--", lw=0.8)
    labels = (("round", "one-wave GEMM slowdown (%), target <= 3"),
              ("round", "TIDE-RS beside / NCCL bf16 alone, target <= 1.5"), ("", "reduce-scatter busbw (GB/s)"))
    for ax, (x, y) in zip(axes, labels):
        ax.set_xlabel(x)
        ax.set_ylabel(y, fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[:2]:
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    axes[2].tick_params(axis="x", labelsize=6, rotation=45)
    fig.suptitle(f"TIDE-RS summing grid, {meta['device']} x{meta['gpus']}, {meta['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "rs_ctas.png", dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default=None,
                   help="TIDE_RS_CTAS values, comma-separated (default: 16 and the SM count)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=10, help="overlap repetitions per measurement")
    p.add_argument("--sizes", default="256,1024", help="reduce-scatter sizes in MiB")
    p.add_argument("--out", default=str(default_out()))
    args = p.parse_args(argv)
    require_cuda("rs_ctas.py", gpus=2)
    settings = [int(s) for s in (args.settings or f"16,{torch.cuda.get_device_properties(0).multi_processor_count}")
                .split(",")]
    if args.rounds < 1 or any(c < 1 for c in settings):
        p.error("--rounds and every --settings value must be >= 1")
    rows = []
    for rnd in range(1, args.rounds + 1):
        for c in settings:
            overlap = _overlap_rows(c, rnd, args.reps)
            rows += overlap + _collective_rows(c, rnd, args.sizes)
            print(f"round {rnd}/{args.rounds}, {c} CTAs: GEMM {overlap[0]['gemm_slowdown_pct']:+.1f}% beside TIDE-RS, "
                  f"{overlap[1]['gemm_slowdown_pct']:+.1f}% beside NCCL bf16", flush=True)
    meta = run_meta(gpus=torch.cuda.device_count())
    rows = [{**r, **meta} for r in rows]
    out = Path(args.out)
    write_csv(out / "rs_ctas.csv", rows)
    _plot(rows, settings, out, meta)
    for c in settings:
        ov = [r for r in rows if r["rs_ctas"] == c and r["variant"] == "tide_rs" and r["measure"] == "overlap"]
        co = [r for r in rows if r["rs_ctas"] == c and r["variant"] == "tide_rs" and r["measure"] == "collectives"]
        print(f"SUMMARY rs_ctas {c} CTAs: GEMM " + "/".join(f"{r['gemm_slowdown_pct']:+.1f}%" for r in ov) +
              ", beside/NCCL alone " + "/".join(f"{r['beside_over_nccl_alone']:.2f}x" for r in ov) + ", " +
              ", ".join(f"{r['size_mib']} MiB {r['busbw_GBps']:.0f} GB/s SM {r['sm_us']:.0f} us" for r in co))
    nccl = [r for r in rows if r["variant"] == "nccl_rs_bf16"]
    print("SUMMARY rs_ctas NCCL bf16: GEMM " + "/".join(f"{r['gemm_slowdown_pct']:+.1f}%" for r in nccl
                                                          if r["measure"] == "overlap") + ", " +
          ", ".join(f"{r['size_mib']} MiB {r['busbw_GBps']:.0f} GB/s" for r in nccl if r["measure"] == "collectives"))


if __name__ == "__main__":
    main()
