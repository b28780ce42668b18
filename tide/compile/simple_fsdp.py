"""SimpleFSDP (torchtitan's compile-first FSDP, arXiv 2411.00284) in its smallest form, for ``python -m tide.train
--compile``, the compiled variants of bench/train_step.py and the tests of ``tide.compile``.

- :func:`simple_fsdp`: every parameter becomes a ``Shard(0)`` DTensor over a 1-D mesh, and each read of it
  all-gathers it to a plain tensor in ``param_dtype`` whose gradient is reduce-scattered in ``reduce_dtype``
  (torchtitan's ``replicate_compute``), so a compiled step holds DTensor's functional c10d collectives;
- :func:`reshard_after_forward`: Inductor's joint-graph pass that makes the backward gather the parameters
  again instead of keeping the forward's gathered copies alive until then (torchtitan's
  ``reshard_after_forward``; without it the compiled step holds every gathered parameter at once);
- :func:`best_stock_options`: the Inductor settings that give compiled stock FSDP its best bucketing and overlap on
  the torch it runs on, what TIDE's compiled steps are compared with.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn as nn
from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy


def replicate_compute(param, param_dtype, reduce_dtype, reduce_op="sum") -> torch.Tensor:
    return param.redistribute(placements=[Replicate()], forward_dtype=param_dtype,
                              backward_dtype=reduce_dtype).to_local(grad_placements=[Partial(reduce_op)])


def _fsdp_class(cls, names, param_dtype, reduce_dtype, reduce_op):
    """A subclass of ``cls`` whose parameters, read by name, are gathered (the sharded ones stay in
    ``_parameters``, where the optimizer and ``state_dict`` find them)."""
    props = {name: property(lambda self, n=name: replicate_compute(self._parameters[n], param_dtype, reduce_dtype,
                                                                   reduce_op))
             for name in names}
    return type(f"SimpleFSDP{cls.__name__}", (cls,), props)


def simple_fsdp(model: nn.Module, mesh, *, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                reduce_op: str = "sum") -> nn.Module:
    """Shard every parameter of ``model`` on dim 0 over ``mesh`` and gather it at each read (tied parameters stay
    one); gradients are reduced by ``reduce_op`` (``sum`` or ``avg``). Every rank must hold the same full
    parameters (the same seed): each keeps its own shard of them, with no communication (no scatter, which gloo
    cannot do with CUDA tensors)."""
    sharded = {}
    for module in model.modules():
        names = [n for n, p in module._parameters.items() if p is not None]
        for name in names:
            p = module._parameters[name]
            if id(p) not in sharded:
                sharded[id(p)] = nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)], src_data_rank=None))
            module._parameters[name] = sharded[id(p)]
        if names:
            module.__class__ = _fsdp_class(type(module), names, param_dtype, reduce_dtype, reduce_op)
    return model


def _is(node, op) -> bool:
    return node.op == "call_function" and node.target is op


class _RecomputeGathers(CustomGraphPass):
    """Tags each all-gather of a parameter (a chain of one-input nodes from a graph input: the dtype cast, the
    pad of a short shard), its wait and the views of the wait's one-user chain (the slice of a short shard)
    ``MUST_RECOMPUTE``, so the partitioner gathers them again in the backward."""

    def __call__(self, graph) -> None:
        c10d = torch.ops._c10d_functional
        gather, wait = c10d.all_gather_into_tensor.default, c10d.wait_tensor.default
        for node in list(graph.nodes):
            if not (_is(node, wait) and _is(node.args[0], gather)):
                continue
            chain, source = [node, node.args[0]], node.args[0].all_input_nodes[0]
            while source.op == "call_function" and len(source.all_input_nodes) == 1:
                chain.append(source)
                source = source.all_input_nodes[0]
            if source.op != "placeholder":  # not a parameter's gather
                continue
            view = node
            while len(view.users) == 1 and getattr(next(iter(view.users)).target, "is_view", False):
                view = next(iter(view.users))
                chain.append(view)
            for n in chain:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                # The partitioner saves the nodes on the border of two checkpointed regions (by ac_graph_id): one
                # id far from activation checkpointing's keeps these out of its regions.
                n.meta["ac_graph_id"] = 100000

    def uuid(self) -> bytes:
        return get_hash_for_files((str(Path(__file__).resolve()),))


@contextlib.contextmanager
def reshard_after_forward():
    """Within it, Inductor compiles SimpleFSDP graphs whose backward gathers the parameters again (its
    ``joint_custom_post_pass``, which must be unset)."""
    if config.joint_custom_post_pass is not None:
        raise RuntimeError("simple_fsdp.reshard_after_forward: torch._inductor.config.joint_custom_post_pass is "
                           f"already set ({config.joint_custom_post_pass!r})")
    with config.patch(joint_custom_post_pass=_RecomputeGathers()):
        yield


def best_stock_options(device_type: str) -> dict:
    """Inductor's settings for compiled stock SimpleFSDP at its best on this torch and device (for
    ``config.patch``). CUDA: its overlap scheduling, which buckets the FSDP collectives and moves them for
    overlap by estimated runtimes (``aten_distributed_optimizations.enable_overlap_scheduling``; torch 2.14+
    also runs ``simple_overlap`` by default). CPU, where those estimates need a GPU: its FSDP bucketing."""
    if device_type == "cuda" and hasattr(config, "aten_distributed_optimizations"):
        return {"aten_distributed_optimizations.enable_overlap_scheduling": True}
    return {"bucket_all_gathers_fx": "only_fsdp", "bucket_reduce_scatters_fx": "only_fsdp"}
