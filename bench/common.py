"""What every benchmark script shares: CUDA timing, run metadata, the CSV writer and the plot backend.

Benchmarks write under ``--out``, by default ``bench/out/`` (ignored by git): the committed results in
``bench/results/`` (each benchmark's current CSV/PNG, reproduced as docs/gpu_runs.md says) are copied
there by hand, never overwritten by a local run.
"""
from __future__ import annotations

import csv
import datetime
import statistics
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch



def default_out() -> Path:
    return Path(__file__).resolve().parent / "out"


def require_cuda(script: str, gpus: int = 1) -> None:
    """Exit with one line (status 2) when this machine lacks the GPUs ``script`` needs."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < gpus:
        print(f"{script}: needs {gpus} CUDA GPU{'s' if gpus > 1 else ''}; this machine has {have}", file=sys.stderr)
        raise SystemExit(2)


def cuda_ms(fn: Callable[[], object], stream: torch.cuda.Stream | None = None) -> float:
    """Milliseconds of one call of ``fn`` on ``stream`` (default: the current one), by CUDA events."""
    stream = stream or torch.cuda.current_stream()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    fn()
    b.record(stream)
    b.synchronize()
    return a.elapsed_time(b)


def median_cuda_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(cuda_ms(fn) for _ in range(reps))


def run_meta(**extra) -> dict:
    """Date, device and versions, added as columns to every CSV row."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"date": datetime.date.today().isoformat(), "device": device, "torch": torch.__version__,
            "cuda": torch.version.cuda, **extra}


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (with a note) when matplotlib is missing:
    the CSV is written either way."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: CSV only, no PNG (pip install matplotlib)", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log2_axes(axes, xlabel: str, ylabels: Sequence[str | None], titles: Sequence[str] = (), legend_size: int = 7):
    """The sweep plots' axes: log2 x, labels (a None y label keeps the one set), optional titles, grid, legend."""
    for i, ax in enumerate(axes):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        if ylabels[i] is not None:
            ax.set_ylabel(ylabels[i])
        if titles:
            ax.set_title(titles[i])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=legend_size)


def gpu_events(prof) -> list[dict]:
    """The CUDA events of a ``torch.profiler`` run, by start: stream, kind (copy, memset or kernel), name, start
    and duration in us, the first at 0."""
    rows = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        kind = "copy" if "memcpy" in name else "memset" if "memset" in name else "kernel"
        rows.append({"stream": int(e.device_resource_id or 0), "kind": kind, "name": e.name[:60],
                     "start": float(e.time_range.start), "dur": float(e.time_range.end - e.time_range.start)})
    t0 = min((r["start"] for r in rows), default=0.0)
    for r in rows:
        r["start"] -= t0
    return sorted(rows, key=lambda r: r["start"])


def union_intervals(intervals) -> list[tuple[float, float]]:
    """``intervals`` ((start, end) pairs) merged where they overlap, in order."""
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged
