"""Training step of the Llama-like model from ``tide.train``: stock FSDP2 vs TIDE (both RS modes).

Median step time over ``--steps`` steps after ``--warmup`` warm-up steps, and peak memory (CUDA
``max_memory_allocated`` of rank 0). With one GPU per rank the group is NCCL; with fewer GPUs than ranks
the ranks share the GPU over gloo (a smoke run: stock collectives then go through gloo's CPU staging,
so the step times say nothing about NVLink). ``tide.fsdp.stats()`` of each run is recorded so the CSV
shows which path really ran, and, over the timed steps, how many push graphs TIDE built and how many
copy nodes it re-pointed per step (zero once every block's gradients come back at the addresses of
the step before: the reduce-scatters then replay cached graphs). Writes bench/results/train_step.csv
and .png.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common import RESULTS, pyplot, run_meta, write_csv

VARIANTS = (("stock", None), ("tide_in_place", "in_place"), ("tide_slot_reuse", "slot_reuse"))


def _rank(rank, world_size, model_name, steps, warmup):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import tide.fsdp
    from tide.models import PRESETS
    from tide.train import fsdp_model, train_step

    device = torch.device("cuda", torch.cuda.current_device())
    cfg = PRESETS[model_name]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    rows = []
    for name, rs_mode in VARIANTS:
        model = fsdp_model(cfg, device=device, mp_policy=mp, use_tide=rs_mode is not None,
                           rs_mode=rs_mode or "in_place", seed=0)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tide.fsdp.reset_stats()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        times, losses = [], []
        graph_counts = {}
        for step in range(warmup + steps):
            if step == warmup:
                graph_counts = _graph_counters()
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            loss = train_step(model, optim, cfg, step, rank, device=device)
            torch.cuda.synchronize()
            if step >= warmup:
                times.append(time.perf_counter() - t0)
                losses.append(float(loss))
        rows.append({"variant": name, "median_step_ms": statistics.median(times) * 1e3,
                     "p90_step_ms": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
                     "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20, "final_loss": losses[-1],
                     "stats": str(tide.fsdp.stats()), "arena_stats": str(tide.fsdp.arena_stats()),
                     **{f"{k}_per_step": (v - graph_counts.get(k, 0)) / steps for k, v in _graph_counters().items()}})
        if rank == 0:
            print(f"{name:16s} median {rows[-1]['median_step_ms']:8.2f} ms  peak {rows[-1]['peak_mib']:8.1f} MiB  "
                  f"graphs built/step {rows[-1].get('graphs_built_per_step', 0):.1f}, node updates/step "
                  f"{rows[-1].get('graph_node_updates_per_step', 0):.1f}  {rows[-1]['stats']} {rows[-1]['arena_stats']}",
                  flush=True)
        if rs_mode is not None:
            tide.fsdp.disable(model)
        del model, optim
        torch.cuda.empty_cache()
    return rows


def _graph_counters() -> dict:
    """Push graphs built and copy nodes re-pointed so far, summed over this rank's arenas."""
    from tide import transport

    out = {"graphs_built": 0, "graph_node_updates": 0}
    for arena in {id(a): a for a in transport.arenas().values()}.values():
        c = arena.counters()
        for k in out:
            out[k] += c[k]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="medium")
    p.add_argument("--ranks", type=int, default=None, help="default: the GPU count if >= 2, else 2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    from tide.launch import CUDA_RANK_ENV, run_ranks

    gpus = torch.cuda.device_count()
    ranks = args.ranks or (gpus if gpus >= 2 else 2)
    backend = "nccl" if gpus >= ranks else "gloo"
    per_rank = run_ranks(_rank, ranks, args.model, args.steps, args.warmup, backend=backend, device_type="cuda",
                         env=CUDA_RANK_ENV, timeout=540)
    mode = "one GPU per rank" if gpus >= ranks else f"{ranks} ranks sharing {gpus} GPU (smoke, gloo stock path)"
    meta = run_meta(gpus=gpus, ranks=ranks, backend=backend, model=args.model, steps=args.steps,
                    warmup=args.warmup, mode=mode)
    rows = [{**r, "median_step_ms": max(pr[i]["median_step_ms"] for pr in per_rank), **meta}
            for i, r in enumerate(per_rank[0])]
    out = Path(args.out)
    write_csv(out / "train_step.csv", rows)
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["variant"] for r in rows]
    axes[0].bar(names, [r["median_step_ms"] for r in rows])
    axes[0].set_ylabel("median step (ms)")
    axes[1].bar(names, [r["peak_mib"] for r in rows])
    axes[1].set_ylabel("peak memory, rank 0 (MiB)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{args.model}, {mode}, {meta['device']}, {meta['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "train_step.png", dpi=120)
    print("SUMMARY train_step (" + mode + "): " +
          ", ".join(f"{r['variant']} {r['median_step_ms']:.1f} ms {r['peak_mib']:.0f} MiB"
                    + (f" ({r['graphs_built_per_step']:.1f} graphs built, {r['graph_node_updates_per_step']:.1f} nodes "
                       "re-pointed per step)" if r["variant"] != "stock" else "") for r in rows))


if __name__ == "__main__":
    main()
