"""bench/multinode_host.py runs on CPU: both ops in both modes, a CSV row each, a SUMMARY line."""
import csv
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "multinode_host.py"


def test_measures_both_ops_in_both_modes(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--reps", "6", "--out", str(tmp_path)], check=True,
                          capture_output=True, text=True, timeout=300)
    assert "SUMMARY multinode_host (CPU, 2 x 1): all_gather" in done.stdout, done.stdout
    rows = list(csv.DictReader(open(tmp_path / "multinode_host.csv")))
    assert {(r["op"], r["mode"]) for r in rows} == {(op, m) for op in ("all_gather", "reduce_scatter")
                                                   for m in ("cached", "planned")}
    assert all(float(r["median_us"]) > 0 and r["nodes"] == "2" for r in rows), rows
