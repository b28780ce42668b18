"""FSDP2 tensor extensions on the CUDA transport (skipped without CUDA): the tests' own int8-rows extension
(tests/fsdp/int8_weights.py) and, where torchao imports and the GPU has float8 (compute capability 8.9+),
torchao's float8 training with ``enable_fsdp_float8_all_gather=True``, each against stock FSDP2 trained
from the same seed on the same data. Two ranks (sharing one GPU over gloo when there is one): every
reduce sums two contributions, so the runs agree with stock bit for bit. The extension inputs are gathered
into FSDP's all-gather outputs bound in the arena's slots (``ag:bound``), both reduce-scatter modes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.cuda import ranks
from tide.launch import run_ranks

pytestmark = pytest.mark.cuda
STEPS = 3


def _master(p) -> torch.Tensor:
    """This rank's shard of ``p`` as a plain tensor: the master data of an int8-rows weight (``_data``) or of
    a torchao float8 weight (``_tensor``)."""
    t = p.detach().to_local()
    for attr in ("_data", "_tensor"):
        t = getattr(t, attr, t)
    return t


def extension_rank(rank: int, world_size: int, kind: str, rs_mode: str, steps: int) -> dict:
    import tide
    from tests.fsdp.int8_weights import Int8RowsWeight, int8_rows
    from tests.fsdp.workers import BF16
    from tide.models import PRESETS, LlamaConfig
    from tide.train import float8_blocks, fsdp_model, train_step

    dev = torch.device("cuda", torch.cuda.current_device())
    if kind == "float8":  # _scaled_mm needs every dim and the tokens per step a multiple of 16
        cfg = LlamaConfig(vocab=131, dim=128, n_layers=3, n_heads=4, ffn_dim=256, seq_len=32)
        before_shard = float8_blocks
    else:
        cfg = dataclasses.replace(PRESETS["tiny"], n_layers=3)
        before_shard = int8_rows(world_size)
    out = {}
    for name, use_tide in (("stock", False), ("tide", True)):
        Int8RowsWeight.calls.update(pre=0, post=0)
        model = fsdp_model(cfg, device=dev, mp_policy=BF16, use_tide=use_tide, rs_mode=rs_mode,
                           before_shard=before_shard)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tide.reset_stats()
        losses = [train_step(model, optim, cfg, s, rank, device=dev).item() for s in range(steps)]
        torch.cuda.synchronize()
        # This rank's shards (both runs shard alike): DTensor.full_tensor() over gloo with CUDA tensors is not
        # safe on torch 2.11 (tests/cuda/test_fsdp_cuda.py).
        params = [_master(p).float().cpu().numpy().copy() for p in model.parameters()]
        stats = tide.stats()
        out[name] = {"losses": losses, "params": params, "fsdp": stats["fsdp"], "wiring": stats["wiring"],
                     "ops": stats["ops"], "int8_hooks": dict(Int8RowsWeight.calls)}
        if use_tide:
            tide.fsdp.disable(model)
    return out


def _check(results, kind: str) -> None:
    for rank, r in enumerate(results):
        t, s = r["tide"], r["stock"]
        assert set(t["fsdp"]["all_gather"]) == {"tide"} and set(t["fsdp"]["reduce_scatter"]) == {"tide"}, (rank, t)
        assert t["wiring"].get("ag:bound", 0) > 0, (rank, t["wiring"])
        assert t["ops"].get("all_gather_into_params_:tide", 0) > 0, (rank, t["ops"])
        if kind == "int8":
            assert t["int8_hooks"] == s["int8_hooks"] and t["int8_hooks"]["pre"] > 0, (rank, t["int8_hooks"])
        assert t["losses"] == s["losses"], (rank, t["losses"], s["losses"])
        for i, (a, b) in enumerate(zip(t["params"], s["params"])):
            assert np.array_equal(a, b), f"rank {rank} param {i}: max |diff| {np.abs(a - b).max():.3e}"


@pytest.mark.parametrize("rs_mode", ["in_place", "slot_reuse"])
def test_int8_extension_on_the_transport_is_stock_bit_for_bit(ext, rs_mode):
    _check(run_ranks(extension_rank, 2, "int8", rs_mode, STEPS, backend="gloo", device_type="cuda", env=ranks.ENV,
                     timeout=400), "int8")


def test_torchao_float8_all_gather_on_the_transport_is_stock_bit_for_bit(ext):
    pytest.importorskip("torchao.float8")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9 or newer")
    _check(run_ranks(extension_rank, 2, "float8", "in_place", STEPS, backend="gloo", device_type="cuda",
                     env=ranks.ENV, timeout=400), "float8")
