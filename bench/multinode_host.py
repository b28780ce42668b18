"""Host time per call of the multi-node schedule (issue 13), CPU: its plan built once per group vs every call.

    python bench/multinode_host.py [--reps 200] [--ranks 2] [--local-world-size 1]

``--ranks`` gloo ranks on this machine, emulated as nodes of ``--local-world-size`` ranks
(``tide.topology``), one torch thread each. The group is the collectives bench's: 8 parameters of uneven
dim 0 (rows of 8 elements, so the data is small and the host path dominates). Per call, on rank 0, medians
over ``--reps`` of the wall time of ``tide.ops.reference_multinode.all_gather`` / ``reduce_scatter`` (bf16
gradients into fp32 shards), in two modes alternated ABBA in one process: ``cached`` (the schedule of the
group built once, as the ops run it) and ``planned`` (its cache cleared before every call: what every call
cost before the plans were cached). On CPU the rails are gloo sends; on GPUs they are NCCL batches, and
the same Python runs around them.

Writes ``multinode_host.csv`` and ``.png`` under ``--out`` and prints one ``SUMMARY`` line.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out, pyplot, run_meta, write_csv  # noqa: E402

ROWS = (37, 129, 11, 64, 200, 5, 77, 300)
MODES = ("cached", "planned")


def _measure(rank: int, world_size: int, local_world_size: int, reps: int) -> dict:
    torch.set_num_threads(1)
    from tide import topology
    from tide.ops import reference_multinode as rm

    topology.set_local_world_size(local_world_size, "multinode_host")
    group = dist.group.WORLD
    topo = topology.of_group(group)
    W = world_size
    shards = [torch.randn(r, 8) for r in ROWS]
    outs = [torch.empty(W * r, 8) for r in ROWS]
    grads = [torch.randn(W * r, 8).bfloat16() for r in ROWS]
    shard_grads = [torch.empty(r, 8) for r in ROWS]
    ops = {"all_gather": (lambda: rm.all_gather(shards, outs, group, topo), rm._ag_schedule),
           "reduce_scatter": (lambda: rm.reduce_scatter(grads, shard_grads, 0.5, False, group, topo), rm._rs_schedule)}
    times = {(op, m): [] for op in ops for m in MODES}
    for op, (call, schedule) in ops.items():
        for _ in range(3):
            call()
        for i in range(reps):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):  # ABBA
                if mode == "planned":
                    schedule.cache_clear()
                dist.barrier()
                t0 = time.perf_counter()
                call()
                times[op, mode].append(time.perf_counter() - t0)
    return {f"{op}/{mode}": [statistics.median(ts) * 1e6, *statistics.quantiles(ts, n=10)[::8]]
            for (op, mode), ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--local-world-size", type=int, default=1)
    ap.add_argument("--out", type=Path, default=default_out())
    args = ap.parse_args()
    if args.ranks % args.local_world_size or args.ranks // args.local_world_size < 2:
        raise SystemExit("multinode_host: --ranks must be a multiple of --local-world-size, with 2+ nodes")
    from tide.launch import run_ranks

    result = run_ranks(_measure, args.ranks, args.local_world_size, args.reps, timeout=900)[0]
    meta = run_meta(host=platform.processor() or platform.machine(), ranks=args.ranks,
                    nodes=args.ranks // args.local_world_size, local_size=args.local_world_size, reps=args.reps)
    rows = []
    for key, (median, p10, p90) in result.items():
        op, mode = key.split("/")
        rows.append({"op": op, "mode": mode, "median_us": median, "p10_us": p10 * 1e6, "p90_us": p90 * 1e6, **meta})
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "multinode_host.csv", rows)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for i, mode in enumerate(MODES):
            sel = [r for r in rows if r["mode"] == mode]
            ax.bar([j + 0.4 * i for j in range(len(sel))], [r["median_us"] for r in sel], width=0.4, label=mode)
        ax.set_xticks([j + 0.2 for j in range(2)], ["all_gather", "reduce_scatter"])
        ax.set_ylabel("host time per call (us, median)")
        ax.set_title(f"multi-node schedule on CPU, {meta['nodes']} nodes x {args.local_world_size}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "multinode_host.png", dpi=120)
    by = {(r["op"], r["mode"]): r["median_us"] for r in rows}
    print("SUMMARY multinode_host (CPU, " + f"{meta['nodes']} x {args.local_world_size}): " + ", ".join(
        f"{op} {by[op, 'cached']:.0f} us cached vs {by[op, 'planned']:.0f} planned every call"
        for op in ("all_gather", "reduce_scatter")))


if __name__ == "__main__":
    main()
