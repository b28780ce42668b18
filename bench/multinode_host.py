"""Where a multi-node op's host time goes: every Python function on its path, timed.

    python bench/multinode_host.py [--device cpu|cuda] [--ranks 2] [--local-world-size 1] [--mib 1] [--reps 50]

``--ranks`` ranks emulated as nodes of ``--local-world-size`` ranks (``tide.topology``): gloo on CPU, NCCL with
one GPU per rank on CUDA (the rails as the ops pick them: direct NCCL by default). The group is the
collectives bench's, 8 bf16 parameters of ``--mib`` MiB in all, and the ops are called through
``torch.ops.tide`` as FSDP2 calls them: the all-gather, and the reduce-scatter into fp32 shards.

Each function of the path (:data:`TIMED`) is wrapped in a timer that knows which timed function called it,
so every call splits into self times: what a function spent outside the timed functions it called. The
op call's own self time is the dispatcher and whatever is not timed. Per call, on rank 0, after warm-up:
each function's calls, inclusive and self time (a wrapper costs 0.4 us per call on the CPU machine of
docs/performance.md). The all-gather's slice per piece, since removed, was found this way (figures:
docs/performance.md, "Across nodes").

Writes ``multinode_host.csv`` and ``.png`` under ``--out`` and prints one ``SUMMARY`` line.
"""
from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collectives import N_PARAMS, group_shapes  # noqa: E402
from common import default_out, pyplot, run_meta, write_csv  # noqa: E402

# (module, attribute): the functions on the ops' path, looked up through their module at call time
TIMED = (
    ("tide.ops.cuda", "_serve"),
    ("tide.ops.reference", "all_gather_into_params_"),
    ("tide.ops.reference", "reduce_scatter_params_"),
    ("tide.ops.reference", "resolve_group"),
    ("tide.ops.call_exchange", "exchange"),
    ("tide.meta.checks", "check_all_gather_into_params"),
    ("tide.meta.checks", "check_reduce_scatter_params"),
    ("tide.routes", "of"),
    ("tide.multinode.schedule", "all_gather"),
    ("tide.multinode.schedule", "reduce_scatter"),
    ("tide.multinode.schedule", "_reduce_scatter_step"),
    ("tide.multinode.settings", "pace"),
    ("tide.multinode.plans", "ag_schedule"),
    ("tide.multinode.plans", "rs_schedule"),
    ("tide.multinode.rails", "exchange"),
    ("tide.multinode.nccl_rails", "DirectRails.post"),
    ("tide.sums", "sum_rows"),
)
OP_CALL = "op call (dispatcher and untimed code)"


class Timers:
    """Inclusive and self nanoseconds and calls per label; a stack of open calls attributes a callee's
    time to its caller's inclusive time only."""

    def __init__(self) -> None:
        self.inclusive, self.own, self.calls = defaultdict(int), defaultdict(int), defaultdict(int)
        self._open: list[list] = []  # [label, start_ns, ns spent in timed callees]

    def clear(self) -> None:
        for counts in (self.inclusive, self.own, self.calls):
            counts.clear()

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            frame = [label, time.perf_counter_ns(), 0]
            self._open.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._open.pop()
                spent = time.perf_counter_ns() - frame[1]
                self.inclusive[label] += spent
                self.own[label] += spent - frame[2]
                self.calls[label] += 1
                if self._open:
                    self._open[-1][2] += spent
        return timed

    def install(self) -> None:
        for module_name, attr in TIMED:
            owner = importlib.import_module(module_name)
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, name, self.wrap(f"{module_name.removeprefix('tide.')}.{attr}", getattr(owner, name)))


def _measure(rank: int, world_size: int, local_world_size: int, mib: int, reps: int) -> dict:
    torch.set_num_threads(1)
    import tide  # noqa: F401  (registers the ops)
    from tide import topology
    from tide.meta.layout import GroupLayout

    topology.set_local_world_size(local_world_size, "multinode_host")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gn = dist.group.WORLD.group_name
    params = GroupLayout(group_shapes(mib << 20, world_size), [2] * N_PARAMS, world_size).params
    shards = [torch.randn(p.shard_numel, device=device).to(torch.bfloat16) for p in params]
    outs = [torch.empty(p.out_numel, device=device, dtype=torch.bfloat16) for p in params]
    grads = [torch.randn(p.shape, device=device).to(torch.bfloat16) for p in params]
    shard_grads = [torch.empty((p.shard_rows, *p.shape[1:]), device=device) for p in params]
    ops = {"all_gather": lambda: torch.ops.tide.all_gather_into_params_(shards, outs, world_size, gn),
           "reduce_scatter": lambda: torch.ops.tide.reduce_scatter_params_(grads, shard_grads, 1.0 / world_size,
                                                                           False, world_size, gn)}
    timers = Timers()
    timers.install()
    result = {}
    for name, call in ops.items():
        call = timers.wrap(OP_CALL, call)
        for _ in range(5):
            call()
        sync()
        dist.barrier()
        timers.clear()
        for _ in range(reps):
            call()
        sync()
        result[name] = {label: (timers.calls[label] / reps, timers.inclusive[label] / reps / 1e3,
                                timers.own[label] / reps / 1e3) for label in timers.calls}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--local-world-size", type=int, default=1)
    ap.add_argument("--mib", type=int, default=1, help="the group's all-gather output per call, MiB")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=default_out())
    args = ap.parse_args()
    if args.ranks % args.local_world_size or args.ranks // args.local_world_size < 2:
        raise SystemExit("multinode_host: --ranks must be a multiple of --local-world-size, with 2+ nodes")
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"multinode_host: --device cuda needs one GPU per rank: {args.ranks} ranks, "
                         f"{torch.cuda.device_count()} GPUs")
    from tide.launch import run_ranks

    cuda = args.device == "cuda"
    result = run_ranks(_measure, args.ranks, args.local_world_size, args.mib, args.reps, timeout=900,
                       backend="nccl" if cuda else "gloo", device_type=args.device)[0]
    nodes = args.ranks // args.local_world_size
    meta = run_meta(host=platform.processor() or platform.machine(), device_kind=args.device, ranks=args.ranks,
                    nodes=nodes, local_size=args.local_world_size, mib=args.mib, reps=args.reps)
    rows = [{"op": op, "function": label, "calls_per_op": calls, "inclusive_us": inclusive, "self_us": own, **meta}
            for op, by in result.items() for label, (calls, inclusive, own) in by.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "multinode_host.csv", rows)
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, op in zip(axes, result):
            sel = sorted((r for r in rows if r["op"] == op), key=lambda r: r["self_us"])
            ax.barh([r["function"] for r in sel], [r["self_us"] for r in sel])
            ax.set_xlabel("self time per op call (us, rank 0)")
            ax.set_title(f"{op}: {result[op][OP_CALL][1]:.0f} us per call")
            ax.tick_params(axis="y", labelsize=7)
        fig.suptitle(f"multi-node ops' host time, {args.device}, {nodes} nodes x {args.local_world_size}, "
                     f"{args.mib} MiB")
        fig.tight_layout()
        fig.savefig(args.out / "multinode_host.png", dpi=120)

    def top(op: str) -> str:
        by = result[op]
        worst = sorted(((own, label) for label, (_, _, own) in by.items()), reverse=True)[:3]
        return f"{op} {by[OP_CALL][1]:.0f} us (self: " + ", ".join(f"{label} {own:.0f}" for own, label in worst) + ")"

    print(f"SUMMARY multinode_host ({args.device}, {nodes} x {args.local_world_size}, {args.mib} MiB): "
          + "; ".join(top(op) for op in result))


if __name__ == "__main__":
    main()
