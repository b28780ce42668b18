"""FSDP2 tensor extensions (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) on TIDE-AG.

A param whose local tensor defines both hooks (torchao's float8 weights with
``enable_fsdp_float8_all_gather=True``; any subclass following FSDP2's contract) is gathered as its
pre-all-gather outputs. FSDP's own ``all_gather_inputs`` runs the hook, keeping its metadata for the
post-all-gather as stock's all-gather does; each 1-D output is one input of the op. FSDP's
``all_gather_outputs`` for them, created by its own ``init_all_gather_outputs`` from those inputs' numels
and dtypes as stock's copy-out creates them, receive every rank's bytes straight: the op moves uint8 views
of both, so every dtype travels unchanged (float8 payloads, fp32 scales). FSDP's unshard then calls
``fsdp_post_all_gather`` on those outputs, as it does after stock's copy-out; nothing else runs in between.

Every other param passes its padded sharded data, which the op casts into its one output in the param
dtype. A group mixing both kinds is one call.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tide.fsdp import shard_dims
from tide.fsdp.fallbacks import group_dtype


def has_hooks(fsdp_param) -> bool:
    """Whether the param's local tensor is a tensor extension (FSDP2 requires both hooks or neither)."""
    return hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather")


def hooked(fsdp_params) -> tuple[bool, ...]:
    """Per param, :func:`has_hooks`; empty when no param of the group has them (the common case)."""
    flags = tuple(has_hooks(p) for p in fsdp_params)
    return flags if any(flags) else ()


def pre_all_gather(fsdp_params, flags: Sequence[bool]) -> list:
    """Each hooked param's all-gather inputs (1-D views of its ``fsdp_pre_all_gather`` outputs), None for
    the others (``flags``: :func:`hooked`). Call it on the stream stock's copy-in runs on."""
    return [p.all_gather_inputs if f else None for p, f in zip(fsdp_params, flags)]


def output_specs(fsdp_param, inputs: Sequence[torch.Tensor] | None) -> tuple[list[int], list[torch.dtype]]:
    """(numel, dtype) of each of the param's all-gather inputs, one rank's: its extension's ``inputs``, or
    else its padded sharded data in the param dtype. For an extension whose inputs are not known yet (an
    arena sized before its first all-gather) that is an estimate: float8 takes less."""
    if inputs is None:
        return [fsdp_param._sharded_param_data.numel()], [group_dtype(fsdp_param)]
    return [t.numel() for t in inputs], [t.dtype for t in inputs]


def op_pairs(fsdp_params, inputs: list, outs: Sequence[torch.Tensor], world_size: int) -> tuple[list, list]:
    """The op's (shards, outs) of a group with extensions: each extension input and its output as uint8
    views; the other params' (sharded data, output) pairs as ``shard_dims.all_gather_args`` gives them
    (their ``Shard(i)`` block views), keeping the group's param order."""
    shards_out, outs_out = [], []
    k = 0
    for p, ins in zip(fsdp_params, inputs):
        if ins is None:
            s, o = shard_dims.all_gather_args([p], [p._sharded_param_data], [outs[k]], world_size)
            k += 1
        else:
            s = [t.view(torch.uint8) for t in ins]
            o = [out.view(torch.uint8) for out in outs[k:k + len(ins)]]
            k += len(ins)
        shards_out += s
        outs_out += o
    return shards_out, outs_out


def keep_inputs_for(inputs: list | None, stream: torch.Stream, device: torch.device) -> None:
    """The extension inputs were allocated on the copy-in stream and are read on ``stream``: their blocks are
    not reused before that stream's work so far has run (the caller drops them after the call)."""
    if inputs is None or device.type != "cuda":
        return
    for ins in inputs:
        for t in ins or ():
            t.record_stream(stream)
