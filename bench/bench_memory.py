"""Peak live bytes during one layer's backward: stock FSDP2 vs TIDE In-Place vs TIDE Slot-Reuse, in NS.

Model: the Llama-like model of ``tide.models`` with a large ``dim`` (Llama proportions: 128-wide heads,
``ffn_dim`` = 8/3 dim rounded to 256), ``--layers`` blocks (default 3), vocab 256 and 2 x 16 tokens, so
the root group (embedding, final norm, head) and the activations are small next to one block. Every block
and the root are ``fully_shard``-ed with bf16 params / fp32 reduce, ``reshard_after_forward=True`` and
explicit forward/backward prefetch of the neighbouring block. ``--ranks`` ranks (default 8) share the GPU
(gloo + symmetric memory) unless there is one GPU per rank (NCCL).

**What is counted** (per rank, the step after one warm-up step; the layer is the *last* block, the first
one backward reaches, while the previous block is prefetched):

    live = max_memory_allocated(window) - memory_allocated(window start) + TIDE's symmetric memory

* window: from just before ``loss.backward()`` to the return of the last block's FSDP ``post_backward``
  (its unshard, the prefetch of the block before it, its backward, its reshard and the issue of its
  reduce-scatter, with every buffer those allocate); ``reset_peak_memory_stats`` at the window start.
* ``memory_allocated(window start)``: everything live before the window - sharded params, optimizer
  state, saved activations, the root group's unsharded params (allocator memory in all three variants:
  TIDE gathers the root's outputs in place, outside the arena). No block is unsharded then
  (``reshard_after_forward=True``; the script checks it). The window also holds the root's head
  gradients (vocab x dim, ~0.5 % of NS here), counted as they are.
* ``arena_bytes``: TIDE's arena (flag words, K = 2 all-gather slots sized for the largest block, the
  reduce-scatter staging ring, 64 MiB by default). The flag words are symmetric memory, outside
  ``max_memory_allocated``, and added; the slots and ring are leased from the caching allocator for
  backward (tide/transport/lease.py), so the window's peak holds them already. ``alloc_ns`` is the
  window's peak less that lease: what else the allocator holds. The CSV also gives
  ``live_ns_arena_amortized`` (arena divided by the groups sharing it), an accounting view only.
* NS: the layer's bf16 unsharded bytes (2 x the block's parameter count).
* Slot-Reuse moves each gradient into its own parameter's slot region as autograd finishes it (the
  seam's post-accumulate-grad hooks), so the block's gradients occupy no allocator memory; the CSV's
  ``grads_into_slot`` counts the gradients moved in the measured step.
* G, the fp32 sharded gradients the reduce writes (``grad_shard_bytes``), is 2/W NS: the rank count
  matters (``--ranks``; 8 = one NVLink domain of 8 GPUs, the design's target).

Nothing is estimated: every number comes from the allocator's counters and the arena's sizes.
Writes ``memory.csv`` and ``memory.png`` under ``--out`` and prints one ``SUMMARY memory`` line.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out, pyplot, require_cuda, run_meta, write_csv  # noqa: E402

VARIANTS = (("stock", None), ("tide_in_place", "in_place"), ("tide_slot_reuse", "slot_reuse"))
TARGETS = {"stock": 4.0, "tide_in_place": 3.75, "tide_slot_reuse": 2.3}  # from the issue (x NS)


def _cfg(dim: int, layers: int):
    from tide.models import LlamaConfig

    ffn = -(-int(dim * 8 / 3) // 256) * 256
    return LlamaConfig(vocab=256, dim=dim, n_layers=layers, n_heads=max(1, dim // 128), ffn_dim=ffn, seq_len=16)


def _measure(rank: int, world_size: int, dim: int, layers: int, name: str, rs_mode: str | None) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import tide.fsdp
    from tide import transport
    from tide.fsdp import compat
    from tide.models import batch, loss_fn
    from tide.train import fsdp_model, train_step

    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = _cfg(dim, layers)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fsdp_model(cfg, device=dev, mp_policy=mp, use_tide=rs_mode is not None, rs_mode=rs_mode or "in_place",
                       prefetch=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, optim, cfg, 0, rank, device=dev)  # warm-up: lazy init, arena, first-bind allocations
    last = model.layers[-1]
    group = compat.param_groups(last._get_fsdp_state())[0]
    block_groups = [compat.param_groups(b._get_fsdp_state())[0] for b in model.layers]
    ns = 2 * sum(p.numel() for p in last.parameters())
    grad_shard = 4 * sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)

    window = {}
    orig_post_backward = group.post_backward

    def post_backward(*args, **kwargs):
        out = orig_post_backward(*args, **kwargs)
        if "peak" not in window:  # the first call ends the window (a root final callback may call it again)
            window["peak"] = torch.cuda.max_memory_allocated(dev)
            window["end"] = torch.cuda.memory_allocated(dev)
        return out

    group.post_backward = post_backward
    tide.reset_stats()
    tokens, targets = batch(cfg, 1, rank, device=dev)
    loss = loss_fn(model(tokens), targets)
    torch.cuda.synchronize(dev)
    unsharded_blocks = sum(1 for g in block_groups if g.is_unsharded)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    loss.backward()
    torch.cuda.synchronize(dev)
    del group.post_backward
    window_end = "last_block_post_backward" if "peak" in window else "backward_end"
    window.setdefault("peak", torch.cuda.max_memory_allocated(dev))  # only if FSDP bypassed the wrapper
    optim.step()
    optim.zero_grad(set_to_none=True)
    torch.cuda.synchronize(dev)

    arena_bytes = symmetric = leased = slot_bytes = ring_bytes = 0
    groups_sharing = 1
    if rs_mode is not None:
        arena = transport.get(group._all_gather_process_group.group_name)
        arena_bytes, slot_bytes = arena.flags_bytes + arena.data_bytes, arena.num_slots * arena.slot_bytes
        ring_bytes = arena.data_bytes - arena.ring_off
        symmetric = arena.symmetric_bytes
        leased = arena.data_bytes if arena.leases.mode == "allocator" else 0  # in the window's allocator peak
        groups_sharing = len(tide.fsdp.param_groups(model))
    stats, arena_stats = tide.stats()["fsdp"], tide.stats()["wiring"]
    if rs_mode is not None:
        tide.fsdp.disable(model)
    del model, optim, loss
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    dist.barrier()
    peak = window["peak"] - base
    return {
        "rank": rank, "world_size": world_size, "dim": dim, "ffn_dim": cfg.ffn_dim, "layers": layers,
        "variant": name, "ns_bytes": ns, "base_bytes": base, "peak_alloc_bytes": window["peak"],
        "window_alloc_bytes": peak, "arena_bytes": arena_bytes, "slot_bytes_total": slot_bytes,
        "ring_bytes": ring_bytes, "grad_shard_bytes": grad_shard,
        "live_ns": (peak + symmetric) / ns, "alloc_ns": (peak - leased) / ns, "arena_ns": arena_bytes / ns,
        "grad_shard_ns": grad_shard / ns,
        "live_ns_arena_amortized": (peak - leased + arena_bytes / groups_sharing) / ns,
        "unsharded_blocks_at_start": unsharded_blocks, "window_end": window_end, "fsdp_stats": str(stats),
        "arena_stats": str(arena_stats),
        "grads_into_slot": arena_stats.get("rs:grad_into_slot", 0),
        "target_ns": TARGETS[name],
    }


def _rank(rank: int, world_size: int, dims: list, layers: int, stock_max_dim: int) -> list:
    rows = []
    for dim in dims:
        for name, rs_mode in VARIANTS:
            if rs_mode is None and dim > stock_max_dim:
                continue
            row = _measure(rank, world_size, dim, layers, name, rs_mode)
            rows.append(row)
            if rank == 0:
                print(f"dim {dim:5d} {name:16s} live {row['live_ns']:.3f} NS (alloc {row['alloc_ns']:.3f} + arena "
                      f"{row['arena_ns']:.3f}), NS {row['ns_bytes'] / 2**20:.1f} MiB  {row['arena_stats']}", flush=True)
    return rows


def report(rows: list[dict], dims: list[int], ranks: int, backend: str, meta: dict, out: Path) -> None:
    """Plot rank 0's rows to ``memory.png`` and print the ``SUMMARY memory`` line; a variant may lack
    some dims (stock beyond ``--stock-max-dim``) or all of them."""
    rank0 = [r for r in rows if r["rank"] == 0]
    plt = pyplot()
    if plt is not None:
        _plot(plt, rank0, dims, ranks, backend, meta, out)
    parts = []
    for d in dims:
        vals = {r["variant"]: r["live_ns"] for r in rank0 if r["dim"] == d}
        parts.append(f"dim {d}: " + " ".join(f"{name.removeprefix('tide_')} {vals[name]:.2f}" for name, _ in VARIANTS
                                             if name in vals))
    print(f"SUMMARY memory (x NS, peak live in the last block's backward, arena in full, W={ranks}, rank 0): "
          + "; ".join(parts))


def _plot(plt, rank0: list[dict], dims: list[int], ranks: int, backend: str, meta: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.27
    for k, (name, _) in enumerate(VARIANTS):
        ran = [i for i, d in enumerate(dims) if any(r["dim"] == d and r["variant"] == name for r in rank0)]
        if not ran:  # e.g. stock left out by --stock-max-dim
            continue
        xs = [i + (k - 1) * width for i in ran]
        vals = [next(r["live_ns"] for r in rank0 if r["dim"] == dims[i] and r["variant"] == name) for i in ran]
        arena = [next(r["arena_ns"] for r in rank0 if r["dim"] == dims[i] and r["variant"] == name) for i in ran]
        bars = ax.bar(xs, vals, width, label=f"{name} (target {TARGETS[name]})")
        ax.bar(xs, arena, width, bottom=[v - a for v, a in zip(vals, arena)], fill=False, hatch="//",
               edgecolor=bars.patches[0].get_facecolor(), linewidth=0)
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(dims)))
    ax.set_xticklabels([f"dim {d}\nNS {next(r['ns_bytes'] for r in rank0 if r['dim'] == d) / 2**20:.0f} MiB"
                        for d in dims], fontsize=8)
    ax.set_ylabel("peak live bytes / NS (hatched: arena)")
    ax.legend(fontsize=7)
    ax.set_title(f"last block's backward, W={ranks} ({backend}), {meta['device']}, torch {meta['torch']}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="1024,2048,4096", help="comma-separated model dims (one block size each)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--stock-max-dim", type=int, default=4096,
                   help="stock FSDP2 only up to this dim (ranks sharing a GPU run stock over gloo, "
                        "slow for large blocks)")
    p.add_argument("--ranks", type=int, default=8, help="ranks (8: one NVLink domain of 8 GPUs)")
    p.add_argument("--out", default=str(default_out()))
    args = p.parse_args(argv)
    from tide.launch import CUDA_RANK_ENV, run_ranks

    require_cuda("bench_memory.py")
    dims = [int(d) for d in args.dims.split(",")]
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= args.ranks else "gloo"
    per_rank = run_ranks(_rank, args.ranks, dims, args.layers, args.stock_max_dim, backend=backend, device_type="cuda",
                         env=CUDA_RANK_ENV, timeout=540)
    meta = run_meta(gpus=gpus, ranks=args.ranks, backend=backend)
    rows = [{**r, **meta} for pr in per_rank for r in pr]
    out = Path(args.out)
    write_csv(out / "memory.csv", rows)
    report(rows, dims, args.ranks, backend, meta, out)


if __name__ == "__main__":
    main()
