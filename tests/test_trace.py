"""TIDE_TRACE=1: one stderr line per decision and per slow op; nothing without it."""
import os
import subprocess
import sys
import textwrap

from tide import trace

_TRACED = textwrap.dedent("""
    import time
    from tide import counters
    from tide.transport.watchdog import Watchdog

    class Slow:  # completes 1.5 s after its issue: past trace.LATE_S, well inside the timeout
        def __init__(self):
            self.t = time.monotonic() + 1.5
        def query(self):
            return time.monotonic() > self.t

    counters.count_fsdp("all_gather", None)
    counters.count_fsdp("reduce_scatter", "hsdp")
    counters.count_op("all_gather_into_params_", "outputs_not_in_slot")
    dog = Watchdog(poll_s=0.05)
    dog.track(Slow(), "reduce_scatter_params_", "'0' (ranks [0, 1], this rank 0)", 60.0, lambda: iter(()))
    time.sleep(2.5)
    assert dog.pending() == 0 and dog.error is None
""")


def _run(trace_env: str) -> str:
    env = {**os.environ, "TIDE_TRACE": trace_env, "RANK": "1"}
    proc = subprocess.run([sys.executable, "-c", _TRACED], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_trace_lines_name_each_path_and_each_slow_op():
    lines = [line for line in _run("1").splitlines() if line.startswith("tide[rank 1 pid ")]
    text = "\n".join(lines)
    assert "fsdp all_gather: tide" in text, text
    assert "fsdp reduce_scatter: stock:hsdp" in text, text
    assert "op all_gather_into_params_:stock:outputs_not_in_slot" in text, text
    assert "watchdog: tracking reduce_scatter_params_ on group '0'" in text, text
    pending = next(i for i, line in enumerate(lines) if "still pending" in line)
    completed = next(i for i, line in enumerate(lines) if "reduce_scatter_params_ on group '0' (ranks [0, 1], "
                     "this rank 0) completed" in line)
    assert pending < completed, text
    assert sum("still pending" in line for line in lines) == 1, text  # once per op, not once per poll


def test_no_trace_without_the_variable(capsys, monkeypatch):
    assert "tide[" not in _run("")
    monkeypatch.setattr(trace, "ENABLED", False)
    trace.event("not written")
    assert capsys.readouterr().err == ""
