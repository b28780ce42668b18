"""bench_memory.py's report (plot + SUMMARY line) from rows, on CPU: the GPU only supplies the rows.

A variant may be missing for some dims (stock beyond ``--stock-max-dim``) or for all of them (the memory
model test runs TIDE only); the report once crashed there after every measurement had been taken.
"""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_memory.py"


def _bench_memory():
    spec = importlib.util.spec_from_file_location("bench_memory", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(variants_by_dim):
    return [{"rank": rank, "dim": dim, "variant": variant, "live_ns": live, "arena_ns": 1.25,
             "ns_bytes": 2 * dim * dim * 12}
            for dim, variants in variants_by_dim.items() for variant, live in variants.items() for rank in (0, 1)]


@pytest.mark.parametrize("variants_by_dim", [
    {1024: {"tide_in_place": 5.27, "tide_slot_reuse": 4.27}},
    {2048: {"stock": 5.46, "tide_in_place": 3.56, "tide_slot_reuse": 2.56},
     6144: {"tide_in_place": 3.28, "tide_slot_reuse": 2.28}},
], ids=["no_stock", "stock_for_some_dims"])
def test_report_plots_and_summarizes_the_variants_that_ran(variants_by_dim, tmp_path, capsys):
    bench_memory = _bench_memory()
    meta = {"device": "test device", "torch": "test"}
    bench_memory.report(_rows(variants_by_dim), list(variants_by_dim), 8, "gloo", meta, tmp_path)
    assert (tmp_path / "memory.png").stat().st_size > 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    expected = "; ".join(f"dim {dim}: " + " ".join(f"{v.removeprefix('tide_')} {live:.2f}"
                                                   for v, live in variants.items())
                         for dim, variants in variants_by_dim.items())
    assert summary.endswith(expected), summary
