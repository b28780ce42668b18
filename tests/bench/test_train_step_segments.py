"""bench/train_step.py's ``--segments`` summary, on a hand-made allocator snapshot (the GPU part runs with
the flag on a GPU)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import train_step  # noqa: E402

TORCH = "/venv/lib/python3.12/site-packages/torch"


def _frame(filename, name):
    return {"filename": filename, "name": name, "line": 1}


def _entry(action, mib, *frames):
    return {"action": action, "size": mib << 20, "frames": list(frames), "stream": 0, "addr": 0}


def test_segments_sum_by_the_innermost_frame_outside_torch_internals():
    fsdp = _frame(f"{TORCH}/distributed/fsdp/_fully_shard/_fsdp_param.py", "alloc_storage")
    linear = _frame(f"{TORCH}/nn/modules/linear.py", "__init__")
    model = _frame("/work/tide/models.py", "__init__")
    snapshot = {"device_traces": [[
        _entry("segment_alloc", 112, fsdp, model),  # FSDP's own frame counts (torch.distributed)
        _entry("segment_alloc", 32, fsdp),
        _entry("segment_alloc", 64, linear, model),  # torch.nn is skipped: the model's frame asked
        _entry("alloc", 500, model),  # not a segment
        _entry("segment_free", 64, model),
        _entry("segment_alloc", 2, linear),  # nothing outside torch
    ]]}
    rows = train_step.segment_sites(snapshot)
    assert [r["site"] for r in rows] == ["_fsdp_param.py:alloc_storage", "models.py:__init__", "(no Python frame)"]
    assert [r["segments"] for r in rows] == [2, 1, 1]
    assert [r["mib"] for r in rows] == pytest.approx([144, 64, 2])


def test_no_history_no_rows():
    assert train_step.segment_sites({"device_traces": [[]]}) == []
    assert train_step.segment_sites({}) == []
