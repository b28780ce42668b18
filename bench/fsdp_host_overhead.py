"""Host (CPU) time of the FSDP2 seam vs stock FSDP2, per unshard and per reduce of a 60-parameter group.

    python bench/fsdp_host_overhead.py [--reps 300] [--dim 16] [--device cpu|cuda]

2 ranks. One ``fully_shard`` group of 30 ``Linear(dim, dim)`` layers (60 parameters) below an FSDP root,
bf16 params with fp32 reduce. Timed per call, on rank 0, medians over ``--reps``:

* unshard: ``FSDPParamGroup.unshard()`` + ``wait_for_unshard()`` (-> ``foreach_all_gather`` and
  ``foreach_all_gather_copy_out``, plus FSDP's own bookkeeping, identical for both);
* reduce: ``foreach_reduce`` on fresh unsharded bf16 gradients (the seam's entry point).

Stock and TIDE calls alternate (ABBA order) in one process per rank (the stock group is simply not opted in), so
background load on the machine affects both alike.

``total`` is the wall time of the call, ``collective`` the time inside the collective itself (stock: the
comm object's call, timed by a delegating comm; TIDE: the seam's ``all_gather_into_outputs`` /
``reduce_scatter_into_shards`` hooks), and ``host = total - collective`` is the Python/launch path that
surrounds the collective: what the seam adds or removes. ``host cpu`` counts the calling thread's CPU
time (robust when 2 ranks share 2 cores and a rank gets descheduled), ``host wall`` the wall clock.

``--device cpu`` (gloo): the TIDE collective is the reference backend (one gloo call per parameter), so only
``host`` compares like with like. ``--device cuda``: TIDE's group is bound into its arena's slots, so each
call after the first is the steady call (a slot taken, outputs bound, the op's C++ kernel); the GPU is
synchronised after each step, outside the timed calls. Stock runs there only with a GPU per rank (NCCL);
ranks that share one GPU (gloo, symmetric memory) time TIDE alone, whose before/after runs
``bench/host_time_ab.py`` compares.

Writes under ``--out`` (default bench/out/): fsdp_host_overhead.csv and .png and prints the table.
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _pg
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

import tide.fsdp
from tide.fsdp import seam
from tide.launch import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out, pyplot, require_cuda  # noqa: E402
N_LAYERS = 30  # weight + bias each: 60 parameters in the group


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


class _Timer:
    """Accumulates wall and thread-CPU seconds spent inside the wrapped calls."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            w0, c0 = _now()
            try:
                return fn(*args, **kwargs)
            finally:
                w1, c1 = _now()
                self.wall += w1 - w0
                self.cpu += c1 - c0
        return timed


class TimedAllGather(DefaultAllGather):
    def __init__(self, timer):
        self.timer = timer

    def __call__(self, *args, **kwargs):
        return self.timer.wrap(super().__call__)(*args, **kwargs)


class TimedReduceScatter(DefaultReduceScatter):
    def __init__(self, timer):
        self.timer = timer

    def __call__(self, *args, **kwargs):
        return self.timer.wrap(super().__call__)(*args, **kwargs)


def _model(dim: int, use_tide: bool, timer: _Timer, device: torch.device):
    """The timed group (the layers) below an FSDP root of its own: a group that reshards after forward and
    has no FSDP module below it, which TIDE binds into its arena's slots on CUDA."""
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(N_LAYERS))).to(device)
    model = nn.Sequential(layers, nn.Linear(dim, dim, device=device))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(layers, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if use_tide:  # timed through the seam's hooks (bench_rank): a comm of the user's own would take stock
        tide.fsdp.enable(model)
    else:
        layers.set_custom_all_gather(TimedAllGather(timer))
        layers.set_custom_reduce_scatter(TimedReduceScatter(timer))
    model(torch.randn(2, dim, device=device)).sum().backward()  # lazy init, streams, the arena, first allocation
    return model, layers


class _Path:
    """One model (stock or TIDE) and the per-call samples of its layers' unshard and reduce."""

    def __init__(self, dim: int, use_tide: bool, device: torch.device):
        self.timer = _Timer()
        self.device = device
        self.model, layers = _model(dim, use_tide, self.timer, device)
        (self.group,) = tide.fsdp.param_groups(layers)
        assert len(self.group.fsdp_params) == 2 * N_LAYERS
        self.samples = {"unshard": [], "reduce": []}  # (total wall, collective wall, total cpu, collective cpu)

    def timed(self, op, fn):
        self.timer.wall = self.timer.cpu = 0.0
        w0, c0 = _now()
        fn()
        w1, c1 = _now()
        self.samples[op].append((w1 - w0, self.timer.wall, c1 - c0, self.timer.cpu))

    def step(self, stream) -> None:
        g = self.group

        def unshard():
            g.unshard()
            g.wait_for_unshard()

        self.timed("unshard", unshard)
        g.reshard()
        grads = [torch.randn(p._orig_size, dtype=torch.bfloat16, device=self.device) for p in g.fsdp_params]
        for p in g.fsdp_params:
            p.sharded_param.grad = None
        self.timed("reduce", lambda: _pg.foreach_reduce(
            g.fsdp_params, grads, g._reduce_scatter_process_group, stream, g._reduce_scatter_comm,
            torch.float32, torch.float32, g.device, None, None, stream, True, None, None, False))
        if self.device.type == "cuda":  # the next step's calls find the GPU idle, as the first did
            torch.cuda.synchronize()

    def medians(self) -> dict:
        med = statistics.median
        return {op: {"host_cpu_us": med(tc - cc for _, _, tc, cc in rows) * 1e6,
                     "host_wall_us": med(tw - cw for tw, cw, _, _ in rows) * 1e6,
                     "collective_wall_us": med(cw for _, cw, _, _ in rows) * 1e6,
                     "total_wall_us": med(tw for tw, _, _, _ in rows) * 1e6}
                for op, rows in self.samples.items()}


def bench_rank(rank: int, world_size: int, dim: int, reps: int, device_type: str = "cpu",
               with_stock: bool = True) -> dict:
    """Stock and TIDE calls alternate (ABBA), so load on the machine and the previous call's cache
    footprint hit both alike."""
    torch.set_num_threads(1)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    paths = {"stock": _Path(dim, False, device)} if with_stock else {}
    paths["tide"] = _Path(dim, True, device)
    # Time TIDE's collective through the seam's hook functions (stock's: through its timed comm objects).
    hooks = {name: getattr(seam, name) for name in ("all_gather_into_outputs", "reduce_scatter_into_shards")}
    for name, fn in hooks.items():
        setattr(seam, name, paths["tide"].timer.wrap(fn))
    stream = torch.cuda.Stream() if device.type == "cuda" else torch.cpu.current_stream()
    tide.reset_stats()
    try:
        order = list(paths.values())
        for _ in range(reps):
            for path in order:
                path.step(stream)
            order.reverse()  # ABBA: each path follows each other path equally often
    finally:
        for name, fn in hooks.items():
            setattr(seam, name, fn)
    stats = tide.stats()["fsdp"]
    # The stock group was never opted in: the seam hands every one of its calls to stock FSDP2.
    for kind in ("all_gather", "reduce_scatter"):
        assert stats[kind] == ({"stock:not_enabled": reps} if with_stock else {}) | {"tide": reps}, stats
    if device.type == "cuda":
        assert tide.stats()["wiring"].get("ag:bound") == reps, tide.stats()["wiring"]
    return {name: path.medians() for name, path in paths.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", type=Path, default=default_out(), help="output folder")
    args = p.parse_args(argv)
    backend, with_stock, where = "gloo", True, "CPU, gloo"
    if args.device == "cuda":
        require_cuda("fsdp_host_overhead.py")
        # NCCL, which stock needs, takes one GPU per rank; ranks that share one time TIDE alone.
        with_stock = torch.cuda.device_count() >= 2
        backend = "nccl" if with_stock else "gloo"
        where = f"{torch.cuda.get_device_name(0)}, {backend}"
    result = run_ranks(bench_rank, 2, args.dim, args.reps, args.device, with_stock, backend=backend,
                       device_type=args.device, timeout=900)[0]
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    cols = ("host_cpu_us", "host_wall_us", "collective_wall_us", "total_wall_us")
    rows = [(op, path, *(r[op][c] for c in cols)) for op in ("unshard", "reduce") for path, r in result.items()]
    meta = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d')}, 2 ranks ({where}), 60 params of {args.dim}x{args.dim}/{args.dim}, "
            f"{args.reps} reps")
    with open(out / "fsdp_host_overhead.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["op", "path", *cols, "setup"])
        for row in rows:
            w.writerow([*row[:2], *(f"{v:.1f}" for v in row[2:]), meta])
    print(f"FSDP2 seam host time ({meta}), medians in microseconds")
    print(f"{'op':8s} {'path':6s} {'host cpu':>9s} {'host wall':>10s} {'collective':>11s} {'total':>9s}")
    for op, path, *vals in rows:
        print(f"{op:8s} {path:6s} " + " ".join(f"{v:{w}.1f}" for v, w in zip(vals, (9, 10, 11, 9))))

    plt = pyplot()
    if plt is None:
        return 0
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ops = ["unshard", "reduce"]
    width = 0.35
    for i, path in enumerate(result):
        ax.bar([x + (i - 0.5) * width for x in range(len(ops))], [result[path][op]["host_cpu_us"] for op in ops], width,
               label=path)
    ax.set_xticks(range(len(ops)), ops)
    ax.set_ylabel("host CPU time per call, median (µs)")
    ax.set_title(f"FSDP2 seam host time, 60-param group ({where}, 2 ranks)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fsdp_host_overhead.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
