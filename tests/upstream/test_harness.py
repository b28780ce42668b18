"""The upstream FSDP2 harness (tests/upstream) on a test file of its own: each mode's outcomes, the failing
rank's assertion, TIDE's path counts gathered from both rank processes (none in the stock mode), the CSV
merge, and the source check."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.upstream import report, sources
from tests.upstream.plugin import failure_line, sum_paths

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FAKE = "fake_upstream_fsdp.py"


def run_mode(mode: str, out: Path) -> dict:
    """Run the fake file as the script runs the upstream ones: from a folder of its own, outside the repo."""
    shutil.copy(HERE / FAKE, out / FAKE)
    env = dict(os.environ, PYTHONPATH=f"{HERE / 'site'}:{REPO}", TIDE_UPSTREAM_MODE=mode,
               TIDE_UPSTREAM_RESULTS=str(out / f"{mode}-ranks"), TIDE_UPSTREAM_OUT=str(out / f"{mode}.json"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.upstream.plugin", "-p", "no:cacheprovider",
                           "-q", FAKE], cwd=out, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the one failing test
    return json.loads((out / f"{mode}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("upstream")
    return {mode: run_mode(mode, out) for mode in ("stock", "tide")}


def test_outcomes_and_the_failing_rank_assertion(runs):
    for mode, results in runs.items():
        tests = results["tests"]
        train = tests[f"{FAKE}::TestRankProcesses::test_train_step"]
        failing = tests[f"{FAKE}::TestRankProcesses::test_rank_1_disagrees"]
        assert (train["outcome"], train["ranks"]) == ("passed", "processes"), mode
        assert failing["outcome"] == "failed", mode
        assert failing["message"].startswith("AssertionError") and "rank 1 disagrees" in failing["message"], mode
        assert tests[f"{FAKE}::TestRankThreads::test_forward"]["ranks"] == "threads", mode


def test_tide_path_counts_come_from_both_rank_processes(runs):
    assert runs["stock"]["tests"][f"{FAKE}::TestRankProcesses::test_train_step"]["paths"] == {}
    paths = runs["tide"]["tests"][f"{FAKE}::TestRankProcesses::test_train_step"]["paths"]
    # two groups (in_proj, root) all-gathered in forward, reduce-scattered in backward, on each of 2 ranks
    assert paths["all_gather"].get("tide", 0) >= 4 and paths["all_gather"]["tide"] % 2 == 0, paths
    assert paths["reduce_scatter"] == {"tide": 4}, paths
    threads = runs["tide"]["tests"][f"{FAKE}::TestRankThreads::test_forward"]["paths"]
    assert sum(threads["all_gather"].values()) > 0, threads  # counted in the pytest process itself


def test_report_merges_modes_per_release(runs, tmp_path):
    rows = {}
    for results in runs.values():
        report.merge(rows, results)
    report.write_csv(tmp_path / "out.csv", rows)
    back = report.read_csv(tmp_path / "out.csv")
    row = back[(runs["tide"]["torch"], FAKE, "TestRankProcesses::test_train_step")]
    assert (row["stock"], row["tide"], row["ranks"]) == ("passed", "passed", "processes")
    assert row["tide_paths"].startswith("all_gather: tide=")
    summary = report.summary(back)
    assert any(line.startswith(f"torch {runs['tide']['torch']} stock: 3 of 3 tests") for line in summary), summary


def test_sum_paths_and_failure_line():
    assert sum_paths([{"all_gather": {"tide": 2}}, {"all_gather": {"tide": 1, "stock:async_op": 1}},
                      {"reduce_scatter": {}}]) == {"all_gather": {"stock:async_op": 1, "tide": 3}}
    text = "Traceback\n  File x\nE   RuntimeError: Process 1 exited with error code 10 and exception:\n" \
           "Traceback (most recent call last):\nAssertionError: Scalars are not equal!\n\nExpected 0 but got 1."
    assert failure_line(text) == "AssertionError: Scalars are not equal! / Expected 0 but got 1."
    text = "E   AttributeError: no attribute 'x'\nE\nE   To execute this test, run the following"
    assert failure_line(text) == "AttributeError: no attribute 'x'"
    assert failure_line("E   ValueError: " + "x" * 400) == "ValueError: " + "x" * 288


def test_sources_check_names_each_difference(tmp_path):
    release = next(iter(json.loads(sources.SOURCES.read_text())["releases"]))
    files = sources.release_files(release)
    names = sorted(files)
    (tmp_path / names[0]).write_text("not the upstream file\n")
    problems = sources.differences(tmp_path, release)
    assert len(problems) == len(names)
    assert problems[0].startswith(f"{names[0]}: sha256 "
                                  f"{hashlib.sha256(b'not the upstream file' + bytes([10])).hexdigest()}")
    assert all("missing" in p for p in problems[1:])
    with pytest.raises(KeyError, match="no upstream files are recorded for torch 0.0.0"):
        sources.release_files("0.0.0")
