"""Host time of two commits side by side: the CSVs of ``bench/bench_host_time.py`` (or
``bench/fsdp_host_overhead.py``: the seam's host CPU time per unshard and reduce) runs of each, taken
interleaved on one machine (before, after, before, after, ...), merged into one CSV with the commit and the
run, and plotted per path (every run's median, one dot each). On a shared machine the same code's median
moves by a quarter between runs; only the runs side by side say whether a change grew the host time.

    python bench/host_time_ab.py --before a4dbcdc b1.csv b2.csv --after 1a2b3c4 a1.csv a2.csv --out DIR

A run's printed output (a ``.log`` file: its lines ``<path> median <us> us (p10 <us>, p90 <us>) ...``) stands for
its CSV where only the output came back; ``--device`` and ``--mode`` then name the machine and setting.

Writes ``<--name>.csv`` and ``.png`` (default ``host_time_ab``) under ``--out`` and prints each path's median
over the runs (and their range); for the seam's runs with stock also TIDE's host time over stock's in the same
run (median and range), which load on the machine moves alike, plotted beside.
"""
from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out, pyplot, write_csv  # noqa: E402


_PRINTED = re.compile(r"^(tide_\w+)\s+median\s+([\d.]+) us \(p10 ([\d.]+), p90 ([\d.]+)\)", re.M)


def _run_rows(path: str, device: str, mode: str) -> list[dict]:
    """The TIDE rows of one run: its CSV, or the lines it printed (a ``.log``)."""
    if path.endswith(".log"):
        text = Path(path).read_text()
        return [{"path": p, "median_us": m, "p10_us": lo, "p90_us": hi, "device": device, "mode": mode}
                for p, m, lo, hi in _PRINTED.findall(text)]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and "host_cpu_us" in rows[0]:  # fsdp_host_overhead.py's: one row per op and path
        return [{"path": f"{r['path']}_{r['op']}", "median_us": r["host_cpu_us"], "device": r["setup"],
                 "mode": "seam host CPU time"} for r in rows]
    return [r for r in rows if r["path"].startswith("tide_")]


def _ratios_to_stock(rows: list[dict]) -> dict[tuple[str, str], list[float]]:
    """Per (commit, op), each run's TIDE host time over stock's (the seam's runs, whose paths are
    ``tide_<op>`` and ``stock_<op>``); empty for other runs."""
    by_run = {(r["commit"], r["run"], r["path"]): float(r["median_us"]) for r in rows}
    out: dict[tuple[str, str], list[float]] = {}
    for (commit, run, path), value in by_run.items():
        stock = by_run.get((commit, run, "stock_" + path.removeprefix("tide_")))
        if path.startswith("tide_") and stock:
            out.setdefault((commit, path.removeprefix("tide_")), []).append(value / stock)
    return out


def merged(sides: dict[str, list[str]], device: str = "", mode: str = "") -> list[dict]:
    rows = []
    for commit, paths in sides.items():
        for run, path in enumerate(paths, 1):
            rows += [{"commit": commit, "run": run, **r} for r in _run_rows(path, device, mode)]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", nargs="+", required=True, metavar=("COMMIT", "CSV"))
    p.add_argument("--after", nargs="+", required=True, metavar=("COMMIT", "CSV"))
    p.add_argument("--device", default="", help="the machine, for runs given by their printed output")
    p.add_argument("--mode", default="", help="the setting, for runs given by their printed output")
    p.add_argument("--name", default="host_time_ab", help="the outputs' file name, without extension")
    p.add_argument("--out", default=str(default_out()))
    args = p.parse_args()
    if len(args.before) < 2 or len(args.after) < 2:
        p.error("--before and --after each take a commit and at least one CSV")
    sides = {args.before[0]: args.before[1:], args.after[0]: args.after[1:]}
    rows = merged(sides, args.device, args.mode)
    out = Path(args.out)
    write_csv(out / f"{args.name}.csv", rows)
    paths = list(dict.fromkeys(r["path"] for r in rows))
    for path in paths:  # the median of the runs' medians, and their range
        runs = {c: [float(r["median_us"]) for r in rows if r["path"] == path and r["commit"] == c] for c in sides}
        print(f"{path:28s} " + "  ".join(f"{c}: {statistics.median(v):6.1f} us ({min(v):.1f}-{max(v):.1f})"
                                         for c, v in runs.items() if v))
    ratios = _ratios_to_stock(rows)
    for (commit, op), values in ratios.items():
        print(f"tide/stock {op:18s} {commit}: {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2 if ratios else 1, figsize=(14 if ratios else 10, 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1]} if ratios else None)
    ax = axes[0][0]
    for k, (commit, marker) in enumerate(zip(sides, ("o", "s"))):
        xs = [i + (k - 0.5) * 0.3 for i, path in enumerate(paths)
              for r in rows if r["path"] == path and r["commit"] == commit]
        ys = [float(r["median_us"]) for path in paths for r in rows if r["path"] == path and r["commit"] == commit]
        ax.scatter(xs, ys, marker=marker, label=f"{commit} ({len(sides[commit])} runs)")
    ax.set_xticks(range(len(paths)), [p.removeprefix("tide_") for p in paths], rotation=30, ha="right")
    ax.set_ylabel("median host time per call (us)")
    ax.set_title("\n".join(textwrap.wrap(f"runs, interleaved ({rows[0]['device']}, {rows[0]['mode']})", 110)),
                 fontsize=9)
    ax.legend()
    if ratios:  # the seam's runs: TIDE's host time over stock's in the same run, which load moves alike
        rax, ops = axes[0][1], list(dict.fromkeys(op for _, op in ratios))
        for k, (commit, marker) in enumerate(zip(sides, ("o", "s"))):
            points = [(i + (k - 0.5) * 0.3, v) for i, op in enumerate(ops) for v in ratios.get((commit, op), [])]
            rax.scatter([x for x, _ in points], [v for _, v in points], marker=marker, label=commit)
        rax.axhline(1.0, color="grey", lw=0.8)
        rax.set_xticks(range(len(ops)), ops)
        rax.set_ylabel("TIDE host time / stock's, same run")
        rax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
