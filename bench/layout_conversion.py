"""Layout-conversion cost that TIDE removes, on real decoder-layer shapes (one GPU, no communication).

Stock FSDP2, per unshard: foreach cast of the fp32 shards into a flat bf16 buffer, then
``fsdp.all_gather_copy_in`` (pack into this rank's block of the rank-major output), then after the
collective ``fsdp.split_with_sizes_copy`` (copy every rank's block out per parameter). Per reduce:
``fsdp.chunk_cat`` of the bf16 grads into a padded fp32 rank-major buffer. TIDE keeps only the cast,
done straight into each parameter's final rows. Each op is FSDP2's own, timed with CUDA events on the
buffers one rank of a W-rank group holds.

Per step = layers x (2 unshards: forward, and backward re-gather with reshard_after_forward=True,
+ 1 reduce). Writes under ``--out`` (default bench/out/): layout_conversion.csv and .png.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (registers torch.ops.fsdp.*)

from common import cuda_ms, default_out, pyplot, run_meta, write_csv
from model_shapes import MODELS, shrink

from tide.meta.layout import GroupLayout


def timed(fn, reps: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after 3 warm-ups."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        return statistics.median(cuda_ms(fn) for _ in range(reps))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(shapes, world_size: int, rank: int, reps: int, device: torch.device) -> dict[str, float]:
    layout = GroupLayout(shapes, [2] * len(shapes), world_size, grad_itemsizes=[2] * len(shapes))
    numels = [p.shard_numel for p in layout.params]
    total = sum(numels)
    shards = [torch.randn(n, device=device) for n in numels]                    # fp32 padded shards
    flat_cast = torch.empty(total, device=device, dtype=torch.bfloat16)
    cast_views = list(torch.split(flat_cast, numels))
    ag_out = torch.empty(world_size * total, device=device, dtype=torch.bfloat16)
    outs = [torch.empty(p.out_numel, device=device, dtype=torch.bfloat16) for p in layout.params]
    grads = [torch.randn(p.shape, device=device, dtype=torch.bfloat16) for p in layout.params]
    rs_in = torch.empty(world_size * total, device=device, dtype=torch.float32)
    own_rows = [o[rank * n:(rank + 1) * n] for o, n in zip(outs, numels)]

    ms = {
        "cast": timed(lambda: torch._foreach_copy_(cast_views, shards), reps, device),
        "all_gather_copy_in": timed(lambda: torch.ops.fsdp.all_gather_copy_in(
            cast_views, ag_out, numels, total, rank), reps, device),
        "split_with_sizes_copy": timed(lambda: torch.ops.fsdp.split_with_sizes_copy(
            ag_out.view(world_size, -1), numels, dim=1, out=[o.view(world_size, -1) for o in outs]), reps, device),
        "chunk_cat": timed(lambda: torch.ops.fsdp.chunk_cat(
            grads, dim=0, num_chunks=world_size, out=rs_in.view(world_size, -1)), reps, device),
        "tide_own_shard_cast": timed(lambda: torch._foreach_copy_(own_rows, shards), reps, device),
    }
    nbytes = layout.layout_conversion_bytes(shard_itemsizes=[4] * len(shapes))
    return {"ms": ms, "bytes": nbytes, "unsharded_bytes": layout.unsharded_bytes()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[8, 16, 64])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shrink", type=int, default=1, help="divide every dim (CPU smoke runs)")
    ap.add_argument("--out", type=Path, default=default_out(), help="output folder")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for model in args.models:
        shapes, layers = MODELS[model]
        shapes = shrink(shapes, args.shrink)
        for W in args.world_sizes:
            r = measure(shapes, W, rank=1 % W, reps=args.reps, device=device)
            ms, b = r["ms"], r["bytes"]
            unshard_removed = ms["all_gather_copy_in"] + ms["split_with_sizes_copy"]
            per_layer = 2 * unshard_removed + ms["chunk_cat"]
            row = {
                "model": model, "world_size": W, "layers": layers,
                "unsharded_MiB": r["unsharded_bytes"] / 2**20,
                **{f"{k}_ms": v for k, v in ms.items()},
                "removed_MiB_per_layer": (2 * (b["all_gather_copy_in"] + b["split_with_sizes_copy"])
                                          + b["chunk_cat"]) / 2**20,
                "removed_ms_per_layer": per_layer,
                "removed_ms_per_step": per_layer * layers,
            }
            rows.append(row)
            print(f"{model:14s} W={W:3d}  copy_in {ms['all_gather_copy_in']:7.3f} ms  copy_out "
                  f"{ms['split_with_sizes_copy']:7.3f} ms  chunk_cat {ms['chunk_cat']:7.3f} ms  "
                  f"(cast {ms['cast']:6.3f} / TIDE cast {ms['tide_own_shard_cast']:6.3f})  "
                  f"removed {per_layer:7.3f} ms/layer, {per_layer * layers:8.1f} ms/step", flush=True)
    dest = args.out / "layout_conversion"
    meta = run_meta(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    rows = [{**r, **meta} for r in rows]
    write_csv(dest.with_suffix(".csv"), rows)
    plot(rows, dest.with_suffix(".png"), meta["device"])
    print(f"wrote {dest.with_suffix('.csv')} and .png")
    big = [r for r in rows if r["world_size"] == max(args.world_sizes)]
    print("SUMMARY layout_conversion (removed per step, W=%d): " % max(args.world_sizes) +
          ", ".join(f"{r['model']} {r['removed_ms_per_step']:.1f} ms "
                    f"({r['removed_MiB_per_layer'] * r['layers'] / 1024:.1f} GiB)"
                    for r in big))
    return 0


def plot(rows, path: Path, device: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        sel = [r for r in rows if r["model"] == model]
        x = range(len(sel))
        bottom = [0.0] * len(sel)
        for key, label in (("all_gather_copy_in_ms", "copy-in x2"), ("split_with_sizes_copy_ms", "copy-out x2"),
                           ("chunk_cat_ms", "chunk_cat fp32")):
            mult = 1 if key == "chunk_cat_ms" else 2
            vals = [r[key] * mult * r["layers"] for r in sel]
            ax.bar(x, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(list(x), [f"W={r['world_size']}" for r in sel])
        ax.set_title(f"{model}: stock conversion per step")
        ax.set_ylabel("ms per step (all layers)")
        ax.legend()
    fig.suptitle(f"Layout conversion TIDE removes ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
