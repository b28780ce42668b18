"""pytest plugin of the upstream FSDP2 harness, loaded with ``-p tests.upstream.plugin`` in a run over
PyTorch's test files (``scripts/upstream_fsdp.sh``).

In the pytest process it installs the harness's hooks (``tests.upstream.ranks``), clears ``tide.stats()``
before each test, and after it sums the test's FSDP2 path counts: this process's own (the ranks of a
multi-thread test are its threads) and those each rank process left in ``TIDE_UPSTREAM_RESULTS``. After each
test it writes every finished test's outcome, a one-line message (the failing assertion or error, or the skip
reason), whether its ranks were processes or threads, and the path counts to ``TIDE_UPSTREAM_OUT`` (JSON).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.upstream import ranks

OUT_ENV = "TIDE_UPSTREAM_OUT"
_PYTEST_MARK = re.compile(r"^E\s+")
_ERROR_LINE = re.compile(r"^(?:E\s+)?((?:[\w.]+\.)?\w*(?:Error|Exception|Exit|Failure)\b.*)$")


def sum_paths(counts: list[dict]) -> dict:
    """``tide.stats()["fsdp"]`` of several processes added up, per collective and path."""
    total: dict[str, Counter] = {}
    for fsdp in counts:
        for kind, paths in fsdp.items():
            total.setdefault(kind, Counter()).update(paths)
    return {kind: dict(sorted(c.items())) for kind, c in sorted(total.items()) if c}


def failure_line(text: str, limit: int = 300) -> str:
    """The last ``SomethingError: ...`` line of a failure report (a rank's traceback included) with the lines
    of its message after it, joined with `` / `` and cut at ``limit`` characters; else the report's last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        match = _ERROR_LINE.match(lines[i])
        if match:
            message = [match.group(1)]
            for line in (_PYTEST_MARK.sub("", line) for line in lines[i + 1:i + 8]):
                if line.startswith(("Traceback", "File ", "To execute this test")):
                    break
                if line != "E":  # pytest's marker on an empty line
                    message.append(line)
            return " / ".join(message)[:limit]
    return lines[-1][:limit] if lines else ""


def ranks_kind(cls) -> str:
    from torch.testing._internal.common_distributed import (
        MultiProcContinuousTest, MultiProcessTestCase, MultiThreadedTestCase)

    if cls is not None and issubclass(cls, MultiThreadedTestCase):
        return "threads"
    if cls is not None and issubclass(cls, (MultiProcessTestCase, MultiProcContinuousTest)):
        return "processes"
    return "none"


class Recorder:
    def __init__(self, mode: str, results: Path, out: Path):
        self.mode, self.results, self.out = mode, results, out
        self.tests: dict[str, dict] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        import tide

        key = ranks.test_key(item.module.__name__, item.cls.__name__ if item.cls else "", item.name)
        shutil.rmtree(self.results / key, ignore_errors=True)
        record = self.tests.setdefault(item.nodeid, {"outcome": "not_run", "message": ""})
        record["ranks"] = ranks_kind(item.cls)
        tide.reset_stats()
        yield
        rank_files = sorted((self.results / key).glob("rank*.json"))
        record["paths"] = sum_paths([tide.stats()["fsdp"], *(json.loads(f.read_text()) for f in rank_files)])
        self.write()  # after every test, so a run stopped early still leaves what it finished

    def pytest_runtest_logreport(self, report):
        record = self.tests.setdefault(report.nodeid, {"outcome": "not_run", "message": ""})
        if report.when == "call" or (report.when == "setup" and not report.passed):
            record["outcome"] = "error" if report.when == "setup" and report.failed else report.outcome
            if report.skipped:
                record["message"] = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""
            elif report.failed:
                record["message"] = failure_line(report.longreprtext)
        elif report.when == "teardown" and report.failed and record["outcome"] == "passed":
            record["outcome"], record["message"] = "error", failure_line(report.longreprtext)

    def pytest_sessionfinish(self, session):
        self.write()

    def write(self):
        import torch

        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps({"torch": torch.__version__.split("+")[0], "mode": self.mode,
                                        "tests": self.tests}, indent=1, sort_keys=True))

def pytest_configure(config):
    mode = os.environ.get(ranks.MODE_ENV)
    if not mode:
        raise pytest.UsageError(f"tests.upstream.plugin: set {ranks.MODE_ENV} (one of {ranks.MODES}), "
                                f"{ranks.RESULTS_ENV} and {OUT_ENV}")
    ranks.install_from_env()
    recorder = Recorder(mode, Path(os.environ[ranks.RESULTS_ENV]), Path(os.environ[OUT_ENV]))
    config.pluginmanager.register(recorder, "tide_upstream_recorder")
