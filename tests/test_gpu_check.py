"""scripts/stage_status.py, the status word of a gpu_check.sh stage: ``ok`` only when some test ran
and none failed; an all-skipped pytest stage is ``SKIPPED``, one with failures ``FAIL``."""
import importlib.util
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "stage_status.py"
_spec = importlib.util.spec_from_file_location("stage_status", SCRIPT)
stage_status = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stage_status)


@pytest.mark.parametrize("rc, log, expected", [
    (0, "....\n4 passed in 3.21s\n", "ok"),
    (0, "..ss\n2 passed, 2 skipped, 1 warning in 0.50s\n", "ok"),
    (0, "ssss\nSKIPPED [4] tests/cuda/ranks.py:12: needs 2 GPUs\n4 skipped in 0.12s\n", "SKIPPED"),
    (0, "===== 3 skipped, 1 deselected in 1.00s =====\n", "SKIPPED"),
    (5, "no tests ran in 0.01s\n", "SKIPPED"),
    (0, "x\n1 xfailed in 0.30s\n", "ok"),
    (1, ".F\nFAILED tests/cuda/test_kernels.py::test_sum - AssertionError\n1 failed, 1 passed in 2.00s\n", "FAIL(1)"),
    (0, "1 passed, 1 error in 2.00s\n", "FAIL(0)"),  # a failure counts even under a zero exit status
    (1, "======== 2 failed, 3 passed, 4 skipped in 301.50s (0:05:01) ========\n", "FAIL(1)"),
    (124, "..\n", "TIMEOUT"),
    (124, "4 skipped in 0.10s\n", "TIMEOUT"),
    (0, "SUMMARY kernels: 10 reps\n", "ok"),  # a benchmark: its exit status alone
    (3, "Traceback (most recent call last):\n", "FAIL(3)"),
    (0, "3 passed in 1.0s\nlater output\n2 skipped in 0.2s\n", "SKIPPED"),  # the last summary line counts
])
def test_stage_status(rc, log, expected):
    assert stage_status.stage_status(rc, log) == expected


def test_the_command_line_gpu_check_calls(tmp_path):
    log = tmp_path / "tests_multinode.log"
    log.write_text("ss\n2 skipped in 0.05s\n")
    out = subprocess.run([sys.executable, str(SCRIPT), "0", str(log)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "SKIPPED", out


def test_gpu_check_takes_each_stage_status_from_the_script():
    text = (SCRIPT.parent / "gpu_check.sh").read_text()
    assert "scripts/stage_status.py $rc" in text
