"""FSDP2 on ranks that are threads of one process (torch's threaded test process group, which PyTorch's own
FSDP2 tests use), stock then TIDE-enabled: run as ``python -m tests.fsdp.threaded_ranks STEPS``; prints one
JSON object: per rank the losses and final parameters of both runs and the TIDE run's ``tide.stats()["fsdp"]``
(the process's: both threads count into it); and the RuntimeWarnings of the whole run."""
from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_distributed import spawn_threads_and_init_comms

import tide
import tide.fsdp

WORLD_SIZE = 2


def _model(rank: int) -> nn.Module:
    """Two blocks and a head, every rank alike; the values come from a generator of this thread's own (the
    threads share torch's global one)."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Sequential(nn.Linear(16, 8), nn.ReLU()),
                          nn.Linear(8, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    for block in model[:2]:
        fully_shard(block)
    return fully_shard(model)


def _train(rank: int, steps: int, use_tide: bool) -> dict:
    model = _model(rank)
    if use_tide:
        tide.fsdp.enable(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1 + rank))
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.full_tensor().tolist() for p in model.parameters()]}


class ThreadedRanks:
    results: dict = {}
    steps = 2

    @spawn_threads_and_init_comms(world_size=WORLD_SIZE)
    def run(self):
        rank = dist.get_rank()
        out = {"stock": _train(rank, self.steps, use_tide=False), "tide": _train(rank, self.steps, use_tide=True)}
        out["stats"] = tide.stats()["fsdp"]
        ThreadedRanks.results[rank] = out


if __name__ == "__main__":
    ThreadedRanks.steps = int(sys.argv[1])
    with warnings.catch_warnings(record=True) as caught:  # the threads share the warnings state: caught here
        warnings.simplefilter("always")
        ThreadedRanks().run()
    print(json.dumps({"ranks": ThreadedRanks.results,
                      "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}), flush=True)
    # torch's threaded backend may abort in interpreter teardown ("terminate called without an active
    # exception", stock FSDP2 alone as well, under load): the results are out, so the process ends here.
    os._exit(0)
