"""The SimpleFSDP toy of the compile tests, sharded by tide/compile/simple_fsdp.py (every parameter a ``Shard(0)``
DTensor, all-gathered to ``param_dtype`` at each read, its gradient reduce-scattered in ``reduce_dtype``), so a
compiled step holds DTensor's functional c10d collectives.

The model has an uneven Linear (7 rows on 2 and 3 ranks), a one-row parameter per block (a rank holds no
row of it: its shard is empty), tied embedding/head weights and an activation-checkpointed block."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tide.compile.simple_fsdp import simple_fsdp

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


class NormBlock(nn.Module):
    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim_in)
        self.linear = nn.Linear(dim_in, dim_out)

    def forward(self, x):
        return F.gelu(self.linear(self.norm(x)))


class Uneven(nn.Module):
    """Three LayerNorm-Linear-GELU blocks between an input and an output Linear, every Linear's rows uneven on
    3 and 4 ranks (19, 37, 21, 37, 11)."""

    IN = 16

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(self.IN, 19)
        self.blocks = nn.ModuleList([NormBlock(19, 37), NormBlock(37, 21), NormBlock(21, 37)])
        self.out = nn.Linear(37, 11)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build_uneven(mesh, seed: int = 0) -> Uneven:
    """:class:`Uneven` sharded with bf16 parameters and an ``avg`` fp32 reduce."""
    torch.manual_seed(seed)
    with torch.device(mesh.device_type):
        model = Uneven()
    return simple_fsdp(model, mesh, reduce_op="avg")


def uneven_batch(step: int, rank: int, device, batch_size: int = 6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(batch_size, Uneven.IN, generator=g).to(device, torch.bfloat16)
    return x, torch.randint(0, 11, (batch_size,), generator=g).to(device)


def uneven_loss(logits, targets):
    return F.cross_entropy(logits.float(), targets)
