"""Fake (meta) kernels of the ``tide`` ops, one per op: shapes and checks only, no data, no collective
(FakeTensor tracing and ``torch.compile`` run these)."""
import torch

from tide.meta import checks


@torch.library.register_fake("tide::all_gather_into_params_")
def all_gather_into_params_fake(shards, outs, world_size, group_name):
    checks.check_all_gather_into_params("all_gather_into_params_", shards, outs, world_size)
    checks.check_no_grad("all_gather_into_params_", (("shards", shards), ("outs", outs)))


@torch.library.register_fake("tide::reduce_scatter_params_")
def reduce_scatter_params_fake(grads, shard_grads, scale, accumulate, world_size, group_name):
    checks.check_reduce_scatter_params("reduce_scatter_params_", grads, shard_grads, world_size)
    checks.check_no_grad("reduce_scatter_params_", (("grads", grads), ("shard_grads", shard_grads)))


@torch.library.register_fake("tide::all_gather")
def all_gather_fake(shards, world_size, group_name):
    checks.check_all_gather("all_gather", shards, world_size)
    return [s.new_empty((world_size * s.shape[0], *s.shape[1:])) for s in shards]


@torch.library.register_fake("tide::reduce_scatter")
def reduce_scatter_fake(inputs, scale, out_dtype, world_size, group_name):
    checks.check_reduce_scatter("reduce_scatter", inputs, out_dtype, world_size)
    return [
        x.new_empty((x.shape[0] // world_size, *x.shape[1:]), dtype=out_dtype or x.dtype) for x in inputs
    ]
