"""The tests' own FSDP2 tensor extension: a weight gathered as int8 rows with one fp32 scale per row.

``fsdp_pre_all_gather`` turns this rank's shard into two all-gather inputs of other dtypes than the
weight's (int8 rows and their fp32 scales, the second one a metadata tensor of another shape);
``fsdp_post_all_gather`` rebuilds the unsharded weight in the param dtype from every rank's rows and
scales. The quantization is lossy but deterministic, so stock FSDP2 and TIDE train alike bit for bit.
Every other op unwraps to the fp32 master data (the optimizer updates it in place).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree

aten = torch.ops.aten
# Ops whose results stay weights of this kind (FSDP2's sharding and the optimizer's state creation).
_KEEP_KIND = {aten.new_zeros, aten.empty_like, aten.zeros_like, aten.slice, aten.split, aten.split_with_sizes,
              aten.view, aten.copy_, aten.clone, aten.detach, aten.alias, aten._to_copy, aten.as_strided}


class Int8RowsWeight(torch.Tensor):
    """A weight whose FSDP2 all-gather moves int8 rows and per-row fp32 scales; counts its hooks' calls."""

    calls = {"pre": 0, "post": 0}

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor):
        self._data = data

    def __repr__(self):
        return f"Int8RowsWeight({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Int8RowsWeight(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func.overloadpacket not in _KEEP_KIND:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        Int8RowsWeight.calls["pre"] += 1
        rows = self._data.float()
        scale = rows.abs().amax(dim=1).clamp(min=1e-12) / 127
        return (torch.round(rows / scale[:, None]).to(torch.int8), scale), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        Int8RowsWeight.calls["post"] += 1
        rows, scale = all_gather_outputs
        weight = (rows.float() * scale[:, None]).to(param_dtype)
        if out is not None:
            # The backward's re-gather writes the param autograd saved in forward: FSDP2 keeps its version
            # as its own copy-out does.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(weight)
            return None
        return weight, (weight,)


def int8_rows(world_size: int):
    """A ``before_shard`` that makes every 2-D weight of the blocks whose rows shard evenly on
    ``world_size`` ranks an :class:`Int8RowsWeight` (FSDP2 needs padded-size inputs for uneven shards,
    which a per-row scale is not); the rest stay plain, in the same groups."""
    def convert(model) -> None:
        for layer in model.layers:
            for module in layer.modules():
                w = getattr(module, "weight", None)
                if isinstance(module, nn.Linear) and w.shape[0] % world_size == 0:
                    module.weight = nn.Parameter(Int8RowsWeight(w.data.clone()), requires_grad=True)
    return convert

