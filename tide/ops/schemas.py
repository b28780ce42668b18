"""The ``tide`` operator schemas: the library's public contract, all in one place.

Shapes (W = world_size, c_i = ceil(d0_i / W), rank r of the group):

all_gather_into_params_(shards, outs, world_size, group_name)
    ``shards[i]`` is this rank's padded shard ``(c_i, *rest)``; ``outs[i]`` is ``(W*c_i, *rest)`` or its
    1-D flattening. Rank r's shard lands in rows ``[r*c_i, (r+1)*c_i)`` of ``outs[i]``. ``outs`` may have
    another float dtype than ``shards``: the cast is fused into the placement. A uint8 shard and its uint8
    output are copied as bytes: other payloads (float8, FSDP2 tensor extensions) travel as uint8 views.

reduce_scatter_params_(grads, shard_grads, scale, accumulate, world_size, group_name)
    ``grads[i]`` is the unpadded unsharded gradient ``(d0_i, *rest)`` (bf16, fp16 or fp32);
    ``shard_grads[i]`` is this rank's padded fp32 shard ``(c_i, *rest)``. Computes, for this rank's rows,
    ``scale * sum_{k=0..W-1} grads_k[i]`` summed in fp32 in rank order (bit-deterministic), rows
    ``>= d0_i`` as zero, and writes it to ``shard_grads[i]`` (adds it when ``accumulate``). A group
    spanning N >= 2 nodes of L ranks (``tide.topology``) sums each node's L contributions in local order
    first, then the N node partials in node order (docs/design.md "Across nodes").

all_gather(shards, world_size, group_name) -> outs
reduce_scatter(inputs, scale, out_dtype, world_size, group_name) -> outs
    Functional forms on padded shapes (``(c_i, *rest)`` <-> ``(W*c_i, *rest)``), each the other's
    backward. ``out_dtype=None`` keeps each input's dtype; the sum is fp32 either way.

all_gather_start(shards, world_size, group_name) -> outs
reduce_scatter_start(grads, scale, out_dtype, world_size, group_name) -> shards
    The graph ops: functional and asynchronous, for traced FX graphs (SimpleFSDP / DTensor under
    ``torch.compile`` or ``make_fx``) in place of c10d's functional collectives. Each output is
    registered with its call's ``tide.ops.works.TideWork``, so the graph's own
    ``torch.ops._c10d_functional.wait_tensor(out)`` completes it; use an output only after that wait.
    ``all_gather_start``: ``shards[i]`` padded ``(c_i, *rest)`` (bf16, fp16, fp32 or uint8), ``outs[i]`` a
    new ``(W*c_i, *rest)`` tensor of the shard's dtype with rank r's shard in rows ``[r*c_i, (r+1)*c_i)``.
    ``reduce_scatter_start``: ``grads[i]`` the unpadded ``(d0_i, *rest)`` gradient as autograd left it
    (bf16, fp16 or fp32, dtypes may differ between i); ``shards[i]`` a new ``(c_i, *rest)`` tensor of
    ``out_dtype`` (None: float32, the reduce dtype) holding exactly what ``reduce_scatter_params_`` writes
    into a fresh fp32 shard (``scale * sum`` in fp32 in rank order, rows ``>= d0_i`` zero), then cast.
    Neither is differentiable: they sit in graphs after autograd, and a backward through their outputs
    raises.

``group_name`` is a registered ``ProcessGroup.group_name``; ``world_size`` must equal its size. Every
list must hold at least one tensor.
"""
import torch
from torch._library.autograd import Info, make_autograd_impl

from tide.meta import checks

lib = torch.library.Library("tide", "DEF")

SCHEMAS = {
    "all_gather_into_params_":
        "all_gather_into_params_(Tensor[] shards, Tensor(a!)[] outs, int world_size, str group_name) -> ()",
    "reduce_scatter_params_":
        "reduce_scatter_params_(Tensor[] grads, Tensor(a!)[] shard_grads, float scale, bool accumulate, "
        "int world_size, str group_name) -> ()",
    "all_gather":
        "all_gather(Tensor[] shards, int world_size, str group_name) -> Tensor[]",
    "reduce_scatter":
        "reduce_scatter(Tensor[] inputs, float scale, ScalarType? out_dtype, int world_size, str group_name) "
        "-> Tensor[]",
    "all_gather_start":
        "all_gather_start(Tensor[] shards, int world_size, str group_name) -> Tensor[]",
    "reduce_scatter_start":
        "reduce_scatter_start(Tensor[] grads, float scale, ScalarType? out_dtype, int world_size, str group_name) "
        "-> Tensor[]",
}
GRAPH_OPS = ("all_gather_start", "reduce_scatter_start")

for _schema in SCHEMAS.values():
    lib.define(_schema)

# The mutating ops return nothing; keep them in traced graphs even when their outputs look unused.
for _name in ("all_gather_into_params_", "reduce_scatter_params_"):
    torch.fx.node.has_side_effect(getattr(torch.ops.tide, _name).default)


# A call without any tensor (empty lists) reaches no backend kernel: the dispatcher runs these catch-alls,
# whose checks raise the tide.<op> error ("<list> is empty") the other kernels' checks would, on every rank
# of a group with CPU collectives (the refusal goes through the call's exchange, tide/ops/calls.py).
def _refuse(op, check, group_name, world_size, tensor_lists):
    try:
        check()
    except (ValueError, TypeError) as e:
        from tide.ops import calls

        calls.refuse(op, group_name, world_size, tensor_lists, e)


def _ag_into_params_without_tensors(shards, outs, world_size, group_name):
    op = "all_gather_into_params_"
    _refuse(op, lambda: checks.check_all_gather_into_params(op, shards, outs, world_size), group_name, world_size,
            (shards, outs))


def _rs_params_without_tensors(grads, shard_grads, scale, accumulate, world_size, group_name):
    op = "reduce_scatter_params_"
    _refuse(op, lambda: checks.check_reduce_scatter_params(op, grads, shard_grads, world_size), group_name,
            world_size, (grads, shard_grads))


def _ag_without_tensors(shards, world_size, group_name):
    _refuse("all_gather", lambda: checks.check_all_gather("all_gather", shards, world_size), group_name,
            world_size, (shards,))


def _rs_without_tensors(inputs, scale, out_dtype, world_size, group_name):
    _refuse("reduce_scatter", lambda: checks.check_reduce_scatter("reduce_scatter", inputs, out_dtype, world_size),
            group_name, world_size, (inputs,))


def _ag_start_without_tensors(shards, world_size, group_name):
    op = "all_gather_start"
    _refuse(op, lambda: checks.check_all_gather(op, shards, world_size, checks.GATHER_DTYPES), group_name, world_size,
            (shards,))


def _rs_start_without_tensors(grads, scale, out_dtype, world_size, group_name):
    op = "reduce_scatter_start"
    _refuse(op, lambda: checks.check_reduce_scatter_start(op, grads, out_dtype, world_size), group_name, world_size,
            (grads,))


for _name, _kernel in (("all_gather_into_params_", _ag_into_params_without_tensors),
                       ("reduce_scatter_params_", _rs_params_without_tensors),
                       ("all_gather", _ag_without_tensors), ("reduce_scatter", _rs_without_tensors),
                       ("all_gather_start", _ag_start_without_tensors),
                       ("reduce_scatter_start", _rs_start_without_tensors)):
    lib.impl(_name, _kernel, "CompositeExplicitAutograd")

# The graph ops have no backward. They get the Autograd kernel torch.library.custom_op gives an op without
# register_autograd: with no input requiring grad it runs the op below autograd, and otherwise the op's
# outputs carry a node whose backward raises (instead of the autograd fallback's warning and a gradient
# silently dropped).
for _name in GRAPH_OPS:
    lib.impl(_name, make_autograd_impl(getattr(torch.ops.tide, _name).default,
                                       Info(_backward_fn=None, _setup_context_fn=None)), "Autograd", with_keyset=True)
