"""bench/fsdp_host_overhead.py runs on CPU: its TIDE group takes the seam's TIDE path on every call and its stock
group stock's (the bench asserts both counts), and it writes its CSV. The bench once timed the TIDE group through
a comm of its own, which the seam rightly took for a user's (``stock:custom_comm``), and failed that assertion."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fsdp_host_overhead.py"


def test_the_seam_host_overhead_bench_times_both_paths(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--reps", "4", "--out", str(tmp_path)], capture_output=True,
                          text=True, cwd=BENCH.parents[1], timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    with open(tmp_path / "fsdp_host_overhead.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["op"], r["path"]) for r in rows} == {(op, path) for op in ("unshard", "reduce")
                                                     for path in ("stock", "tide")}
    assert all(float(r["host_cpu_us"]) > 0 for r in rows), rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_seam_host_overhead_bench_times_steady_bound_calls(tmp_path):
    """On CUDA every timed unshard binds the group into an arena slot (the bench asserts the ``ag:bound``
    count), and with ranks sharing a GPU only TIDE's rows are written."""
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cuda", "--reps", "4", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=BENCH.parents[1], timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    with open(tmp_path / "fsdp_host_overhead.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    paths = {"stock", "tide"} if torch.cuda.device_count() >= 2 else {"tide"}
    assert {(r["op"], r["path"]) for r in rows} == {(op, p) for op in ("unshard", "reduce") for p in paths}
    assert all(float(r["host_cpu_us"]) > 0 for r in rows), rows
