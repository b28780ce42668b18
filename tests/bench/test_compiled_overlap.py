"""bench/compiled_overlap.py's measure on made-up events: the compute stream is the one with the most kernel time,
and the hidden share is the part of the transfers' busy time during which it ran a kernel."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import compiled_overlap  # noqa: E402


def _e(stream, kind, start, dur):
    return {"stream": stream, "kind": kind, "name": "x", "start": start, "dur": dur}


def test_hidden_share_counts_transfer_time_beside_compute():
    events = [_e(7, "kernel", 0, 100), _e(7, "kernel", 150, 100),  # compute: [0, 100) and [150, 250)
              _e(20, "copy", 50, 100),  # [50, 150): 50 us beside compute
              _e(20, "kernel", 120, 10),  # inside the copy's time: no new busy time
              _e(21, "copy", 260, 40)]  # after the compute: exposed
    busy, covered = compiled_overlap.hidden(events)
    assert busy == 140 and covered == 50


def test_no_transfer_no_share():
    assert compiled_overlap.hidden([_e(7, "kernel", 0, 10)]) == (0, 0)
