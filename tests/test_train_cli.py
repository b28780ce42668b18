"""The main command (``python -m tide.train``): argument errors name the argument (its ``main``, in this
process), a one-rank run reports that TIDE did not run, and a clean run exits 0."""
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
def test_argument_errors_name_the_argument(args, message, capsys):
    # The command's own main, in this process: an argument error ends it before it starts a rank.
    from tide import train

    with pytest.raises(SystemExit) as end:
        train.main(args)
    err = capsys.readouterr().err
    assert end.value.code == 2 and message in err, err


def test_ranks_under_torchrun_must_match(monkeypatch, capsys):
    from tide import train

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as end:
        train.main(["--ranks", "4"])
    err = capsys.readouterr().err
    assert end.value.code == 2 and "--ranks 4 under torchrun, which started 2 ranks" in err, err


def test_one_rank_reports_that_tide_did_not_run():
    out = _train("--ranks", "1", "--steps", "2", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "layout conversion removed  0 (no collective took the TIDE path" in out.stdout, out.stdout
    assert "stock:world_size_1" in out.stdout


def test_compiled_stock_against_compiled_tide_on_cpu():
    """``--compile``: the same losses bit for bit (2 ranks: TIDE's rank-order sum of two values rounds as gloo's),
    what TIDE replaced, and every graph's collectives with how many are exposed, from the generated code."""
    out = _train("--compile", "--model", "tiny", "--steps", "2", "--device", "cpu", timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line[:5].strip() in ("1", "2")]
    assert len(rows) == 2 and all(row[1] == row[2] and float(row[3]) == 0 for row in rows), out.stdout
    assert "replaced by TIDE            all_gather: " in out.stdout, out.stdout
    assert "compiled tide  forward   tide:all_gather " in out.stdout, out.stdout
    assert "compiled stock backward  stock:all_gather " in out.stdout, out.stdout
