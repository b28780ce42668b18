"""Host time to issue one all-gather and one reduce-scatter of a 60-parameter group: TIDE vs stock FSDP2.

TIDE: ``torch.ops.tide.all_gather_into_params_`` into arena-bound outputs (FSDP's zero-copy case;
``ag_bind`` also binds 60 one-dimensional outputs into the slot with ``Arena.bind_outputs`` in the timed
region, as the FSDP seam does at every unshard; ``ag_op_only`` uses slot views made beforehand), and
``torch.ops.tide.reduce_scatter_params_`` In-Place with the same gradient tensors every call, In-Place
with gradients at new addresses every call (the transport keeps no per-address state, so this must
cost the same), and Slot-Reuse: the gradients at their places in a slot (where FSDP's Slot-Reuse hooks
leave them), which the op reads where they lie. Every ``torch.ops.tide`` row after its first call stays
in the extension's C++ kernel (csrc/transport/dispatch.cpp; ``steady_calls`` counts those calls). Four
rows show what a call that enters Python costs: ``ag_op_via_python`` and
``rs_in_place_via_python`` are the op calls with the C++ steady path off (``steady_enable``: every call
enters the Python kernel, as before the C++ kernels existed), ``ag_python`` calls the op's Python
kernel (``tide.ops.cuda``, what serves the first call of a layout, a lease, a capture) with the verdict,
plan and slot the gate found, as the C++ kernel hands them over, and ``ag_arena`` the Python driver's
``all_gather.issue_call`` with them (the kernel's watchdog check and counter left out).
``dispatch_only`` calls an operator of this bench with the all-gather's schema whose CUDA kernel does
nothing: what the ``torch.ops`` dispatcher itself costs for these arguments. Timed on rank 0 from the Python call to its
return (the GPU is synchronised between iterations, outside the timed region); the arena's counters split the C++ part
of a call by kind (kernel launches, stream memops, copy-API calls, events); the rest is Python and op dispatch.

Stock: FSDP2's tensor ops for the same group, issued the way ``foreach_all_gather`` /
``foreach_all_gather_copy_out`` / ``foreach_reduce`` issue them (the copy-in ``_foreach_copy_`` into the
flat buffer, ``all_gather_into_tensor``, ``split_with_sizes_copy``; ``torch._chunk_cat``,
``reduce_scatter_tensor``, per-parameter views and gradient accumulation). FSDP2's own Python
bookkeeping around these ops is not included, so the stock numbers are a lower bound of its host time.

With one GPU per rank both run on the same W ranks (NCCL). With fewer GPUs, the TIDE ranks share the
GPU over gloo and the stock ops run on a one-rank NCCL group (NCCL allows one rank per GPU).
Writes ``host_time.csv`` and ``.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out, pyplot, require_cuda, run_meta, write_csv  # noqa: E402

VARIANTS = ("ag_bind", "ag_op_only", "ag_op_via_python", "ag_python", "ag_arena", "dispatch_only", "rs_in_place",
            "rs_in_place_via_python", "rs_in_place_fresh", "rs_slot_reuse")
VIA_PYTHON = ("ag_op_via_python", "rs_in_place_via_python")  # the op with the C++ steady path off
FRESH_SETS = 8
CPP_KEYS = ("host_ns_total", "host_ns_kernel", "host_ns_memop", "host_ns_copy", "host_ns_event", "kernels",
            "memop_calls", "copy_api_calls")


def group_shapes(n_params: int = 60, hidden: int = 1024, ffn: int = 2816) -> list[tuple]:
    """A Llama-like group: 6 blocks x (4 attention + 3 MLP weights + 2 norms + 1 bias-like vector)."""
    per_block = [(hidden, hidden), (hidden // 4, hidden), (hidden // 4, hidden), (hidden, hidden),
                 (ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,), (ffn // 11,)]
    return [per_block[i % len(per_block)] for i in range(n_params)]


@functools.cache  # registrations live as long as their Library: the cache keeps it
def _no_op_library() -> torch.library.Library:
    """``torch.ops.tide_bench.all_gather_schema_``: the all-gather's schema, a CUDA kernel that does nothing."""
    from tide.ops.schemas import SCHEMAS

    lib = torch.library.Library("tide_bench", "DEF")
    lib.define(SCHEMAS["all_gather_into_params_"].replace("all_gather_into_params_", "all_gather_schema_", 1))
    lib.impl("all_gather_schema_", lambda shards, outs, world_size, group_name: None, "CUDA")
    return lib


def _time(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return out


def tide_times(world_size: int, iters: int) -> dict:
    """Per variant, the host times of this rank and the mean C++ split per call."""
    import torch.distributed as dist

    import tide  # noqa: F401
    from tide import transport
    from tide.ops import cuda as tide_cuda
    from tide.meta import plans
    from tide.transport import all_gather

    group = dist.group.WORLD
    name = group.group_name
    dev = torch.device("cuda", torch.cuda.current_device())
    shapes = group_shapes()
    shards = [torch.randn((-(-s[0] // world_size), *s[1:]), device=dev).to(torch.bfloat16) for s in shapes]
    dtypes = [torch.bfloat16] * len(shards)
    layout = plans.all_gather_layout([s.shape for s in shards], dtypes, world_size)
    arena = transport.enable(group, slot_bytes=layout.slot_bytes)
    grads = [torch.randn(s, device=dev).to(torch.bfloat16) for s in shapes]
    fresh = [[g.clone() for g in grads] for _ in range(FRESH_SETS)]
    shard_grads = [torch.zeros((-(-s[0] // world_size), *s[1:]), device=dev) for s in shapes]
    views = [arena.slot_views(layout, dtypes, i) for i in range(arena.num_slots)]
    in_slot = arena.grad_views(shapes, [torch.bfloat16] * len(shapes), 0)
    for v, g in zip(in_slot, grads):
        v.copy_(g)
    fsdp_outs = [torch.empty(world_size * s.numel(), device=dev, dtype=torch.bfloat16) for s in shards]
    calls = [0]
    _no_op_library()
    no_op = torch.ops.tide_bench.all_gather_schema_

    def ag_bind():
        arena.bind_outputs(fsdp_outs, 1)
        torch.ops.tide.all_gather_into_params_(shards, fsdp_outs, world_size, name)

    def rs(g=None):
        torch.ops.tide.reduce_scatter_params_(g or grads, shard_grads, 1.0 / world_size, True, world_size, name)

    def rs_fresh():
        calls[0] += 1
        rs(fresh[calls[0] % FRESH_SETS])

    fns = {"ag_bind": ag_bind,
           "ag_op_only": lambda: torch.ops.tide.all_gather_into_params_(shards, views[0], world_size, name),
           "ag_op_via_python": lambda: torch.ops.tide.all_gather_into_params_(shards, views[0], world_size, name),
           "ag_python": lambda: tide_cuda.all_gather_into_params_(shards, views[0], world_size, name, *found),
           "ag_arena": lambda: all_gather.issue_call(arena, shards, views[0], found[2], found[3], False),
           "dispatch_only": lambda: no_op(shards, views[0], world_size, name),
           "rs_in_place": rs, "rs_in_place_via_python": rs, "rs_in_place_fresh": rs_fresh,
           "rs_slot_reuse": lambda: rs(in_slot)}
    torch.ops.tide.all_gather_into_params_(shards, views[0], world_size, name)  # the plan, made and agreed
    found = arena.ext.gate_all_gather(shards, views[0], world_size, name)  # ("transport", its arena, plan, slot 0)
    res = {}
    for variant in VARIANTS:
        arena.ext.steady_enable(on=variant not in VIA_PYTHON)
        _time(fns[variant], 3)
        dist.barrier()
        before, steady_before = arena.counters(), sum(arena.ext.steady_calls().values())
        times = _time(fns[variant], iters)
        after, steady_after = arena.counters(), sum(arena.ext.steady_calls().values())
        dist.barrier()
        res[variant] = {"times": times, "cpp": {k: (after[k] - before[k]) / iters for k in CPP_KEYS},
                        "steady_share": (steady_after - steady_before) / iters}
    arena.ext.steady_enable(on=True)
    transport.disable(name)
    return res


def stock_times(world_size: int, iters: int, layout_world: int) -> dict:
    """FSDP2's ops for the group as sharded over ``layout_world`` ranks, on this process group."""
    import torch.distributed as dist

    group = dist.group.WORLD
    dev = torch.device("cuda", torch.cuda.current_device())
    shapes = group_shapes()
    W = layout_world
    shards = [torch.randn((-(-s[0] // W), *s[1:]), device=dev).to(torch.bfloat16) for s in shapes]
    inp_numels = [s.numel() for s in shards]
    total = sum(inp_numels)
    outs = [torch.empty((world_size * s.numel(),), device=dev, dtype=torch.bfloat16) for s in shards]
    grads = [torch.randn(s, device=dev).to(torch.bfloat16) for s in shapes]
    sharded_grads = [torch.zeros(s.shape, device=dev) for s in shards]
    rank = dist.get_rank()

    def ag():
        # foreach_all_gather: copy-in (cast into the flat rank-major buffer), all-gather; copy-out.
        # (what torch.ops.fsdp.all_gather_copy_in does; its signature differs between torch releases)
        ag_output = torch.empty(world_size * total, dtype=torch.bfloat16, device=dev)
        ag_input = ag_output.narrow(0, rank * total, total)
        torch._foreach_copy_(list(ag_input.split(inp_numels)), [s.view(-1) for s in shards])
        dist.all_gather_into_tensor(ag_output, ag_input, group=group)
        torch.split_with_sizes_copy(ag_output.view(world_size, -1), inp_numels, dim=1,
                                    out=[o.view(world_size, -1) for o in outs])

    def rs():
        # foreach_reduce: chunk_cat into the padded reduce buffer, reduce-scatter, per-param epilogue.
        padded = [g.view(-1)[: world_size * s.numel()] for g, s in zip(grads, shards)]
        rs_input = torch.empty(world_size * total, dtype=torch.float32, device=dev)  # fp32 reduce, as TIDE's
        torch._chunk_cat(padded, dim=0, num_chunks=world_size, out=rs_input.view(world_size, -1))
        rs_output = rs_input.new_empty(total)
        dist.reduce_scatter_tensor(rs_output, rs_input, group=group)
        rs_output.div_(W)
        offset = 0
        for sg, s in zip(sharded_grads, shards):
            sg += torch.as_strided(rs_output, size=s.shape, stride=s.stride(), storage_offset=offset)
            offset += s.numel()

    _time(ag, 3), _time(rs, 3)
    return {"stock_ag": _time(ag, iters), "stock_rs": _time(rs, iters)}


def tide_rank(rank: int, world_size: int, iters: int) -> dict:
    res = tide_times(world_size, iters)
    return res if rank == 0 else {}


def both_rank(rank: int, world_size: int, iters: int) -> dict:
    res = {**tide_times(world_size, iters), **stock_times(world_size, iters, world_size)}
    return res if rank == 0 else {}


def stock_rank(rank: int, world_size: int, iters: int, layout_world: int) -> dict:
    return stock_times(world_size, iters, layout_world)


def main(argv=None):
    from tide.launch import CUDA_RANK_ENV, run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=None, help="default: the GPU count if >= 2, else 8")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=str(default_out()))
    args = p.parse_args(argv)
    require_cuda("bench_host_time.py")
    gpus = torch.cuda.device_count()
    W = args.world_size or (gpus if gpus >= 2 else 8)
    if gpus >= W:
        res = run_ranks(both_rank, W, args.iters, backend="nccl", device_type="cuda", env=CUDA_RANK_ENV,
                        timeout=300)[0]
        mode = "one GPU per rank, stock on the same ranks (NCCL)"
    else:
        res = run_ranks(tide_rank, W, args.iters, backend="gloo", device_type="cuda", env=CUDA_RANK_ENV, timeout=300)[0]
        res.update(run_ranks(stock_rank, 1, args.iters, W, backend="nccl", device_type="cuda", env=CUDA_RANK_ENV,
                             timeout=300)[0])
        mode = f"{W} TIDE ranks sharing {gpus} GPU (gloo), stock ops on one NCCL rank"
    meta = run_meta(gpus=gpus, world_size=W, params=len(group_shapes()), mode=mode)
    rows = []
    for path in [f"tide_{v}" for v in VARIANTS] + ["stock_ag", "stock_rs"]:
        entry = res[path.removeprefix("tide_")] if path.startswith("tide_") else {"times": res[path], "cpp": {}}
        times, cpp = entry["times"], entry["cpp"]
        srt = sorted(times)
        row = {"path": path, "median_us": statistics.median(times) * 1e6, "p10_us": srt[len(srt) // 10] * 1e6,
               "p90_us": srt[(9 * len(srt)) // 10] * 1e6,
               "cpp_us": cpp.get("host_ns_total", float("nan")) / 1e3}
        row["python_us"] = row["median_us"] - row["cpp_us"]  # median call minus mean C++ part
        row["steady_share"] = entry.get("steady_share", float("nan"))  # of the calls, those that stayed in C++
        for k in CPP_KEYS[1:5]:
            row[k.replace("host_ns_", "cpp_") + "_us"] = cpp.get(k, float("nan")) / 1e3
        for k in CPP_KEYS[5:]:
            row[k + "_per_call"] = cpp.get(k, float("nan"))
        rows.append({**row, **meta})
        print(f"{path:26s} median {row['median_us']:8.1f} us (p10 {row['p10_us']:.1f}, p90 {row['p90_us']:.1f})"
              + (f"  C++ {row['cpp_us']:.0f}: kernels {row['cpp_kernel_us']:.0f}, memops {row['cpp_memop_us']:.0f}, "
                 f"copies {row['cpp_copy_us']:.0f}, events {row['cpp_event_us']:.0f}; calls: memop "
                 f"{row['memop_calls_per_call']:.0f}, copy {row['copy_api_calls_per_call']:.0f}" if cpp else ""),
              flush=True)
    out = Path(args.out)
    write_csv(out / "host_time.csv", rows)
    med = {r["path"]: r["median_us"] for r in rows}
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.2))
        ax.barh([r["path"] for r in rows], [r["median_us"] for r in rows],
                color=["tab:gray" if r["path"].startswith("stock") else "tab:green" for r in rows])
        for ref in ("stock_ag", "stock_rs"):
            ax.axvline(med[ref], color="k", lw=0.8, ls=":")
        ax.invert_yaxis()
        ax.set_xlabel("host time per call, median (us); dotted: stock AG / RS")
        ax.set_title(f"Issue cost, 60-param group, W={W}, {meta['device']}, {meta['date']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "host_time.png", dpi=120)
    print("SUMMARY host_time us (median, " + mode + "): " + ", ".join(f"{v} {med['tide_' + v]:.0f}" for v in VARIANTS)
          + f"; stock AG {med['stock_ag']:.0f}, stock RS {med['stock_rs']:.0f}")


if __name__ == "__main__":
    main()
