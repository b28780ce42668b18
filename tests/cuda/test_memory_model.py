"""The memory model of docs/performance.md ("Memory during one layer's backward"), checked on a GPU.

Runs ``bench/bench_memory.py`` (2 ranks, a 2-block Llama-like model of dim 1024, TIDE only) and checks
what the allocator holds in the last block's backward, in NS (the block's bf16 bytes): In-Place keeps
autograd's gradients (1 NS) and the fp32 sharded gradients G (2/W NS) alive together; Slot-Reuse's
hooks move every gradient into its slot region as autograd finishes it, so only G (plus at most one
parameter's gradient and activation gradients, which G covers here) remains. The arena is the same
for both. A seam that stopped moving gradients, or a reduce that allocated staging, fails this.
"""
import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_memory.py"


def test_slot_reuse_gradients_leave_the_allocator(ext, tmp_path):
    subprocess.run([sys.executable, str(BENCH), "--ranks", "2", "--dims", "1024", "--layers", "2",
                    "--stock-max-dim", "0", "--out", str(tmp_path)], check=True, timeout=80)
    rows = {r["variant"]: r for r in csv.DictReader(open(tmp_path / "memory.csv")) if r["rank"] == "0"}
    in_place, slot_reuse = rows["tide_in_place"], rows["tide_slot_reuse"]
    g = float(in_place["grad_shard_ns"])  # 2/W = 1 NS at W = 2
    assert abs(g - 1.0) < 0.01, g
    assert float(in_place["alloc_ns"]) >= 1.0 + g - 0.1, in_place
    assert float(slot_reuse["alloc_ns"]) <= g + 0.15, slot_reuse
    assert int(slot_reuse["grads_into_slot"]) > 0 and int(in_place["grads_into_slot"]) == 0
    assert in_place["arena_bytes"] == slot_reuse["arena_bytes"]
