"""Tensor-subclass weights for the FSDP2 tests: torch's ``TwoTensor`` (two inner tensors, every op run on
both), here with its second tensor half the first, so a result that dropped or doubled one of them shows.

:class:`PairWeight` adds FSDP2's extension hooks as upstream's extension tests define them for
``TwoTensor``: both inner shards are gathered, and the unsharded weight is a ``TwoTensor`` again, so its
gradient is one too (FSDP2 reduces a subclass gradient through the subclass's dispatch). A plain
``TwoTensor`` weight has no hooks: FSDP2 gathers its sharded data, itself a ``TwoTensor``, into a plain
unsharded weight.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor


class PairWeight(TwoTensor):
    """A ``TwoTensor`` weight with FSDP2's all-gather extension hooks."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.a, self.b), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        a, b = all_gather_outputs
        if out is not None:  # the outputs are the unsharded weight's inner tensors already
            return None
        return TwoTensor(a, b).to(param_dtype), (a, b)


def as_plain(t: torch.Tensor) -> torch.Tensor:
    """A ``TwoTensor``'s inner tensors stacked (a plain tensor as it is)."""
    return torch.stack([t.a, t.b]) if isinstance(t, TwoTensor) else t


def mlp_stack(kind: type, blocks: int = 3, dim: int = 8) -> nn.Sequential:
    """``blocks`` bias-free MLPs whose weights are ``kind`` (``TwoTensor`` or :class:`PairWeight`) of their
    initial values and half of them; the weights' rows shard evenly on 2 ranks."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, 2 * dim, bias=False), nn.ReLU(),
                                          nn.Linear(2 * dim, dim, bias=False)) for _ in range(blocks)])
    for block in model:
        for linear in (block[0], block[2]):
            w = linear.weight.detach()
            linear.weight = nn.Parameter(kind(w.clone(), w * 0.5))
    return model
