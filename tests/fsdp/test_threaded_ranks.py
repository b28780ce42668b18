"""Ranks that are threads of one process (torch's threaded process group): TIDE's call agreement and counters
are per process, so ``enable`` warns once and every collective takes stock FSDP2 as ``threaded_ranks``;
training equals stock's, and finishes in seconds (it used to wait for TIDE's timeout)."""
import json
import subprocess
import sys
from pathlib import Path

STEPS = 2


def test_threaded_ranks_train_on_stock():
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "tests.fsdp.threaded_ranks", str(STEPS)], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(out["ranks"]) == ["0", "1"]
    for rank, r in out["ranks"].items():
        assert r["tide"]["losses"] == r["stock"]["losses"] and r["tide"]["params"] == r["stock"]["params"], rank
        assert len(r["tide"]["losses"]) == STEPS
        stats = r["stats"]
        assert set(stats["all_gather"]) == {"stock:threaded_ranks"}, stats
        assert set(stats["reduce_scatter"]) == {"stock:threaded_ranks"}, stats
    # One warning per rank's enable, naming why.
    warned = [w for w in out["warnings"] if "threads of one process" in w and "stock:threaded_ranks" in w]
    assert len(warned) == 2, out["warnings"]
