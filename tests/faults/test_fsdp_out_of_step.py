"""FSDP2 training on TIDE's reference backend (CPU, gloo) with one rank out of step: every rank raises at
the next TIDE call, naming both sides' calls in words (the step ``tide.train`` declares; the module, phase
and count the FSDP2 seam declares), instead of pairing one module's or step's collectives with another's.
"""
from __future__ import annotations

import sys
from pathlib import Path

from tide.launch import run_ranks_outcomes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fault_scenarios  # noqa: E402

PG_TIMEOUT_S = 30.0
ENV = {"TIDE_TIMEOUT_S": "5"}


def test_a_rank_that_skips_a_step_raises_on_every_rank(tmp_path):
    outcomes = run_ranks_outcomes(fault_scenarios.fsdp_steps, 2, "cpu", "skips_a_step", "in_place", 1, 3,
                                  str(tmp_path / "fault"), timeout=120, pg_timeout=PG_TIMEOUT_S, env=ENV)
    for o in outcomes:
        assert o.status == "error", o
        assert "issued different calls" in o.detail, o.detail
        assert "step 1" in o.detail and "step 2" in o.detail, o.detail  # both sides' steps, in words
    assert max(o.ended_at for o in outcomes) - fault_scenarios.fault_time(str(tmp_path / "fault")) < 15


def _skips_a_module(rank, world_size, fault_file):
    import torch

    from tide.models import PRESETS
    from tide.train import fsdp_model, train_step

    cfg = PRESETS["tiny"]
    model = fsdp_model(cfg, device=torch.device("cpu"), use_tide=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        if rank == 1 and step == 1:  # this step's forward leaves out layers.1 (its two blocks have one layout)
            def forward(tokens, model=model):
                x = model.embed(tokens)
                s = tokens.shape[1]
                cos, sin = model.cos[:s].to(x.dtype), model.sin[:s].to(x.dtype)
                return model.head(model.norm(model.layers[0](x, cos, sin)))

            model.forward = forward
            fault_scenarios._fault(fault_file)
        elif "forward" in vars(model):
            del model.forward
        train_step(model, optim, cfg, step, rank)
    return "finished"


def test_a_rank_that_skips_a_modules_call_names_both_modules(tmp_path):
    fault_file = str(tmp_path / "fault")
    outcomes = run_ranks_outcomes(_skips_a_module, 2, fault_file, timeout=120, pg_timeout=PG_TIMEOUT_S, env=ENV)
    for o in outcomes:
        assert o.status == "error", o
        assert "issued different calls" in o.detail, o.detail
        assert "[layers.1 forward #2, step 1]" in o.detail, o.detail  # rank 0's call
        assert "[layers.0 backward #2, step 1]" in o.detail, o.detail  # rank 1's: the module before, re-gathered
    assert max(o.ended_at for o in outcomes) - fault_scenarios.fault_time(fault_file) < 15
