"""Why an FSDP2 collective takes the stock path: one predicate per call kind, each a function of the
call's arguments and of facts fixed per group (docs/fsdp.md has the table of reasons). Of each kind's
reasons, those that can change between two calls of a group whose settings stay are a predicate of their own
(:func:`all_gather_call_reason`, :func:`reduce_call_reason`): the only ones a group decided on TIDE once asks
per call (``tide.fsdp.decide``).

Every input is host-side state that is identical on every rank, so all ranks decide alike (a rank that
took another path than its peers would leave them waiting in a collective). The only facts that need the
machine, the CUDA contract (compute capability, NVLink domain), are looked up once per group and kept in
its TIDE state (``tide.fsdp.decide``).
"""
from __future__ import annotations

import socket
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_common
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

from tide import knobs, routes, topology
from tide.fsdp import joined
from tide.meta.checks import FLOAT_DTYPES
from tide.meta.multinode import Topology
from tide.ops import call_groups

# Every reason a call takes the stock path.
REASONS = (
    "not_enabled", "threaded_ranks", "custom_comm", "capture_before_arena", "capture_multinode", "compiling",
    "functorch", "async_op", "world_size_1", "peer_not_enabled", "compute_capability", "nvlink_domain",
    "post_forward_mesh", "keep_unsharded_storage", "all_gather_output_fn", "cpu_offload", "extension_shard_dim",
    "dtensor_param", "subclass_param", "mixed_param_dtypes", "unsupported_dtype", "reduce_dtype",
    "reduce_scatter_input_fn", "subclass_grad", "noncontiguous_grad", "arena_busy",
)
# Besides these, on a torch whose FSDP2 signatures no seam wrapper fits, every call takes stock as
# "untested_torch:<the function and its parameters>" (tide.fsdp.compat).

# FSDP2's own comm classes: they only choose where stock's staging buffers come from, which TIDE's path has
# none of. Any other comm in a group's slot is the user's (set_custom_all_gather / set_custom_reduce_scatter):
# that collective then keeps it (stock:custom_comm). Looked up by name: torch 2.11 has fewer of them.
STOCK_ALL_GATHERS = tuple(c for c in (getattr(_fsdp_collectives, n, None) for n in (
    "DefaultAllGather", "ProcessGroupAllocAllGather", "SymmMemAllGather")) if c is not None)
STOCK_REDUCE_SCATTERS = tuple(c for c in (getattr(_fsdp_collectives, n, None) for n in (
    "DefaultReduceScatter", "ProcessGroupAllocReduceScatter", "SymmMemReduceScatter")) if c is not None)


# torch 2.15's default all-gather output function (None before): a group with another one keeps stock's.
_DEFAULT_OUTPUT_FN = getattr(_fsdp_collectives, "_default_all_gather_output_fn", None)

# The CUDA contract: Hopper (compute capability 9.0) or newer, and one NVLink domain: at most 8 GPUs,
# all on one host.
MIN_COMPUTE_CAPABILITY = 9
MAX_NVLINK_DOMAIN = 8


def group_dtype(p) -> torch.dtype:
    """The dtype a param is gathered in (its mixed-precision param dtype, else its own)."""
    return p.param_dtype or p.orig_dtype


# Where torch has them: 2.11's traceable FSDP2 (compiled autograd), and functorch's transforms.
_compiled_autograd_enabled = getattr(_fsdp_common, "compiled_autograd_enabled", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def is_tracing() -> bool:
    """Inside torch.compile tracing or (2.11) compiled-autograd traceable FSDP2."""
    if torch.compiler.is_compiling():
        return True
    return _compiled_autograd_enabled is not None and bool(_compiled_autograd_enabled())


def functorch_active() -> bool:
    return _functorch_active is not None and bool(_functorch_active())


def common_reason(device: torch.device) -> str | None:
    if is_tracing():
        return "compiling"
    if functorch_active():
        return "functorch"
    return None


def contract_reason(compute_capability_major: int, hosts: Sequence[str], nodes: Topology | None = None,
                    serve_multinode: bool = False) -> str | None:
    """The CUDA contract for a group on GPUs of this compute capability, its ranks on these hosts (in
    rank order), forming ``nodes`` (``tide.topology``: real or emulated; None: one node). A node must be one
    NVLink domain: at most 8 GPUs on one host. A group of several nodes runs the multi-node schedule
    (``tide/multinode/schedule.py``: rail rounds, intra-node legs on a node arena's copy engines) when
    ``serve_multinode`` (opt-in on CUDA, ``TIDE_CUDA_MULTINODE=1``: with several GPUs per node its speed is
    not measured yet, docs/performance.md); else it takes stock."""
    if compute_capability_major < MIN_COMPUTE_CAPABILITY:
        return "compute_capability"
    if topology.is_multinode(nodes):
        if not serve_multinode:
            return "nvlink_domain"
        L = nodes.local_size
        per_node = [hosts[i:i + L] for i in range(0, len(hosts), L)]
    else:
        per_node = [hosts]
    if any(len(h) > MAX_NVLINK_DOMAIN or len(set(h)) > 1 for h in per_node):
        return "nvlink_domain"
    return None


def serve_multinode_on_cuda() -> bool:
    """``TIDE_CUDA_MULTINODE=1``: FSDP2 groups spanning nodes run the multi-node schedule on CUDA too."""
    return knobs.flag("TIDE_CUDA_MULTINODE")


def group_facts(group) -> tuple[list[str], bool]:
    """Host names of ``group``'s ranks (group-rank order) and whether they all serve multi-node groups on
    CUDA, exchanged once through the default store (no device collective: a CUDA collective on ranks that
    share a GPU may not be possible). Every rank asks at its group's first TIDE collective, the same point
    of FSDP's schedule on all of them. Ranks whose ``TIDE_CUDA_MULTINODE`` differ would take different
    paths and wait for each other forever: that raises on every rank instead, as does an invalid value."""
    store = dist.distributed_c10d._get_default_store()
    prefix = f"tide/hosts/{group.group_name}/"
    try:
        mine, invalid = str(int(serve_multinode_on_cuda())), None
    except ValueError as e:  # published first: the peers raise too instead of waiting for this rank
        mine, invalid = "invalid", e
    store.set(prefix + str(dist.get_rank()), f"{mine} {socket.gethostname()}")
    facts = [store.get(prefix + str(r)).decode().split(" ", 1) for r in dist.get_process_group_ranks(group)]
    if invalid is not None:
        raise invalid
    bad = [i for i, (f, _) in enumerate(facts) if f == "invalid"]
    if bad:
        raise ValueError(f"tide.fsdp: group ranks {bad} of group {group.group_name!r} set TIDE_CUDA_MULTINODE to an "
                         "invalid value (accepted: 0 or 1)")
    flags = {flag for flag, _ in facts}
    if len(flags) > 1:
        raise RuntimeError(f"tide.fsdp: the ranks of group {group.group_name!r} disagree on TIDE_CUDA_MULTINODE "
                           f"(set on group ranks {[i for i, (f, _) in enumerate(facts) if f == '1']}): set it alike "
                           "on every rank")
    return [host for _, host in facts], flags == {"1"}


def _device_reason(device: torch.device, group, comm) -> str | None:
    if device.type != "cuda":
        return None
    if comm.contract is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        hosts, serve_multinode = group_facts(group)
        comm.contract = (contract_reason(torch.cuda.get_device_capability(index)[0], hosts, routes.of(group).topology,
                                         serve_multinode),)
    return comm.contract[0]


def capture_reason(device: torch.device, group, route=None) -> str | None:
    """Under CUDA-graph capture, what TIDE cannot capture of ``group`` (its ``route``, ``tide.routes``, when the
    caller holds it): a group whose arena does not exist yet (its rendezvous is collective host work; run one
    step eagerly first, as torchtitan's warm-up does), and a multi-node group (its rails' exchanges are not
    captured)."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return None
    route = route or routes.of(group)
    if route.multinode:
        return "capture_multinode"
    return "capture_before_arena" if route.holder is None else None


def param_reason(p) -> str | None:
    if p.offload_to_cpu:
        return "cpu_offload"
    if p.is_dtensor and not _data_parallel_spmd(p):
        return "dtensor_param"
    return None


def _data_parallel_spmd(p) -> bool:
    """torch 2.14+ ``fully_shard(dp_mesh_dims=...)`` (torchtitan's ``spmd_types`` backend) makes every
    parameter a DTensor on the SPMD mesh; when every axis of that mesh is data parallel, its local tensor
    is the plain dim-0 shard TIDE serves (TP/EP axes keep ``dtensor_param``)."""
    return (getattr(p.mesh_info, "is_spmd_mesh", False)
            and len(getattr(p, "_dp_dim_indices", ())) == p._spmd_mesh.ndim)


def static_all_gather_reason(fsdp_params) -> str | None:
    """The reasons fixed for a group once FSDP's lazy init has set its dtypes."""
    dtype = None
    for p in fsdp_params:
        if (reason := param_reason(p)) is not None:
            return reason
        if hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather"):
            # Its inputs travel as bytes (tide.fsdp.extensions); stock chunk-cats them on dim i as if each
            # had the shard's shape, which TIDE does not model.
            if p.fsdp_placement.dim != 0:
                return "extension_shard_dim"
            continue
        if _subclass(p._sharded_param_data):
            return "subclass_param"
        d = group_dtype(p)
        if dtype is not None and d != dtype:
            return "mixed_param_dtypes"
        if d not in FLOAT_DTYPES:
            return "unsupported_dtype"
        dtype = d
    return None


def _subclass(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor subclass: an op call with one is dispatched through the subclass's
    ``__torch_dispatch__``, which gives the call the subclass's meaning (``TwoTensor`` runs it once per
    inner tensor: two collectives, and an accumulating reduce adding twice). Stock FSDP2's copy-in and
    copy-out are dispatched the same way, so such calls keep stock's semantics by taking stock."""
    return type(t) is not torch.Tensor


def extension_inputs_reason(inputs) -> str | None:
    """``"subclass_param"`` when a tensor extension's pre-all-gather gave a tensor subclass as an all-gather
    input (``inputs``: ``tide.fsdp.extensions.pre_all_gather``'s), else None."""
    return "subclass_param" if any(_subclass(t) for ins in inputs for t in ins or ()) else None


def threaded(comm, group) -> bool:
    """Whether ``group``'s ranks are threads of this process (torch's threaded test backend, which PyTorch's
    own FSDP2 tests use): TIDE's call agreement and counters are per process. Kept on ``comm`` per group."""
    if comm.threaded is None or comm.threaded[0] is not group:
        comm.threaded = (group, call_groups.threaded_ranks(group))
    return comm.threaded[1]


def _call_reason(comm, group, stock_comms: tuple, device: torch.device) -> str | None:
    """The reasons both call kinds check first: a group not opted in (``comm``, its TIDE state, is None),
    ranks that are threads of one process, a collective whose FSDP2 comm is the user's own (not one of
    ``stock_comms``; a subclass of one is the user's), then :func:`common_reason`."""
    if comm is None:
        return "not_enabled"
    if group is not None and threaded(comm, group):
        return "threaded_ranks"
    if type(comm.fsdp_comm()) not in stock_comms:
        return "custom_comm"
    return common_reason(device)


def all_gather_reason(fsdp_params, group, async_op, device, comm) -> str | None:
    """Why this ``foreach_all_gather`` call must take the stock path, or None (``comm``: the group's
    ``TideAllGather``, None when it is not enabled). The group's fixed reasons come after these:
    :func:`static_all_gather_reason`, which ``tide.fsdp.decide`` asks once per group, never while tracing."""
    if (reason := _call_reason(comm, group, STOCK_ALL_GATHERS, device)) is not None:
        return reason
    if async_op:
        return "async_op"
    if group.size() == 1:
        return "world_size_1"
    if (reason := joined.reason(comm.param_group, group)) is not None:
        return reason
    if (reason := _device_reason(device, group, comm)) is not None:
        return reason
    if getattr(comm.param_group, "_all_gather_output_fn", _DEFAULT_OUTPUT_FN) is not _DEFAULT_OUTPUT_FN:
        return "all_gather_output_fn"
    return _all_gather_state_reason(fsdp_params, group, device)  # tracing was asked first (_call_reason)


def all_gather_call_reason(fsdp_params, group, device, route=None) -> str | None:
    """The reasons that can change between two all-gathers of a group while its settings stay: tracing,
    functorch, a CUDA-graph capture (``route``: the group's, ``tide.routes``, when the caller holds it), and
    the params' state. A group's all-gather decided on TIDE once (``tide.fsdp.decide``) asks only these per
    call."""
    return common_reason(device) or _all_gather_state_reason(fsdp_params, group, device, route)


def _all_gather_state_reason(fsdp_params, group, device, route=None) -> str | None:
    if (reason := capture_reason(device, group, route)) is not None:
        return reason
    for p in fsdp_params:
        if p.sharded_state != ShardedState.SHARDED:
            return "post_forward_mesh"
        if getattr(p, "keep_unsharded_storage", False):  # torch 2.15+: outputs live across reshard
            return "keep_unsharded_storage"
    return None


def arena_reason(plan_mode: str) -> str | None:
    """``"arena_busy"`` when the all-gather found no usable arena slot (``tide.fsdp.wiring.plan_all_gather``
    answered ``"busy"``: outputs hold every slot), else None."""
    return "arena_busy" if plan_mode == "busy" else None


def reduce_reason(fsdp_params, grads, rs_group, comm, reduce_dtype, device,
                  custom_input_fn: bool = False) -> str | None:
    """Why this ``foreach_reduce`` call must take the stock path, or None for TIDE. Gradients of several
    dtypes in one group (torch 2.15: fp32 norm weights beside bf16 ones) are TIDE's: each is summed in
    fp32. HSDP's all-reduce and an all-reduce hook follow TIDE-RS as they follow stock's reduce-scatter
    (tide.fsdp.replicate). ``comm``: the group's ``TideReduceScatter``, None when it is not enabled."""
    if (reason := _call_reason(comm, rs_group, STOCK_REDUCE_SCATTERS, device)) is not None:
        return reason
    if custom_input_fn:
        return "reduce_scatter_input_fn"
    if rs_group is None or rs_group.size() == 1:
        return "world_size_1"
    if (reason := joined.reason(comm.param_group, rs_group)) is not None:
        return reason
    if (reason := _device_reason(device, rs_group, comm)) is not None:
        return reason
    return _reduce_state_reason(fsdp_params, grads, rs_group, comm, reduce_dtype, device)  # tracing asked first


def reduce_call_reason(fsdp_params, grads, rs_group, comm, reduce_dtype, device, route=None) -> str | None:
    """The reasons that can change between two reduces of a group while its settings stay: tracing,
    functorch, a CUDA-graph capture (``route``: the group's, when the caller holds it), and the gradients (a
    reduce decided on TIDE once per group, ``tide.fsdp.decide``, asks only these per call)."""
    return common_reason(device) or _reduce_state_reason(fsdp_params, grads, rs_group, comm, reduce_dtype, device,
                                                         route)


def _reduce_state_reason(fsdp_params, grads, rs_group, comm, reduce_dtype, device, route=None) -> str | None:
    if (reason := capture_reason(device, rs_group, route)) is not None:
        return reason
    fp32_reduce = reduce_dtype == torch.float32
    for g in grads:
        # One test per gradient on a steady call; the reasons, in order, only when it fails.
        if type(g) is torch.Tensor and g.is_contiguous() and (
                (fp32_reduce and g.dtype in FLOAT_DTYPES) or (reduce_dtype is None and g.dtype == torch.float32)):
            continue
        if _subclass(g):  # e.g. the gradient of a tensor extension's subclass parameter
            return "subclass_grad"
        if not g.is_contiguous():
            return "noncontiguous_grad"
        if g.dtype not in FLOAT_DTYPES:
            return "unsupported_dtype"
        # TIDE sums in fp32 into fp32 shards; a bf16/fp16 reduce (and fp16's pre/post-divide) stays stock.
        if (reduce_dtype or g.dtype) != torch.float32:
            return "reduce_dtype"
    checked = comm.checked_params
    for p in fsdp_params:
        if id(p) not in checked:
            if (reason := param_reason(p)) is not None:
                return reason
            checked.add(id(p))
    return None
