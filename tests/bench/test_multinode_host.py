"""bench/multinode_host.py runs on CPU: both ops split into their functions' self times, which add up to
the whole call, and a SUMMARY line."""
import csv
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "multinode_host.py"
OP_CALL = "op call (dispatcher and untimed code)"


def test_splits_both_ops_into_self_times_that_add_up(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--reps", "4", "--out", str(tmp_path)], check=True,
                          capture_output=True, text=True, timeout=300)
    assert "SUMMARY multinode_host (cpu, 2 x 1, 1 MiB): all_gather" in done.stdout, done.stdout
    rows = list(csv.DictReader(open(tmp_path / "multinode_host.csv")))
    for op, body in (("all_gather", "multinode.schedule.all_gather"),
                     ("reduce_scatter", "multinode.schedule._reduce_scatter_step")):
        mine = {r["function"]: r for r in rows if r["op"] == op}
        assert {OP_CALL, body, "multinode.rails.exchange"} <= set(mine), sorted(mine)
        whole = float(mine[OP_CALL]["inclusive_us"])
        # every nanosecond of a call is some function's self time, once
        assert math.isclose(sum(float(r["self_us"]) for r in mine.values()), whole, rel_tol=1e-6), (op, mine)
        assert all(0 <= float(r["self_us"]) <= float(r["inclusive_us"]) <= whole for r in mine.values()), mine
        assert float(mine[OP_CALL]["calls_per_op"]) == 1.0 and mine[body]["nodes"] == "2"
