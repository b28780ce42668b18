"""bench/train_step.py's compiled variants on 2 CPU ranks (``--device cpu``, Inductor): the tiny preset's model
sharded SimpleFSDP-style (tide/compile/simple_fsdp.py), compiled without TIDE's pass (``compiled_stock``) and after
``tide.compile.enable()`` (``compiled_tide``). Both rows are written; TIDE's graph ops ran (on the reference
backend, CPU); the first step's loss (before any update) is the same bit for bit, and so, to rounding, is the
last; the backward gathers the parameters again (reshard after forward). The GPU runs are the lead's."""
import ast
import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import train_step  # noqa: E402


def test_compiled_variants_write_their_rows_with_the_same_losses(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "train_step.py"), "--device", "cpu", "--preset", "tiny",
                           "--blocks", "1", "--tokens", "16", "--steps", "1", "--warmup", "1",
                           "--variants", "compiled_stock,compiled_tide", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUMMARY train_step tiny (2 CPU ranks over gloo" in done.stdout, done.stdout
    rows = {r["variant"]: r for r in csv.DictReader(open(tmp_path / "train_step_tiny_compiled.csv"))}
    assert sorted(rows) == ["compiled_stock", "compiled_tide"], rows
    stock, tide_ = rows["compiled_stock"], rows["compiled_tide"]
    assert float(tide_["first_loss"]) == float(stock["first_loss"]), (tide_["first_loss"], stock["first_loss"])
    # TIDE's reduce-scatter reads the bf16 gradient where Inductor may fuse stock's fp32 cast (docs/compile.md)
    assert float(tide_["final_loss"]) == pytest.approx(float(stock["final_loss"]), rel=1e-3)
    assert ast.literal_eval(stock["ops_stats"]) == {}  # stock: no TIDE op at all
    # Per step (2: warm-up and timed): the forward gathers embed, layers.0, and norm with head (3 calls), the
    # backward gathers layers.0, and norm with head again (3: resharded after forward; the embedding's gather has
    # no backward reader) and reduce-scatters head with norm, layers.0 and embed (3 calls).
    ops = ast.literal_eval(tide_["ops_stats"])
    assert ops["all_gather_start:reference"] == 2 * 6 and ops["reduce_scatter_start:reference"] == 2 * 3, ops
    assert "compiled_tide: tide.compile.report() {'all_gather': {'buckets': 6," in done.stdout, done.stdout


@pytest.mark.parametrize("argv, message", [
    (["--variants", "compiled_tide", "--preset", "tiny_moe"], "the compiled variants need a dense preset"),
    (["--variants", "compiled_tide", "--hsdp", "2"], "take none of ['--hsdp']"),
    (["--variants", "stock,compiled_tide"], "--device cpu runs only the compiled variants"),
    (["--variants", "compiled_tide", "--segments"], "--segments records the CUDA allocator's history"),
])
def test_compiled_variants_refuse_what_they_cannot_run(argv, message, capsys):
    with pytest.raises(SystemExit):
        train_step.main(["--device", "cpu", "--preset", "tiny"] + argv)
    assert message in capsys.readouterr().err


def test_compiled_stock_is_dropped_where_ranks_share_a_gpu_and_kept_on_nccl(capsys):
    import argparse

    from tide.models import PRESETS

    args = argparse.Namespace(device="cuda", preset="tiny", hsdp=None, shard_experts=False, float8=False,
                              local_world_size=None, segments=False)
    for backend, kept in (("gloo", ["compiled_tide"]), ("nccl", ["compiled_stock", "compiled_tide"])):
        variants = ["compiled_stock", "compiled_tide"]
        train_step._check_compiled(argparse.ArgumentParser(), args, variants, backend, PRESETS["tiny"])
        assert variants == kept, backend
    assert capsys.readouterr().out.count("train_step.py: no compiled_stock variant: ranks share a GPU") == 1
