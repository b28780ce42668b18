"""Merge the plugin's per-mode results (``tests.upstream.plugin``) into one CSV row per torch release and
test: its ranks (processes, threads or none), the outcome stock and with TIDE, TIDE's FSDP2 path counts
summed over the ranks, and the one-line message of each mode. Rows of other releases, and the other mode's
columns of a release, are kept, so one mode can be run again alone.

``python -m tests.upstream.report --csv PATH RESULTS.json [...]`` then prints the pass counts per release
and mode."""
from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter
from pathlib import Path

COLUMNS = ("torch", "file", "test", "ranks", "stock", "tide", "tide_paths", "stock_message", "tide_message")


def format_paths(paths: dict) -> str:
    """``{"all_gather": {"tide": 3}, ...}`` as ``all_gather: tide=3; reduce_scatter: ...``."""
    return "; ".join(f"{kind}: " + ", ".join(f"{path}={n}" for path, n in counts.items())
                     for kind, counts in paths.items())


def merge(rows: dict[tuple, dict], results: dict) -> None:
    """Fold one mode's results into ``rows`` (keyed by torch, file, test)."""
    mode, release = results["mode"], results["torch"]
    for nodeid, record in results["tests"].items():
        file, _, test = nodeid.partition("::")
        row = rows.setdefault((release, file, test), dict.fromkeys(COLUMNS, ""))
        row.update({"torch": release, "file": file, "test": test, "ranks": record.get("ranks", ""),
                    mode: record["outcome"], f"{mode}_message": record["message"]})
        if mode == "tide":
            row["tide_paths"] = format_paths(record.get("paths", {}))


def read_csv(path: Path) -> dict[tuple, dict]:
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        return {(r["torch"], r["file"], r["test"]): r for r in csv.DictReader(f)}


def write_csv(path: Path, rows: dict[tuple, dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        for key in sorted(rows):
            writer.writerow({c: rows[key].get(c, "") for c in COLUMNS})


def summary(rows: dict[tuple, dict]) -> list[str]:
    """Per release and mode: how many of the release's tests ran and how each ended (passes split by ranks)."""
    lines = []
    for release in sorted({r["torch"] for r in rows.values()}):
        mine = [r for r in rows.values() if r["torch"] == release]
        for mode in ("stock", "tide"):
            outcomes = Counter(r[mode] for r in mine if r[mode])
            if not outcomes:
                continue
            passed = Counter(r["ranks"] for r in mine if r[mode] == "passed")
            lines.append(f"torch {release} {mode}: {outcomes.total()} of {len(mine)} tests, "
                         + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
                         + " (passed: " + ", ".join(f"{n} {k}" for k, n in sorted(passed.items())) + ")")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.upstream.report")
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("results", type=Path, nargs="+")
    args = parser.parse_args(argv)
    rows = read_csv(args.csv)
    for path in args.results:
        merge(rows, json.loads(path.read_text()))
    write_csv(args.csv, rows)
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
