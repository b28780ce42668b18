"""Where one TIDE-AG / TIDE-RS call spends its GPU time: per stream, per round, across ring settings.

Each rank profiles ``--calls`` back-to-back calls (torch.profiler, CUDA activities) after a warm-up, for
every ring setting of ``--rings`` (``MIBxDEPTH``: ``TIDE_RS_RING_BYTES`` in MiB and ``TIDE_RS_RING_DEPTH``)
and every TIDE-AG own-shard kernel cap of ``--cast-ctas`` (``TIDE_AG_CAST_CTAS``). Rows of ``timeline.csv``:
every kernel and copy of those calls (rank, stream, start and duration in us from the first event). Rows
of ``timeline_summary.csv``, per (ring, cast cap, op, rank): the time per call, and per
stream the busy time (union of its events), the idle time inside the calls (a late peer's share
included: each rank's profile starts on its own), the event count; for every stream that runs kernels
also the mean kernel and the median gap between consecutive kernels (on the summing stream, what the
stream-memop waits and launches cost per round; on the caller's stream, the own-shard kernels of
successive all-gathers, so not a cost). The stream-memop waits themselves are not profiler events: they
show as gaps. ``timeline.png``: rank 0's streams over the calls of each op at the first setting.

The profiler adds a little per event; ``time per call`` is also measured unprofiled (CUDA events over
``--calls`` calls, median of ``--reps``), as bench/collectives.py measures it.

Settings run in order, each in an arena of its own (``setting``: its index). A process's first arena
pushed 8 % slower than later ones of the same setting (2 x H200); ``--warmup-s`` first keeps both GPUs
busy that long (NCCL all-reduces over NVLink and bf16 matmuls), to tell time from arena order.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collectives import N_PARAMS, group_shapes, line_up, median_times  # noqa: E402
from common import default_out, gpu_events, pyplot, require_cuda, run_meta, union_intervals, write_csv  # noqa: E402


def summarize(events: list[dict], calls: int) -> list[dict]:
    """Per stream of one rank's profiled calls: busy and idle time per call, events, and for a stream
    that runs kernels, the mean kernel and the median gap between consecutive kernels (a median, so the
    few gaps between calls and a late peer's wait do not count as a round's cost)."""
    if not events:
        return []
    span = max(e["start"] + e["dur"] for e in events)
    out = []
    for stream in sorted({e["stream"] for e in events}):
        mine = [e for e in events if e["stream"] == stream]
        busy = sum(b - a for a, b in union_intervals([(e["start"], e["start"] + e["dur"]) for e in mine]))
        kernels = [e for e in mine if e["kind"] == "kernel"]
        gaps = [b["start"] - (a["start"] + a["dur"]) for a, b in zip(kernels, kernels[1:])]
        copies = [e for e in mine if e["kind"] == "copy"]
        out.append({"stream": stream, "call_us": span / calls, "busy_us": busy / calls,
                    "idle_us": (span - busy) / calls, "kernels": len(kernels) // calls, "copies": len(copies) // calls,
                    "mean_kernel_us": statistics.mean(k["dur"] for k in kernels) if kernels else 0.0,
                    "median_kernel_gap_us": statistics.median(gaps) if gaps else 0.0})
    return out


def _warm_up(seconds: float, dev: torch.device) -> None:
    """Both GPUs busy for ``seconds``: 64 MiB NCCL all-reduces (NVLink traffic) and bf16 matmuls."""
    import time

    traffic = torch.ones(32 << 20, dtype=torch.bfloat16, device=dev)
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev)
    until = time.monotonic() + seconds
    while True:
        dist.all_reduce(traffic)
        a = a @ a / 64
        torch.cuda.synchronize()
        flag = torch.tensor([time.monotonic() < until], dtype=torch.int32, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank stops at the same round
        if not flag.item():
            return


def _rank_main(rank, world_size, size_mib, settings, calls, reps, warmup_s):
    import tide  # noqa: F401
    import tide.transport
    from torch.profiler import ProfilerActivity, profile

    from tide.meta.layout import GroupLayout

    dev = torch.device("cuda", torch.cuda.current_device())
    gn = dist.group.WORLD.group_name
    layout = GroupLayout(group_shapes(size_mib << 20, world_size), [2] * N_PARAMS, world_size)
    params = layout.params
    shards = [torch.randn(p.shard_numel, device=dev).to(torch.bfloat16) for p in params]
    grads = [torch.randn(p.shape, device=dev).to(torch.bfloat16) for p in params]
    shard_grads = [torch.empty((p.shard_rows, p.shape[1]), device=dev) for p in params]
    rows, events = [], []
    if warmup_s > 0:
        _warm_up(warmup_s, dev)
    for index, (ring_mib, depth, cast_ctas) in enumerate(settings):
        arena = tide.transport.enable(dist.group.WORLD, layouts=[layout], rs_ring_bytes=ring_mib << 20,
                                      ring_depth=depth, cast_ctas=cast_ctas or None)
        outs = [torch.empty(p.out_numel, device=dev, dtype=torch.bfloat16) for p in params]
        arena.bind_outputs(outs, 0)
        ops = {"tide_ag": lambda: torch.ops.tide.all_gather_into_params_(shards, outs, world_size, gn),
               "tide_rs": lambda: torch.ops.tide.reduce_scatter_params_(grads, shard_grads, 1.0 / world_size,
                                                                        False, world_size, gn)}
        for op, fn in ops.items():
            for _ in range(2):
                fn()
            unprofiled_ms, _ = median_times(fn, reps, calls)  # one more warm-up call, then the samples
            line_up()  # the profiler started once per process (55 ms in a first AG on 2 x H200), a barrier
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            ev = gpu_events(prof)
            ring = f"{ring_mib}x{depth}"
            for s in summarize(ev, calls):
                rows.append({"setting": index, "ring": ring, "entry_mib": arena.entry_bytes / 2**20,
                             "cast_ctas": arena.cast_ctas,
                             "op": op, "size_mib": size_mib,
                             "rank": rank, "unprofiled_ms": unprofiled_ms, **s})
            events += [{"setting": index, "ring": ring, "cast_ctas": arena.cast_ctas, "op": op, "rank": rank, **e}
                       for e in ev]
        del outs
        tide.transport.disable(gn)
    return rows, events


def _plot(events: list[dict], out: Path, title: str) -> None:
    plt = pyplot()
    if plt is None or not events:
        return
    first = events[0]["setting"]
    ops = list(dict.fromkeys(e["op"] for e in events))
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 2.2 * len(ops)), squeeze=False)
    colors = {"kernel": "tab:red", "copy": "tab:blue", "memset": "tab:gray"}
    for ax, op in zip(axes[:, 0], ops):
        sel = [e for e in events if e["op"] == op and e["rank"] == 0 and e["setting"] == first]
        if not sel:
            continue
        ring, cast = sel[0]["ring"], sel[0]["cast_ctas"]
        streams = sorted({e["stream"] for e in sel})
        for e in sel:
            ax.broken_barh([(e["start"], max(e["dur"], 0.3))], (streams.index(e["stream"]) - 0.4, 0.8),
                           color=colors[e["kind"]])
        ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
        ax.set_title(f"{op}, ring {ring}, cast CTAs {cast} (red: kernels, blue: copies)", fontsize=9)
        ax.set_xlabel("us from the first event (rank 0)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256, help="message size in MiB (as bench/collectives.py)")
    p.add_argument("--rings", default="64x2,64x4", help="MIBxDEPTH ring settings, comma-separated")
    p.add_argument("--cast-ctas", default="0",
                   help="TIDE-AG own-shard kernel CTA caps to sweep (0: the arena's default)")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="seconds of NCCL all-reduces and matmuls on every GPU before the first setting")
    p.add_argument("--out", default=str(default_out()))
    args = p.parse_args(argv)
    if args.warmup_s < 0:
        p.error("--warmup-s must be >= 0")
    rings = []
    for spec in args.rings.split(","):
        mib, _, depth = spec.partition("x")
        if not (mib.isdigit() and depth.isdigit() and int(mib) > 0 and int(depth) > 0):
            p.error(f"--rings: expected MIBxDEPTH such as 64x4, got {spec!r}")
        rings.append((int(mib), int(depth)))
    try:
        casts = [int(c) for c in args.cast_ctas.split(",")]
    except ValueError:
        p.error(f"--cast-ctas: expected integers, got {args.cast_ctas!r}")
    if any(c < 0 for c in casts):
        p.error("--cast-ctas: CTA caps must be >= 0")
    settings = [(mib, depth, c) for mib, depth in rings for c in casts]
    require_cuda("timeline.py", gpus=2)
    from tide.launch import CUDA_RANK_ENV, run_ranks

    gpus = torch.cuda.device_count()
    results = run_ranks(_rank_main, gpus, args.size, settings, args.calls, args.reps, args.warmup_s,
                        backend="nccl", device_type="cuda", env=CUDA_RANK_ENV, timeout=540)
    meta = run_meta(gpus=gpus, ranks=gpus)
    rows = [{**r, **meta} for rank_rows, _ in results for r in rank_rows]
    events = [e for _, ev in results for e in ev]
    out = Path(args.out)
    write_csv(out / "timeline_summary.csv", rows)
    write_csv(out / "timeline.csv", events)
    _plot(events, out, f"{meta['device']} x{gpus}, {args.size} MiB, {meta['date']}")
    for r in rows:
        if r["rank"] == 0:
            print(f"SUMMARY timeline {r['op']} setting {r['setting']} ring {r['ring']} "
                  f"(entry {r['entry_mib']:.0f} MiB, cast CTAs "
                  f"{r['cast_ctas']}) stream {r['stream']}: "
                  f"{r['unprofiled_ms'] * 1e3:.0f} us/call unprofiled, {r['call_us']:.0f} profiled, busy "
                  f"{r['busy_us']:.0f} idle {r['idle_us']:.0f}, {r['kernels']} kernels "
                  f"(mean {r['mean_kernel_us']:.1f} us, median gap {r['median_kernel_gap_us']:.1f}), "
                  f"{r['copies']} copies")


if __name__ == "__main__":
    main()
