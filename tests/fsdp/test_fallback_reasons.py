"""Every reason a collective takes the stock path, triggered on CPU through the pure predicates of
tide.fsdp.fallbacks (with stand-ins for FSDP2's param and group objects); tests/fsdp/test_fallbacks.py
trains through the cases FSDP2 can build on CPU."""
import types

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (DefaultAllGather, DefaultReduceScatter,
                                                                   ProcessGroupAllocAllGather,
                                                                   ProcessGroupAllocReduceScatter)
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

from tide import registry
from tide.fsdp import decide, fallbacks
from tide.fsdp.decide import TideAllGather, TideReduceScatter

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def _param(**kw):
    p = types.SimpleNamespace(fsdp_placement=types.SimpleNamespace(dim=0), offload_to_cpu=False, is_dtensor=False,
                              _sharded_local_tensor=torch.empty(1), _sharded_param_data=torch.empty(1),
                              param_dtype=torch.bfloat16,
                              orig_dtype=torch.float32, sharded_state=ShardedState.SHARDED,
                              mesh_info=types.SimpleNamespace(is_spmd_mesh=False))
    for k, v in kw.items():
        setattr(p, k, v)
    return p


class _Group:
    group_name = "stand-in"

    def __init__(self, size=2, backend="gloo"):
        self._size = size
        self._backend = backend

    def size(self):
        return self._size

    def getBackendName(self):  # noqa: N802 (ProcessGroup's name)
        return self._backend


class _Extension(torch.Tensor):
    """A shard type with FSDP2's all-gather extension hook."""

    def fsdp_pre_all_gather(self, *args):
        raise AssertionError("not called")


def _extension():
    return torch.empty(1).as_subclass(_Extension)


def _pair():
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.randn(4, 2), torch.randn(4, 2))


@pytest.fixture(autouse=True)
def _no_capture(monkeypatch):
    """No CUDA here: the CUDA-device cases ask a capture query that answers "not capturing"."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


class _ParamGroup(types.SimpleNamespace):
    """A stand-in FSDPParamGroup, its first collective already joined by every rank (``tide.fsdp.joined``:
    ``joined`` is that join's verdict, None: every rank runs it on TIDE)."""

    __eq__, __hash__ = object.__eq__, object.__hash__  # a group is itself, as in the weak registry FSDP's are

    def __init__(self, joined=None, **kw):
        super().__init__(**kw)
        registry.joined_groups[self] = (joined,)


def _tide_all_gather(fsdp_comm=None, output_fn=None, joined=None):
    """An enabled group's all-gather state; its FSDP2 comm is ``fsdp_comm`` (default: FSDP2's own)."""
    param_group = _ParamGroup(joined, _all_gather_comm=fsdp_comm or DefaultAllGather())
    if output_fn is not None:
        param_group._all_gather_output_fn = output_fn
    return TideAllGather(param_group)


# comm: "tide" (enabled, FSDP2's comm in the group's slot), None (not enabled) or a TideAllGather/TideReduceScatter.
# contract: the CUDA contract's verdict for the group (as looked up once per group); ... = not looked up
def _ag(params=None, group=None, async_op=False, device=CPU, comm="tide", contract=..., output_fn=None, joined=None):
    comm = _tide_all_gather(output_fn=output_fn, joined=joined) if comm == "tide" else comm
    if contract is not ...:
        comm.contract = (contract,)
    params = params or [_param()]
    return (fallbacks.all_gather_reason(params, group or _Group(), async_op, device, comm)
            or fallbacks.static_all_gather_reason(params))


def _tide_reduce_scatter(fsdp_comm=None, joined=None):
    param_group = _ParamGroup(joined, _reduce_scatter_comm=fsdp_comm or DefaultReduceScatter())
    return TideReduceScatter(param_group, "in_place")


class _UserAllGather(AllGather):
    """A user's own comm (FSDPModule.set_custom_all_gather)."""

    def allocate(self, size, *, dtype, device):
        raise AssertionError("not called")

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        raise AssertionError("not called")


class _UserReduceScatter(ReduceScatter):
    def allocate(self, size, *, dtype, device):
        raise AssertionError("not called")

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        raise AssertionError("not called")


def _rs(params=None, grads=None, group=None, reduce_dtype=torch.float32, device=CPU, comm="tide", contract=...,
        custom_input_fn=False, joined=None):
    comm = _tide_reduce_scatter(joined=joined) if comm == "tide" else comm
    if contract is not ...:
        comm.contract = (contract,)
    grads = grads if grads is not None else [torch.randn(4, 2).bfloat16()]
    return fallbacks.reduce_reason(params or [_param()], grads, group or _Group(), comm, reduce_dtype, device,
                                   custom_input_fn)


CASES = {
    # reason: (all-gather call or None, reduce-scatter call or None), each made to take that path
    "not_enabled": (lambda: _ag(comm=None), lambda: _rs(comm=None)),
    "threaded_ranks": (lambda: _ag(group=_Group(backend="threaded")), lambda: _rs(group=_Group(backend="threaded"))),
    "custom_comm": (lambda: _ag(comm=_tide_all_gather(fsdp_comm=_UserAllGather())),
                    lambda: _rs(comm=_tide_reduce_scatter(fsdp_comm=_UserReduceScatter()))),
    "async_op": (lambda: _ag(async_op=True), None),
    "world_size_1": (lambda: _ag(group=_Group(1)), lambda: _rs(group=_Group(1))),
    "peer_not_enabled": (lambda: _ag(joined="peer_not_enabled"), lambda: _rs(joined="peer_not_enabled")),
    "compute_capability": (lambda: _ag(device=CUDA, contract=fallbacks.contract_reason(8, ["h", "h"])),
                           lambda: _rs(device=CUDA, contract=fallbacks.contract_reason(8, ["h", "h"]))),
    "nvlink_domain": (lambda: _ag(device=CUDA, contract=fallbacks.contract_reason(9, ["h1", "h2"])),
                      lambda: _rs(device=CUDA, contract=fallbacks.contract_reason(9, ["h"] * 9))),
    "post_forward_mesh": (lambda: _ag(params=[_param(sharded_state=ShardedState.SHARDED_POST_FORWARD)]), None),
    "keep_unsharded_storage": (lambda: _ag(params=[_param(), _param(keep_unsharded_storage=True)]), None),
    "all_gather_output_fn": (lambda: _ag(output_fn=lambda params, result, world_size: None), None),
    "cpu_offload": (lambda: _ag(params=[_param(offload_to_cpu=True)]),
                    lambda: _rs(params=[_param(offload_to_cpu=True)])),
    "dtensor_param": (lambda: _ag(params=[_param(is_dtensor=True)]), lambda: _rs(params=[_param(is_dtensor=True)])),
    "extension_shard_dim": (lambda: _ag(params=[_param(), _param(_sharded_local_tensor=_extension(),
                                                                 fsdp_placement=types.SimpleNamespace(dim=1))]),
                            None),
    "mixed_param_dtypes": (lambda: _ag(params=[_param(), _param(param_dtype=torch.float16)]), None),
    "unsupported_dtype": (lambda: _ag(params=[_param(param_dtype=torch.int8)]),
                          lambda: _rs(grads=[torch.ones(4, 2, dtype=torch.int32)], reduce_dtype=torch.float32)),
    "subclass_param": (lambda: _ag(params=[_param(), _param(_sharded_param_data=_pair())]), None),
    "subclass_grad": (None, lambda: _rs(grads=[torch.randn(4, 2), _pair()])),
    "noncontiguous_grad": (None, lambda: _rs(grads=[torch.randn(3, 4).bfloat16().t()])),
    "reduce_dtype": (None, lambda: _rs(reduce_dtype=torch.bfloat16)),
    "reduce_scatter_input_fn": (None, lambda: _rs(custom_input_fn=True)),
    "arena_busy": (lambda: fallbacks.arena_reason("busy"), None),
}


def test_a_dim_0_extension_takes_tide_beside_params_of_another_dtype():
    """Its inputs travel as bytes (tide.fsdp.extensions): neither its dtype nor the group's mix refuse it."""
    assert _ag(params=[_param(), _param(_sharded_local_tensor=_extension(), param_dtype=torch.float16)]) is None


def test_an_extension_giving_a_subclass_input_takes_stock():
    """Checked once the pre-all-gather ran (tide.fsdp.seam); plain inputs of any dtype are TIDE's."""
    assert fallbacks.extension_inputs_reason([None, [torch.empty(2, dtype=torch.uint8), _pair()]]) == "subclass_param"
    assert fallbacks.extension_inputs_reason([None, [torch.empty(2, dtype=torch.uint8), torch.empty(1)]]) is None


def test_every_reason_has_a_case():
    assert set(CASES) | {"capture_before_arena", "capture_multinode", "compiling",
                         "functorch"} == set(fallbacks.REASONS)


@pytest.mark.parametrize("reason", sorted(CASES))
def test_reason_is_triggered(reason):
    ag, rs = CASES[reason]
    for call in (ag, rs):
        if call is not None:
            assert call() == reason


def test_supported_calls_take_tide():
    assert _ag() is None and _rs() is None
    # FSDP2's own comms (set_allocate_memory_from_process_group_for_comm) only choose stock's staging buffers.
    assert _ag(comm=_tide_all_gather(fsdp_comm=ProcessGroupAllocAllGather(None))) is None
    assert _rs(comm=_tide_reduce_scatter(fsdp_comm=ProcessGroupAllocReduceScatter(None))) is None
    # torch 2.15 with bf16 params and an fp32 reduce: norm weights' fp32 grads beside bf16 ones.
    assert _rs(grads=[torch.randn(4, 2).bfloat16(), torch.randn(4)]) is None
    # bf16 grads with no reduce dtype reduce in bf16 (stock's), fp32 ones beside them do not change that.
    assert _rs(grads=[torch.randn(4), torch.randn(4, 2).bfloat16()], reduce_dtype=None) == "reduce_dtype"
    # fp32 grads with no reduce dtype reduce in fp32: TIDE's; with a bf16 one they reduce in bf16: stock's.
    assert _rs(grads=[torch.randn(4)], reduce_dtype=None) is None
    assert _rs(grads=[torch.randn(4)], reduce_dtype=torch.bfloat16) == "reduce_dtype"
    assert _ag(params=[_param(keep_unsharded_storage=False)]) is None


def _spmd_param(mesh_dims: int, dp_dims: int):
    """A DTensor param of ``fully_shard(dp_mesh_dims=...)`` (torch 2.14+) on an SPMD mesh."""
    return _param(is_dtensor=True, mesh_info=types.SimpleNamespace(is_spmd_mesh=True),
                  _spmd_mesh=types.SimpleNamespace(ndim=mesh_dims), _dp_dim_indices=frozenset(range(dp_dims)))


def test_spmd_data_parallel_params_take_tide_and_tp_axes_do_not():
    assert _ag(params=[_spmd_param(1, 1)]) is None and _rs(params=[_spmd_param(2, 2)]) is None
    assert _ag(params=[_spmd_param(2, 1)]) == "dtensor_param" and _rs(params=[_spmd_param(2, 1)]) == "dtensor_param"
    verdict = fallbacks.contract_reason(9, ["h"] * 8)  # Hopper, 8 GPUs on one host
    assert verdict is None and _ag(device=CUDA, contract=verdict) is None and _rs(device=CUDA, contract=verdict) is None
    assert fallbacks.arena_reason("bound") is None and fallbacks.arena_reason("direct") is None


@pytest.mark.parametrize("reason, patch", [
    ("compiling", ("is_tracing", lambda: True)),
    ("functorch", ("functorch_active", lambda: True)),
])
def test_tracing_reasons(reason, patch, monkeypatch):
    monkeypatch.setattr(fallbacks, patch[0], patch[1])
    assert _ag() == reason and _rs() == reason


@pytest.mark.parametrize("arena, multinode, reason", [
    (None, False, "capture_before_arena"),  # the arena's rendezvous cannot be captured
    (object(), False, None),  # captured on TIDE
    (object(), True, "capture_multinode"),
])
def test_under_capture(arena, multinode, reason, monkeypatch):
    from tide import routes
    from tide.meta.multinode import Topology

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    nodes = Topology(num_nodes=2, local_size=1) if multinode else None
    route = routes.Route("g", (0, 1), nodes, None if multinode else arena, arena if multinode else None)
    monkeypatch.setattr(routes, "of", lambda group: route)
    assert _ag(device=CUDA, contract=None) == reason
    assert _rs(device=CUDA, contract=None) == reason
    assert _ag() is None  # a CPU group is never capturing


def test_all_gather_facts_are_decided_once_per_params_list():
    comm = _tide_all_gather()
    params = [_param()]
    facts = decide.all_gather_facts(comm, params)
    assert facts.static_reason is None and facts.hooked == ()
    params[0].param_dtype = torch.int8  # fixed after lazy init: the facts of this list are kept
    assert decide.all_gather_facts(comm, params) is facts
    assert decide.all_gather_facts(comm, list(params)).static_reason == "unsupported_dtype"
    params[0].param_dtype, params[0]._sharded_local_tensor = torch.bfloat16, _extension()
    assert decide.all_gather_facts(comm, list(params)).hooked == (True,)


def test_a_call_declares_its_identity_only_where_a_backend_compares_it():
    """The seam names each collective (module, phase, count) for the reference backend's call agreement, which
    compares CPU calls only; off CPU nothing is declared or counted."""
    from tide import call_identity
    from tide.meta import call_site

    group = type("ParamGroup", (), {"_module_fqn": "layers.3"})()  # call counts hold groups weakly
    try:
        for count in (1, 2):
            identity = decide._identity(group, "all_gather", "forward", torch.device("cpu"))
            assert isinstance(identity, call_identity)
            with identity:
                assert call_site.current() == (("fqn", "layers.3"), ("phase", "forward"), ("count", count))
        with decide._identity(group, "all_gather", "forward", torch.device("cuda", 0)):
            assert call_site.current() == ()
        assert registry.call_counts[group] == {("all_gather", "forward"): 2}
    finally:
        registry.call_counts.pop(group, None)
