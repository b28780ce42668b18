"""bench/timeline.py's per-stream accounting, on hand-made events (the GPU part runs in gpu_check)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import timeline  # noqa: E402


def _ev(stream, kind, start, dur):
    return {"stream": stream, "kind": kind, "name": kind, "start": start, "dur": dur}


def test_busy_idle_and_kernel_gaps_per_stream():
    events = [_ev(7, "copy", 0, 10), _ev(7, "copy", 5, 10), _ev(7, "copy", 30, 10),  # overlapping copies
              _ev(9, "kernel", 12, 20), _ev(9, "kernel", 40, 20), _ev(9, "kernel", 64, 16)]
    rows = {r["stream"]: r for r in timeline.summarize(events, calls=2)}
    assert rows[7]["busy_us"] == pytest.approx((15 + 10) / 2)  # [0, 15) and [30, 40) over 2 calls
    assert rows[7]["idle_us"] == pytest.approx((80 - 25) / 2)  # the span ends with the last kernel at 80
    assert rows[7]["copies"] == 1 and rows[7]["kernels"] == 0
    assert rows[9]["mean_kernel_us"] == pytest.approx(56 / 3)
    assert rows[9]["median_kernel_gap_us"] == pytest.approx((8 + 4) / 2)
    assert rows[9]["call_us"] == pytest.approx(40)


def test_no_events_no_rows():
    assert timeline.summarize([], calls=3) == []


def test_ring_settings_are_checked():
    with pytest.raises(SystemExit):
        timeline.main(["--rings", "64-4"])


def test_cast_cta_caps_are_checked():
    with pytest.raises(SystemExit):
        timeline.main(["--cast-ctas", "16,x"])
    with pytest.raises(SystemExit):
        timeline.main(["--cast-ctas", "-1"])


def test_warm_up_seconds_are_checked():
    with pytest.raises(SystemExit):
        timeline.main(["--warmup-s", "-1"])
