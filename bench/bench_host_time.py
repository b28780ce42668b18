"""Host time to issue one all-gather and one reduce-scatter of a 60-parameter group: TIDE vs stock FSDP2.

TIDE: W ranks (default 8) over gloo with symmetric memory (sharing the GPU when there are fewer GPUs), one
``torch.ops.tide.all_gather_into_params_`` into arena-bound outputs (FSDP's zero-copy case; ``ag_bind``
also binds 60 one-dimensional outputs into the slot with ``Arena.bind_outputs`` in the timed region, as
the FSDP seam does at every unshard; ``ag_op_only`` uses slot views made beforehand) and one
``torch.ops.tide.reduce_scatter_params_`` per iteration: In-Place with the same gradient tensors every
call; In-Place "recurring", cycling over 4 gradient sets (like 4 FSDP blocks whose gradients come back
at the same addresses each step: each set replays its own cached push graphs); In-Place "fresh", at new
addresses every call (views into one buffer shifted by 256 B per call over R x (``max_graph_sets`` + 1)
positions, 66 by default, more than the graph cache holds for any ring phase: every call re-points the copy
nodes, the worst case; graph mode checks that it did); and Slot-Reuse with the
gradients already in the slot (where FSDP's Slot-Reuse hooks leave them). Timed on rank 0 from the
Python call to its return (the GPU is synchronised between
iterations, outside the timed region). Each copy mode (``TIDE_CE_MODE`` = graph, batch, loop) runs in its
own set of ranks; the arena's counters split the C++ part of a call by kind of call (kernel launches,
stream memops, graph launches, graph node updates, copy-API calls, events); the rest is Python and
op dispatch.

Stock: FSDP2's tensor ops for the same group, issued the way ``foreach_all_gather`` /
``foreach_all_gather_copy_out`` / ``foreach_reduce`` issue them (the copy-in ``_foreach_copy_`` into the flat
buffer, ``all_gather_into_tensor``, ``split_with_sizes_copy``; ``torch._chunk_cat``,
``reduce_scatter_tensor``, per-parameter views and gradient accumulation), on a one-rank NCCL group
(NCCL allows one rank per GPU). FSDP2's own Python bookkeeping around these ops is not included, so
the stock numbers are a lower bound of its host time. Writes bench/results/host_time.csv and .png.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


def group_shapes(n_params: int = 60, hidden: int = 1024, ffn: int = 2816) -> list[tuple]:
    """A Llama-like group: 6 blocks x (4 attention + 3 MLP weights + 2 norms + 1 bias-like vector)."""
    per_block = [(hidden, hidden), (hidden // 4, hidden), (hidden // 4, hidden), (hidden, hidden),
                 (ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,), (ffn // 11,)]
    return [per_block[i % len(per_block)] for i in range(n_params)]


def _time(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return out


VARIANTS = ("ag_bind", "ag_op_only", "rs_in_place", "rs_in_place_recurring", "rs_in_place_fresh", "rs_slot_reuse")
RECURRING_SETS = 4
FRESH_SHIFT = 256
CPP_KEYS = ("host_ns_total", "host_ns_kernel", "host_ns_memop", "host_ns_graph_launch", "host_ns_graph_update",
            "host_ns_graph_build", "host_ns_copy_api", "host_ns_event", "graph_launches", "graphs_built",
            "graph_node_updates", "memop_calls", "copy_api_calls", "kernels", "op_calls")


def tide_rank(rank: int, world_size: int, iters: int, mode: str) -> dict:
    """One TIDE arena with copy mode ``mode``; per variant the host times of rank 0 and, from the arena's
    counters, the per-call split of the C++ part (the rest of a call is Python and dispatch)."""
    import torch.distributed as dist

    import tide  # noqa: F401
    from tide import transport
    from tide.transport import plans

    group = dist.group.WORLD
    name = group.group_name
    dev = torch.device("cuda", torch.cuda.current_device())
    shapes = group_shapes()
    shards = [torch.randn((-(-s[0] // world_size), *s[1:]), device=dev).to(torch.bfloat16) for s in shapes]
    dtypes = [torch.bfloat16] * len(shards)
    layout = plans.all_gather_layout([s.shape for s in shards], dtypes, world_size)
    arena = transport.enable(group, slot_bytes=layout.slot_bytes, ce_mode=mode)
    grads = [torch.randn(s, device=dev).to(torch.bfloat16) for s in shapes]
    recurring = [grads] + [[g.clone() for g in grads] for _ in range(RECURRING_SETS - 1)]
    # Fresh addresses: the gradients as views into one buffer, shifted by FRESH_SHIFT bytes per call. The
    # push graphs are cached per (plan, ring phase) and the phase advances with the rounds of each call, so
    # a phase may see only every R-th position: R x (sets + 1) positions miss the cache on every call.
    fresh_positions = arena.ring_depth * (arena.max_graph_sets + 1)
    offsets, total = [], 0
    for g in grads:
        offsets.append(total)
        total += -(-g.numel() * 2 // FRESH_SHIFT) * FRESH_SHIFT
    buf = torch.randn((total + fresh_positions * FRESH_SHIFT) // 2, device=dev).to(torch.bfloat16)
    fresh = [[buf[(o + k * FRESH_SHIFT) // 2:(o + k * FRESH_SHIFT) // 2 + g.numel()].view(g.shape)
              for o, g in zip(offsets, grads)] for k in range(fresh_positions)]
    shard_grads = [torch.zeros((-(-s[0] // world_size), *s[1:]), device=dev) for s in shapes]
    views = [arena.slot_views(layout, dtypes, i) for i in range(arena.num_slots)]
    # Slot-Reuse reads the slot the next all-gather would take (no all-gather runs in between).
    in_slot = arena.grad_views(shapes, [torch.bfloat16] * len(shapes), arena.next_slot())
    for v, g in zip(in_slot, grads):
        v.copy_(g)
    calls = [0]

    fsdp_outs = [torch.empty(world_size * s.numel(), device=dev, dtype=torch.bfloat16) for s in shards]

    def ag_bind():
        arena.bind_outputs(fsdp_outs)
        torch.ops.tide.all_gather_into_params_(shards, fsdp_outs, world_size, name)

    def ag_op_only():
        torch.ops.tide.all_gather_into_params_(shards, views[arena.next_slot()], world_size, name)

    def rs(g=None):
        torch.ops.tide.reduce_scatter_params_(g or grads, shard_grads, 1.0 / world_size, True, world_size, name)

    def rs_cycle(sets):
        def call():
            calls[0] += 1
            rs(sets[calls[0] % len(sets)])
        return call

    fns = {"ag_bind": ag_bind, "ag_op_only": ag_op_only, "rs_in_place": rs, "rs_in_place_recurring": rs_cycle(recurring),
           "rs_in_place_fresh": rs_cycle(fresh), "rs_slot_reuse": lambda: rs(in_slot)}
    res = {}
    for variant in VARIANTS:
        arena.rs_mode = "slot_reuse" if variant == "rs_slot_reuse" else "in_place"
        # Warm-up: plans, graphs of every set, slot and ring phase; for "fresh", a full cache.
        _time(fns[variant], fresh_positions if variant == "rs_in_place_fresh" else 2 * RECURRING_SETS)
        dist.barrier()
        before = arena.counters()
        times = _time(fns[variant], iters)
        after = arena.counters()
        dist.barrier()
        res[variant] = {"times": times, "cpp": {k: (after[k] - before[k]) / iters for k in CPP_KEYS}}
        if variant == "rs_in_place_fresh" and mode == "graph" and res[variant]["cpp"]["graph_node_updates"] == 0:
            raise RuntimeError("bench_host_time: the 'fresh' variant replayed cached graphs; it no longer measures "
                               "gradients at new addresses")
    c = arena.counters()
    res["arena"] = {k: c[k] for k in ("ce_mode", "ce_mode_now", "graph_error", "batched_memop_writes", "graphs_built")}
    return res if rank == 0 else {}


def stock_rank(rank: int, world_size: int, iters: int, layout_world: int) -> dict:
    """FSDP2's ops for the group as sharded over ``layout_world`` ranks, on a one-rank NCCL group."""
    import torch.distributed as dist

    group = dist.group.WORLD
    dev = torch.device("cuda", torch.cuda.current_device())
    shapes = group_shapes()
    W = layout_world
    shards = [torch.randn((-(-s[0] // W), *s[1:]), device=dev).to(torch.bfloat16) for s in shapes]  # bf16 all-gather inputs
    inp_numels = [s.numel() for s in shards]
    total = sum(inp_numels)
    outs = [torch.empty((s.numel(),), device=dev, dtype=torch.bfloat16) for s in shards]
    grads = [torch.randn(s, device=dev).to(torch.bfloat16) for s in shapes]
    sharded_grads = [torch.zeros(s.shape, device=dev) for s in shards]

    def ag():
        # foreach_all_gather: copy-in (cast into the flat rank-major buffer), all-gather; copy-out.
        # (what torch.ops.fsdp.all_gather_copy_in does; its signature differs between torch releases)
        ag_output = torch.empty(total, dtype=torch.bfloat16, device=dev)
        ag_input = ag_output.narrow(0, 0, total)
        torch._foreach_copy_(list(ag_input.split(inp_numels)), [s.view(-1) for s in shards])
        dist.all_gather_into_tensor(ag_output, ag_input, group=group)
        torch.split_with_sizes_copy(ag_output.view(1, -1), inp_numels, dim=1, out=[o.view(1, -1) for o in outs])

    def rs():
        # foreach_reduce: chunk_cat into the padded reduce buffer, reduce-scatter, per-param epilogue.
        padded = [g.view(-1)[: s.numel()] for g, s in zip(grads, shards)]  # W=1 layout: same sizes
        rs_input = torch.empty(total, dtype=torch.float32, device=dev)  # reduce_dtype fp32, like TIDE's sum
        torch._chunk_cat(padded, dim=0, num_chunks=1, out=rs_input.view(1, -1))
        rs_output = rs_input.new_empty(total)
        dist.reduce_scatter_tensor(rs_output, rs_input, group=group)
        rs_output.div_(W)
        offset = 0
        for sg, s in zip(sharded_grads, shards):
            new = torch.as_strided(rs_output, size=s.shape, stride=s.stride(), storage_offset=offset)
            sg += new
            offset += s.numel()

    _time(ag, 3), _time(rs, 3)
    return {"stock_ag": _time(ag, iters), "stock_rs": _time(rs, iters)}


def main(argv=None):
    from tide.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--modes", default="graph,batch,loop", help="TIDE_CE_MODE values to measure")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "world_size": args.world_size, "params": len(group_shapes())}
    rows, med = [], {}

    def add(path, mode, variant, times, cpp=None):
        srt = sorted(times)
        row = {"path": path, "ce_mode": mode, "variant": variant, "median_us": statistics.median(times) * 1e6,
               "p10_us": srt[len(srt) // 10] * 1e6, "p90_us": srt[(9 * len(srt)) // 10] * 1e6}
        cpp = cpp or {}
        row["cpp_us"] = cpp.get("host_ns_total", float("nan")) / 1e3
        row["python_us"] = row["median_us"] - row["cpp_us"]  # median call minus mean C++ part
        for k in CPP_KEYS[1:8]:
            row[k.replace("host_ns_", "cpp_") + "_us"] = cpp.get(k, float("nan")) / 1e3
        for k in CPP_KEYS[8:]:
            row[k + "_per_call"] = cpp.get(k, float("nan"))
        rows.append({**row, **meta})
        med[path] = row["median_us"]
        split = ", ".join(f"{k[4:-3]} {row[k]:.0f}" for k in row if k.startswith("cpp_") and k.endswith("_us")
                          and k != "cpp_us" and row[k] == row[k] and row[k] >= 0.5)
        print(f"{path:34s} median {row['median_us']:8.1f} us (p10 {row['p10_us']:.1f}, p90 {row['p90_us']:.1f})"
              + (f"  C++ {row['cpp_us']:.0f} [{split}]  graph launches {row['graph_launches_per_call']:.0f}, node "
                 f"updates {row['graph_node_updates_per_call']:.0f}, memops {row['memop_calls_per_call']:.0f}, copy "
                 f"calls {row['copy_api_calls_per_call']:.0f}" if cpp else ""), flush=True)

    for mode in args.modes.split(","):
        try:
            res = run_ranks(tide_rank, args.world_size, args.iters, mode, backend="gloo", device_type="cuda",
                            env={**ENV, "TIDE_CE_MODE": mode}, timeout=240)[0]
        except Exception as e:  # one mode failing must not hide the others
            print(f"mode {mode} FAILED: {type(e).__name__}: {str(e)[-2000:]}", flush=True)
            continue
        print(f"mode {mode}: arena {res.get('arena')}", flush=True)
        for variant in VARIANTS:
            add(f"tide_{mode}_{variant}", mode, variant, res[variant]["times"], res[variant]["cpp"])
    stock_res = run_ranks(stock_rank, 1, args.iters, args.world_size, backend="nccl", device_type="cuda", env=ENV,
                          timeout=240)[0]
    add("stock_ag", "stock", "ag", stock_res["stock_ag"])
    add("stock_rs", "stock", "rs", stock_res["stock_rs"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "host_time.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 0.28 * len(rows) + 1.2))
        colors = {"graph": "tab:green", "batch": "tab:blue", "loop": "tab:orange", "stock": "tab:gray"}
        ax.barh([r["path"] for r in rows], [r["median_us"] for r in rows], color=[colors[r["ce_mode"]] for r in rows])
        for ref in ("stock_ag", "stock_rs"):
            ax.axvline(med[ref], color="k", lw=0.8, ls=":")
        ax.invert_yaxis()
        ax.set_xlabel("host time per call, median (us); dotted: stock AG / RS")
        ax.set_title(f"Issue cost, 60-param group, W={args.world_size}, {meta['gpu']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "host_time.png", dpi=120)
    except ImportError:
        pass

    def get(mode, variant):
        v = med.get(f"tide_{mode}_{variant}")
        return "n/a" if v is None else f"{v:.0f}"

    modes = args.modes.split(",")
    line = "SUMMARY host_time us (median), " + " / ".join(modes) + ":"
    for variant in VARIANTS:
        line += f" {variant} " + " / ".join(get(m, variant) for m in modes) + ";"
    print(line + f" stock AG {med['stock_ag']:.0f}, stock RS {med['stock_rs']:.0f}")


if __name__ == "__main__":
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    main()
