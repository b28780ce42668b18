"""The SimpleFSDP toy of the compile tests, sharded by bench/simple_fsdp.py (every parameter a ``Shard(0)``
DTensor, all-gathered to ``param_dtype`` at each read, its gradient reduce-scattered in ``reduce_dtype``), so a
compiled step holds DTensor's functional c10d collectives.

The model has an uneven Linear (7 rows on 2 and 3 ranks), a one-row parameter per block (a rank holds no
row of it: its shard is empty), tied embedding/head weights and an activation-checkpointed block."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from simple_fsdp import simple_fsdp  # noqa: E402,F401  (bench/simple_fsdp.py; the rank functions use it here)

VOCAB, DIM, HIDDEN = 16, 8, 7


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)       # weight (7, 8): uneven shards
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.gate = nn.Parameter(torch.rand(1, DIM))  # one row: every rank but rank 0 holds none of it

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x))) * self.gate


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens):
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if i == 0 else block(x)  # blocks.0 recomputed
        return self.head(x)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build(mesh, seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    return simple_fsdp(Toy(), mesh)


def batch(step: int, rank: int, batch_size: int = 2, seq: int = 5):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    return tokens, torch.randint(0, VOCAB, (batch_size, seq), generator=g)
