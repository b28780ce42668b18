"""Host time to issue one all-gather and one reduce-scatter of a 60-parameter group: TIDE vs stock FSDP2.

TIDE: W ranks (default 8, sharing the GPU when there are fewer GPUs; symmetric memory over gloo), one
``torch.ops.tide.all_gather_into_params_`` into arena-bound outputs (FSDP's zero-copy case) and one
``torch.ops.tide.reduce_scatter_params_`` (In-Place and Slot-Reuse) per iteration, timed on rank 0 from
the Python call to its return (the GPU is synchronised between iterations, outside the timed region).

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


def tide_rank(rank: int, world_size: int, iters: int) -> dict:
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
    arena = transport.enable(group, slot_bytes=layout.slot_bytes)
    grads = [torch.randn(s, device=dev).to(torch.bfloat16) for s in shapes]
    shard_grads = [torch.zeros((-(-s[0] // world_size), *s[1:]), device=dev) for s in shapes]
    res = {}

    def ag():
        outs = arena.slot_views(layout, dtypes, arena.next_slot())
        torch.ops.tide.all_gather_into_params_(shards, outs, world_size, name)

    def rs():
        torch.ops.tide.reduce_scatter_params_(grads, shard_grads, 1.0 / world_size, True, world_size, name)

    for mode in ("in_place", "slot_reuse"):
        arena.rs_mode = mode
        _time(ag, 3), _time(rs, 3)
        dist.barrier()
        res[f"tide_ag"] = _time(ag, iters)
        res[f"tide_rs_{mode}"] = _time(rs, iters)
        dist.barrier()
    # Views are made outside the op too: time the op alone with views prepared beforehand.
    views = [arena.slot_views(layout, dtypes, i) for i in range(arena.num_slots)]
    res["tide_ag_op_only"] = _time(lambda: torch.ops.tide.all_gather_into_params_(
        shards, views[arena.next_slot()], world_size, name), iters)
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
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    tide_res = run_ranks(tide_rank, args.world_size, args.iters, backend="gloo", device_type="cuda", env=ENV,
                         timeout=300)[0]
    # The same with one cudaMemcpyAsync per piece instead of one cudaMemcpyBatchAsync per push.
    loop_res = run_ranks(tide_rank, args.world_size, args.iters, backend="gloo", device_type="cuda",
                         env={**ENV, "TIDE_CE_BATCH": "0"}, timeout=300)[0]
    tide_res.update({k.replace("tide_", "tide_loop_"): v for k, v in loop_res.items()})
    stock_res = run_ranks(stock_rank, 1, args.iters, args.world_size, backend="nccl", device_type="cuda", env=ENV,
                          timeout=300)[0]
    rows = []
    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "world_size": args.world_size, "params": len(group_shapes())}
    for k, v in {**tide_res, **stock_res}.items():
        rows.append({"path": k, "median_us": statistics.median(v) * 1e6, "p10_us": sorted(v)[len(v) // 10] * 1e6,
                     "p90_us": sorted(v)[(9 * len(v)) // 10] * 1e6, **meta})
        print(f"{k:22s} median {rows[-1]['median_us']:8.1f} us  (p10 {rows[-1]['p10_us']:.1f}, p90 {rows[-1]['p90_us']:.1f})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "host_time.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.barh([r["path"] for r in rows], [r["median_us"] for r in rows], xerr=None, color="tab:blue")
        ax.set_xlabel("host time per call, median (us)")
        ax.set_title(f"Issue cost, 60-param group, W={args.world_size}, {meta['gpu']}")
        fig.tight_layout()
        fig.savefig(out / "host_time.png", dpi=120)
    except ImportError:
        pass
    med = {r["path"]: r["median_us"] for r in rows}
    print(f"SUMMARY host_time us (median): AG tide batch {med['tide_ag']:.0f} / loop {med['tide_loop_ag']:.0f} vs "
          f"stock {med['stock_ag']:.0f}; RS tide in_place batch {med['tide_rs_in_place']:.0f} / loop "
          f"{med['tide_loop_rs_in_place']:.0f}, slot_reuse batch {med['tide_rs_slot_reuse']:.0f} / loop "
          f"{med['tide_loop_rs_slot_reuse']:.0f} vs stock {med['stock_rs']:.0f}")


if __name__ == "__main__":
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    main()
