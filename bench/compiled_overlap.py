"""How much of its transfers a compiled TIDE step hides behind compute, at all-gather prefetch depth 0 and 1.

The decoder of ``tide.models`` (``--preset``, ``--blocks`` blocks) sharded SimpleFSDP-style
(tide/compile/simple_fsdp.py: bf16 gathers, fp32 reduce-scatters, the parameters gathered again in the backward), its
forward and loss compiled by Inductor after ``tide.compile.enable()`` on the CUDA transport, ``--ranks`` ranks (one GPU
each with NCCL, else sharing one GPU over gloo: there every peer copy is a same-GPU copy, so the figures show where
transfers sit against compute, not NVLink speed). Per depth (``TIDE_COMPILE_PREFETCH``, each in processes of its own):
the median step time over ``--steps`` steps after ``--warmup``, the all-gathers in slots and on the direct lane per
step, peak memory, and one profiled step of rank 0 (torch.profiler): on the compute stream (the one that runs the
most kernel time) its kernels; elsewhere TIDE's transfers (copies, and the kernels of the transport's own
streams). ``hidden_share``: the part of the transfers' busy time during which the compute stream ran a kernel.

Writes ``compiled_overlap.csv`` (a row per depth), ``compiled_overlap_timeline.csv`` (the profiled step's events
per depth) and ``compiled_overlap.png`` (those steps' compute and transfer streams).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out, gpu_events, pyplot, require_cuda, run_meta, union_intervals, write_csv  # noqa: E402


def _overlap(xs, ys) -> float:
    """Time covered by both interval unions."""
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += min(b, ys[k][1]) - max(a, ys[k][0])
            k += 1
    return total


def split_streams(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """(compute events, transfer events): the compute stream runs the most kernel time; a transfer is a copy on
    any other stream or a kernel of one."""
    busy: dict[int, float] = {}
    for e in events:
        if e["kind"] == "kernel":
            busy[e["stream"]] = busy.get(e["stream"], 0.0) + e["dur"]
    compute = max(busy, key=busy.get) if busy else None
    return ([e for e in events if e["stream"] == compute and e["kind"] == "kernel"],
            [e for e in events if e["stream"] != compute and e["kind"] in ("kernel", "copy")])


def hidden(events: list[dict]) -> tuple[float, float]:
    """(transfer busy us, of it us during compute)."""
    compute, transfer = split_streams(events)
    busy = union_intervals([(e["start"], e["start"] + e["dur"]) for e in transfer])
    during = _overlap(busy, union_intervals([(e["start"], e["start"] + e["dur"]) for e in compute]))
    return sum(b - a for a, b in busy), during


def depth_rank(rank, world_size, preset, blocks, tokens, batch_size, steps, warmup, cache):
    from tide.compile import simple_fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    import tide
    import tide.compile
    from tide.models import PRESETS, Llama, batch, loss_fn

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, f"rank{rank}")
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = dataclasses.replace(PRESETS[preset], n_layers=blocks, seq_len=tokens // batch_size)
    with simple_fsdp.reshard_after_forward():
        torch.manual_seed(0)
        with torch.device(device):
            model = Llama(cfg)
        simple_fsdp.simple_fsdp(model, init_device_mesh("cuda", (world_size,)))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tide.compile.enable()
        tide.compile.prepare(model, param_dtype=torch.bfloat16)
        loss_of = torch.compile(lambda x, y: loss_fn(model(x), y), fullgraph=True, dynamic=False)

        def step(i):
            tide.compile.release()
            loss = loss_of(*batch(cfg, i, rank, batch_size, device=device))
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            return loss

        for i in range(warmup):
            step(i)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        tide.reset_stats()
        times = []
        for i in range(warmup, warmup + steps):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step(i)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ops = tide.stats()["ops"]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(warmup + steps)
            torch.cuda.synchronize()
    direct = sum(n for k, n in ops.items() if k.startswith("all_gather_start:allocator:"))
    return {"median_step_ms": statistics.median(times) * 1e3,
            "ag_slot_per_step": ops.get("all_gather_start:slot", 0) / steps,
            "ag_direct_per_step": direct / steps, "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
            "ops": str(ops), "events": gpu_events(prof) if rank == 0 else []}


def _plot(timelines: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 2.2 * len(timelines)), squeeze=False)
    for ax, (depth, events) in zip(axes[:, 0], timelines.items()):
        compute, transfer = split_streams(events)
        ax.broken_barh([(e["start"] / 1e3, e["dur"] / 1e3) for e in compute], (10, 8), color="tab:blue")
        ax.broken_barh([(e["start"] / 1e3, e["dur"] / 1e3) for e in transfer], (0, 8), color="tab:orange")
        ax.set_yticks([4, 14], ["TIDE transfers", "compute stream"])
        ax.set_title(f"prefetch depth {depth}: one compiled step, rank 0", fontsize=9)
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama8b")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per GPU per step")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--depths", default="0,1")
    p.add_argument("--ranks", type=int, default=None, help="default: the GPU count if >= 2, else 2")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(default_out()))
    args = p.parse_args(argv)
    require_cuda("compiled_overlap.py")
    from tide.launch import CUDA_RANK_ENV, run_ranks

    gpus = torch.cuda.device_count()
    ranks = args.ranks or (gpus if gpus >= 2 else 2)
    backend = "nccl" if gpus >= ranks else "gloo"
    rows, timeline, timelines = [], [], {}
    cache = tempfile.mkdtemp(prefix="tide_inductor_")
    for depth in (int(d) for d in args.depths.split(",")):
        env = {**CUDA_RANK_ENV, "TIDE_COMPILE_PREFETCH": str(depth)}
        results = run_ranks(depth_rank, ranks, args.preset, args.blocks, args.tokens, args.batch, args.steps,
                            args.warmup, os.path.join(cache, f"depth{depth}"), backend=backend, device_type="cuda",
                            env=env, timeout=580)
        events = results[0]["events"]
        busy, covered = hidden(events)
        row = {"depth": depth, "median_step_ms": max(r["median_step_ms"] for r in results),
               "transfer_busy_us": busy, "hidden_us": covered, "hidden_share": covered / busy if busy else 0.0,
               "ag_slot_per_step": results[0]["ag_slot_per_step"],
               "ag_direct_per_step": results[0]["ag_direct_per_step"],
               "peak_mib": results[0]["peak_mib"], "ranks": ranks, "backend": backend, "preset": args.preset,
               "blocks": args.blocks, "tokens_per_gpu": args.tokens, "ops": results[0]["ops"], **run_meta()}
        rows.append(row)
        timelines[depth] = events
        timeline += [{"depth": depth, **e} for e in events]
        print(f"depth {depth}: median step {row['median_step_ms']:.2f} ms, transfers busy {busy / 1e3:.2f} ms, "
              f"hidden {row['hidden_share'] * 100:.0f} %, all-gathers per step {row['ag_slot_per_step']:.0f} in slots "
              f"{row['ag_direct_per_step']:.0f} on the direct lane, peak {row['peak_mib']:.0f} MiB", flush=True)
    out = Path(args.out)
    write_csv(out / "compiled_overlap.csv", rows)
    write_csv(out / "compiled_overlap_timeline.csv", timeline)
    _plot(timelines, out / "compiled_overlap.png")
    print("SUMMARY compiled_overlap " + " ".join(f"depth{r['depth']}={r['median_step_ms']:.1f}ms/"
                                                 f"hidden{r['hidden_share'] * 100:.0f}%" for r in rows))


if __name__ == "__main__":
    main()
