"""The main command (``python -m tide.train``): argument errors name the argument, a one-rank run reports
that TIDE did not run, and a clean run exits 0."""
import subprocess
import sys

import pytest


def _train(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "tide.train", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("args,message", [
    (["--timeout", "-5"], "--timeout must be > 0 seconds, got -5.0"),
    (["--steps", "0"], "--ranks and --steps must be >= 1"),
    (["--device", "cpu", "--backend", "nccl"], "--backend nccl needs --device cuda"),
])
def test_argument_errors_name_the_argument(args, message):
    out = _train(*args)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_ranks_under_torchrun_must_match(monkeypatch):
    import os

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2"}
    out = _train("--ranks", "4", env=env)
    assert out.returncode == 2 and "--ranks 4 under torchrun, which started 2 ranks" in out.stderr, out.stderr


def test_one_rank_reports_that_tide_did_not_run():
    out = _train("--ranks", "1", "--steps", "2", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "layout conversion removed  0 (no collective took the TIDE path" in out.stdout, out.stdout
    assert "stock:world_size_1" in out.stdout
