"""A SimpleFSDP toy for the compile tests: every parameter is a ``Shard(0)`` DTensor, and each read of it
all-gathers it to a plain tensor in ``param_dtype`` whose gradient is reduce-scattered in ``reduce_dtype``
(torchtitan's ``replicate_compute``), so a compiled step holds DTensor's functional c10d collectives.

The model has an uneven Linear (7 rows on 2 and 3 ranks), tied embedding/head weights and an
activation-checkpointed block."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, HIDDEN = 16, 8, 7


def replicate_compute(param, param_dtype, reduce_dtype):
    return param.redistribute(placements=[Replicate()], forward_dtype=param_dtype,
                              backward_dtype=reduce_dtype).to_local(grad_placements=[Partial()])


def _fsdp_class(cls, names, param_dtype, reduce_dtype):
    """A subclass of ``cls`` whose parameters, read by name, are gathered (the sharded ones stay in
    ``_parameters``)."""
    props = {name: property(lambda self, n=name: replicate_compute(self._parameters[n], param_dtype, reduce_dtype))
             for name in names}
    return type(f"SimpleFSDP{cls.__name__}", (cls,), props)


def simple_fsdp(model: nn.Module, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32) -> nn.Module:
    """Shard every parameter on dim 0 over ``mesh`` and gather it at each read (tied parameters stay one)."""
    sharded = {}
    for module in model.modules():
        names = [n for n, p in module._parameters.items() if p is not None]
        for name in names:
            p = module._parameters[name]
            if id(p) not in sharded:
                # every rank built the same model: each keeps its own shard (no scatter, which gloo cannot do
                # with CUDA tensors)
                sharded[id(p)] = nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)], src_data_rank=None))
            module._parameters[name] = sharded[id(p)]
        if names:
            module.__class__ = _fsdp_class(type(module), names, param_dtype, reduce_dtype)
    return model


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)       # weight (7, 8): uneven shards
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


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
