"""Shared op cases: uneven shapes, per-rank random data and the float64 reference of each collective.

Every rank can rebuild every other rank's inputs from ``(seed, rank)``, so each rank checks the full
collective result against a float64 reference computed locally, without another collective.
"""
from __future__ import annotations

import torch

from tide.meta.layout import rows_and_row_numel, shard_rows


def param_shapes(world_size: int) -> list[tuple[int, ...]]:
    """Unsharded shapes that shard unevenly on ``world_size`` ranks, incl. d0 < W and a 0-d param."""
    W = world_size
    return [(2 * W + 1, 5), (3,), (1, 4), (W - 1 or 1, 2, 3), (4 * W, 3), ()]


def rank_generator(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1009 + rank)


def padded_shard(shape, world_size: int, rank: int, dtype, gen) -> torch.Tensor:
    """Rank ``rank``'s padded shard of a random parameter: real rows random, padding rows zero (FSDP2)."""
    d0, row = rows_and_row_numel(shape)
    c = shard_rows(d0, world_size)
    rest = tuple(shape[1:])
    full = torch.zeros((world_size * c, *rest), dtype=torch.float64)
    full.view(-1)[: d0 * row] = torch.randn(d0 * row, generator=gen, dtype=torch.float64)
    return full[rank * c:(rank + 1) * c].to(dtype).contiguous()


def random_bytes(shape, gen) -> torch.Tensor:
    """A uint8 payload (the all-gather's byte copies: float8 data, tensor extensions' inputs)."""
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def random_grad(shape, dtype, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def reference_all_gather(shards_by_rank: list[torch.Tensor], out_dtype) -> torch.Tensor:
    """Param-major gathered tensor: rank r's shard in rows [r*c, (r+1)*c), cast to ``out_dtype``."""
    return torch.cat([s.to(out_dtype) for s in shards_by_rank], dim=0)


def reference_reduce_scatter(grads_by_rank: list[torch.Tensor], world_size: int, rank: int, scale: float):
    """float64 ``scale * sum_k grads_k[rank's rows]`` padded to c rows with zeros, and the exact fp32
    rank-order sum the ops promise (acc = x0; acc += x1; ...; acc *= scale)."""
    shape = tuple(grads_by_rank[0].shape)
    d0, row = rows_and_row_numel(shape)
    c = shard_rows(d0, world_size)
    start, stop = min(rank * c, d0), min(rank * c + c, d0)
    n = (stop - start) * row
    flat = [g.reshape(-1)[start * row:start * row + n] for g in grads_by_rank]
    exact64 = torch.zeros(c * row, dtype=torch.float64)
    exact64[:n] = sum(f.to(torch.float64) for f in flat) * scale
    acc = flat[0].to(torch.float32, copy=True)
    for f in flat[1:]:
        acc.add_(f)
    acc.mul_(scale)
    fp32 = torch.zeros(c * row, dtype=torch.float32)
    fp32[:n] = acc
    out_shape = (c, *shape[1:]) if shape else (1,)
    return exact64.view(out_shape), fp32.view(out_shape)


def fp32_sum_tolerance(grads_by_rank: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Bound on |fp32 rank-order sum - exact sum|: W rounding steps of at most eps/2 * running |sum|."""
    mags = sum(g.to(torch.float64).abs() for g in grads_by_rank)
    return len(grads_by_rank) * 2.0 ** -24 * mags * abs(scale) + 1e-30
