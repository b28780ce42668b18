"""The status word of one gpu_check.sh stage, from its exit status and its log:
``python scripts/stage_status.py RC LOG`` prints ``ok``, ``SKIPPED``, ``TIMEOUT`` or ``FAIL(<rc>)``.

A pytest stage is ``ok`` only when some test ran and none failed: a stage whose every test was
skipped (no GPU seen, too few GPUs) is ``SKIPPED``, one with failures or errors ``FAIL`` whatever its
exit status. pytest's summary line ("3 passed, 2 skipped in 4.1s", "no tests ran in 0.1s", with or
without ``=`` around it under -v) gives the counts; a stage without one (a benchmark) goes by its exit
status alone.
"""
from __future__ import annotations

import re
import sys

_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+|no tests ran) in [\d.]+s(?: \([\d:]+\))?\s*=*$")
_COUNT = re.compile(r"(\d+) (\w+)")
_RAN = ("passed", "xfailed", "xpassed")
_BROKE = ("failed", "error", "errors")


def pytest_counts(log: str) -> dict[str, int] | None:
    """The counts of the last pytest summary line in ``log`` (``{}`` for "no tests ran"), or None."""
    for line in reversed(log.splitlines()):
        match = _SUMMARY.match(line.strip())
        if match:
            return {word: int(n) for n, word in _COUNT.findall(match.group(1))}
    return None


def stage_status(rc: int, log: str) -> str:
    if rc == 124:  # timeout(1)
        return "TIMEOUT"
    counts = pytest_counts(log)
    if counts is not None:
        if any(counts.get(word, 0) for word in _BROKE):
            return f"FAIL({rc})"
        if rc in (0, 5) and not any(counts.get(word, 0) for word in _RAN):  # 5: pytest collected nothing
            return "SKIPPED"
    return "ok" if rc == 0 else f"FAIL({rc})"


if __name__ == "__main__":
    rc, path = int(sys.argv[1]), sys.argv[2]
    with open(path, errors="replace") as f:
        print(stage_status(rc, f.read()))
