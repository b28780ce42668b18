"""bench/train_step.py's ``--shard-experts`` placement and its argument checks (the runs themselves need a GPU)."""
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import train_step  # noqa: E402


def test_shard_experts_places_only_the_3d_expert_weights_on_dim_1():
    place = train_step._layout_kwargs(2, None, True)["shard_placement_fn"]
    assert place(torch.empty(8, 6, 4)) == Shard(1)
    assert place(torch.empty(6, 4)) is None and place(torch.empty(4)) is None
    assert train_step._layout_kwargs(2, None, False) == {}


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny", "--shard-experts"], "--shard-experts needs a preset with experts"),
    (["--preset", "tiny", "--hsdp", "3", "--ranks", "2"], "--hsdp must divide the ranks"),
])
def test_bad_layout_flags_name_the_flag(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(train_step, "require_cuda", lambda name: None)
    with pytest.raises(SystemExit):
        train_step.main(argv)
    assert message in capsys.readouterr().err
