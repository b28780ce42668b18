"""Lease probe: can an all-gather slot be leased from the caching allocator for one
phase of a step, and written there by a peer's copy engine?

docs/design.md ("The leased data region") took its design from these answers (first with the
probe's own ctypes IPC calls; it now uses the extension's). Two ranks, one GPU each. Each phase,
every rank allocates a slot from torch's caching allocator, exports the allocator segment that holds
it with legacy CUDA IPC (the extension's ``ipc_export``, as the arena's leases do: torch does not learn
that the block is shared, so freeing it never parks it in torch's IPC limbo), names handle and offset
through the store, maps the peer's segment unless it already has that handle mapped, pushes into the
peer's slot with ``cuMemcpyDtoDAsync`` (a copy engine), checks what its own slot received, then frees
the slot and allocates an "activation" of the same size. One row per rank and phase:

- ``same_address`` / ``same_handle``: the allocator handed back the previous phase's block, in the same
  segment, so the peer's mapping still holds and nothing is mapped again;
- ``peer_map_ms``: the host time of ``cudaIpcOpenMemHandle`` (``ipc_open``) when the peer's handle is new
  (0 when mapped);
- ``push_gbps``: the push into the mapped lease, both ranks at once (a W = 2 all-gather's busbw);
- ``landed``: the peer's bytes are in this rank's slot, and the rest of the slot is untouched;
- ``activation_reuses_block`` / ``reserved_growth_mib``: the freed slot serves the activation without
  growing reserved memory.

A last row per rank: ``torch.cuda.empty_cache()`` while the peer still maps the segment (host time, and
the device memory it freed), then the memory freed once the peer has closed its mapping.

Writes ``lease_probe.csv`` and ``.png`` under ``--out``; needs 2 GPUs.
"""
from __future__ import annotations

import argparse
import ctypes
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out, pyplot, require_cuda, run_meta, write_csv  # noqa: E402

MiB = 1 << 20
COLUMNS = ("rank", "phase", "same_address", "same_handle", "peer_map_ms", "push_gbps", "landed",
           "activation_reuses_block", "reserved_growth_mib", "empty_cache_ms", "freed_by_empty_cache_mib",
           "freed_after_peer_close_mib")


class _Copier:
    """A copy-engine push between raw device addresses (``cuMemcpyDtoDAsync`` from libcuda through ctypes:
    torch has no tensor over a peer's mapped segment). The IPC calls are the extension's own
    (csrc/transport/ipc.h), the ones the arena's leases use."""

    def __init__(self) -> None:
        u64 = ctypes.c_uint64
        self._fn = ctypes.CDLL("libcuda.so.1").cuMemcpyDtoDAsync_v2
        self._fn.argtypes, self._fn.restype = [u64, u64, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_int

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        rc = self._fn(dst, src, nbytes, stream)
        if rc != 0:
            raise RuntimeError(f"lease_probe: cuMemcpyDtoDAsync failed with CUresult {rc}")


def _value(rank: int, phase: int) -> int:
    """The byte rank ``rank`` pushes in ``phase`` (never 0, the slot's fill)."""
    return 1 + (37 * rank + 11 * phase) % 250


def _rank(rank: int, world: int, slot_mib: int, push_mib: int, phases: int, reps: int) -> list[dict]:
    from tide import extension

    ext = extension.load()
    dev = torch.device("cuda", torch.cuda.current_device())
    copier = _Copier()
    store = dist.distributed_c10d._get_default_store()
    peer = 1 - rank
    src = torch.empty(push_mib * MiB, dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream(dev)
    mapped: dict[bytes, int] = {}  # the peer's segment handles -> their base in this process
    rows, previous = [], (None, None)
    for k in range(phases):
        slot = torch.zeros(slot_mib * MiB, dtype=torch.uint8, device=dev)
        handle, offset, error = ext.ipc_export(tensor=slot)
        if error:
            raise RuntimeError(f"lease_probe: the slot's segment cannot be exported: {error}")
        store.set(f"lease_probe/{k}/{rank}", pickle.dumps((handle, offset)))
        peer_handle, peer_offset = pickle.loads(store.get(f"lease_probe/{k}/{peer}"))
        map_ms = 0.0
        if peer_handle not in mapped:
            t = time.perf_counter()
            mapped[peer_handle] = ext.ipc_open(handle=peer_handle, device=dev.index)
            map_ms = (time.perf_counter() - t) * 1e3
        dst = mapped[peer_handle] + peer_offset
        src.fill_(_value(rank, k))
        torch.cuda.synchronize(dev)
        dist.barrier()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            copier.copy(dst, src.data_ptr(), src.numel(), stream.cuda_stream)
            b.record(stream)
            b.synchronize()
            times.append(a.elapsed_time(b))
        dist.barrier()  # every push into every slot has landed
        # Min and max of each part (no slot-sized temporary, which would add a segment of its own).
        lo, hi = torch.aminmax(slot[:src.numel()])
        landed = lo.item() == hi.item() == _value(peer, k) and slot[src.numel():].max().item() == 0
        address = slot.data_ptr()
        reserved = torch.cuda.memory_reserved(dev)
        del slot  # the lease ends: back to the allocator
        activation = torch.empty(slot_mib * MiB, dtype=torch.uint8, device=dev)
        rows.append({"rank": rank, "phase": k, "same_address": address == previous[0],
                     "same_handle": handle == previous[1], "peer_map_ms": map_ms,
                     "push_gbps": src.numel() / statistics.median(times) / 1e6, "landed": landed,
                     "activation_reuses_block": activation.data_ptr() == address,
                     "reserved_growth_mib": (torch.cuda.memory_reserved(dev) - reserved) / MiB})
        previous = (address, handle)
        del activation
        dist.barrier()  # no peer pushes into a lease before its next exchange
    free0 = torch.cuda.mem_get_info(dev)[0]
    t = time.perf_counter()
    torch.cuda.empty_cache()  # the peer still maps this rank's segment
    empty_ms = (time.perf_counter() - t) * 1e3
    free1 = torch.cuda.mem_get_info(dev)[0]
    dist.barrier()
    for base in mapped.values():
        ext.ipc_close(base=base, device=dev.index)
    torch.cuda.synchronize(dev)
    dist.barrier()
    free2 = torch.cuda.mem_get_info(dev)[0]
    rows.append({"rank": rank, "phase": "empty_cache", "empty_cache_ms": empty_ms,
                 "freed_by_empty_cache_mib": (free1 - free0) / MiB,
                 "freed_after_peer_close_mib": (free2 - free1) / MiB})
    return [{c: r.get(c) for c in COLUMNS} for r in rows]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slot-mib", type=int, default=464, help="slot size (the 8B block's slot: 464 MiB)")
    p.add_argument("--push-mib", type=int, default=256)
    p.add_argument("--phases", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(default_out()))
    args = p.parse_args(argv)
    require_cuda("lease_probe.py", gpus=2)
    if args.push_mib > args.slot_mib:
        raise SystemExit("lease_probe.py: --push-mib must not exceed --slot-mib")
    from tide.launch import CUDA_RANK_ENV, run_ranks

    per_rank = run_ranks(_rank, 2, args.slot_mib, args.push_mib, args.phases, args.reps, backend="nccl",
                         device_type="cuda", env=CUDA_RANK_ENV, timeout=300)
    meta = run_meta(gpus=2, ranks=2, slot_mib=args.slot_mib, push_mib=args.push_mib)
    rows = [{**r, **meta} for rank_rows in per_rank for r in rank_rows]
    out = Path(args.out)
    write_csv(out / "lease_probe.csv", rows)
    phases = [r for r in rows if r["phase"] != "empty_cache"]
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        for rank in (0, 1):
            mine = [r for r in phases if r["rank"] == rank]
            axes[0].plot([r["phase"] for r in mine], [r["push_gbps"] for r in mine], "o-", label=f"rank {rank}")
            axes[1].plot([r["phase"] for r in mine], [r["peer_map_ms"] for r in mine], "o-", label=f"rank {rank}")
        axes[0].set_ylabel("push into the leased slot (GB/s)")
        axes[1].set_ylabel("mapping the peer's lease (ms)")
        for ax in axes:
            ax.set_xlabel("lease phase")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"Slot leases from the caching allocator, {meta['device']}, {meta['date']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "lease_probe.png", dpi=120)
    later = [r for r in phases if r["phase"]]
    maps = [f"{r['peer_map_ms']:.2f} ms (rank {r['rank']}, phase {r['phase']})" for r in phases if r["peer_map_ms"]]
    parts = [f"landed {all(r['landed'] for r in phases)}",
             f"same address after phase 0 {all(r['same_address'] for r in later)}",
             f"same handle after phase 0 {all(r['same_handle'] for r in later)}",
             "mapped " + (", ".join(maps) or "never"),
             f"push {statistics.median(r['push_gbps'] for r in phases):.0f} GB/s",
             f"activation reuses the block {all(r['activation_reuses_block'] for r in phases)}",
             f"reserved growth {max(r['reserved_growth_mib'] for r in phases):.0f} MiB"]
    parts += [f"empty_cache while mapped: rank {r['rank']} {r['empty_cache_ms']:.1f} ms, freed "
              f"{r['freed_by_empty_cache_mib']:.0f} MiB, +{r['freed_after_peer_close_mib']:.0f} after the peer closed"
              for r in rows if r["phase"] == "empty_cache"]
    print("SUMMARY lease_probe: " + "; ".join(parts))

if __name__ == "__main__":
    main()
