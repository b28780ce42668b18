"""A GPU-only benchmark started without the GPU it needs says so in one line and exits 2 (no traceback)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("script,needs", [(s, "needs 1 CUDA GPU") for s in (
    "bench_kernels.py", "collectives.py", "train_step.py", "bench_host_time.py", "bench_memory.py", "overlap.py",
    "sm_room.py")]
    + [(s, "needs 2 CUDA GPUs") for s in ("lease_probe.py", "timeline.py", "rs_ctas.py")])
def test_says_it_needs_cuda_in_one_line(script, needs, tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / script), "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and needs in lines[0], out.stderr
    assert not any(tmp_path.iterdir())  # nothing written
