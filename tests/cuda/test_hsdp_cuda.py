"""HSDP on the CUDA transport (skipped without CUDA): TIDE-AG and TIDE-RS on the shard group's arena, stock's fp32
all-reduce across the replicate group (tide/fsdp/replicate.py), against stock FSDP2 trained from the same seed on
the same data. Ranks share one GPU over gloo when there are fewer GPUs than ranks (the all-reduce then runs on
gloo too); a (2, 2) mesh: two ranks per shard group, so the runs agree with stock bit for bit."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.cuda import ranks
from tide.launch import run_ranks

pytestmark = pytest.mark.cuda


def hsdp_rank(rank: int, world_size: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import tide
    from tests.fsdp.workers import BF16
    from tide.models import PRESETS
    from tide.train import fsdp_model, train_step

    dev = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    cfg = dataclasses.replace(PRESETS["tiny"], n_layers=4)
    out = {}
    for name, use_tide in (("stock", False), ("tide", True)):
        model = fsdp_model(cfg, device=dev, mp_policy=BF16, use_tide=use_tide, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tide.reset_stats()
        losses = [train_step(model, optim, cfg, s, rank, device=dev).item() for s in range(steps)]
        out[name] = {"losses": losses, "params": [p.detach().to_local().float().cpu().numpy().copy()
                                                  for p in model.parameters()],
                     "fsdp": tide.stats()["fsdp"], "ops": tide.stats()["ops"]}
        if use_tide:
            tide.fsdp.disable(model)
    return out


def test_hsdp_on_the_transport_is_stock_bit_for_bit(ext):
    for rank, r in enumerate(run_ranks(hsdp_rank, 4, 3, backend="gloo", device_type="cuda", env=ranks.ENV,
                                       timeout=400)):
        t, s = r["tide"], r["stock"]
        assert set(t["fsdp"]["reduce_scatter"]) == {"tide"} and set(t["fsdp"]["all_gather"]) == {"tide"}, (rank, t)
        assert t["ops"].get("reduce_scatter_params_:tide", 0) > 0, (rank, t["ops"])
        assert t["losses"] == s["losses"], (rank, t["losses"], s["losses"])
        for i, (a, b) in enumerate(zip(t["params"], s["params"])):
            assert np.array_equal(a, b), f"rank {rank} param {i}: max |diff| {np.abs(a - b).max():.3e}"
