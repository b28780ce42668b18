"""Rank functions of the FSDP2 tests (spawned by ``tide.launch.run_ranks``; importable by module path).

Each run trains the same model twice in one process, stock FSDP2 then TIDE, from the same seed and
data, and returns what the test compares: losses, final full parameters, ``tide.stats()["fsdp"]`` and
the calls to FSDP2's layout-conversion ops.

Tolerance (used by the tests): TIDE's reduce sums the W contributions in fp32 in rank order and
applies 1/W as a multiply; gloo sums in its own order and divides. Each reduced gradient element
can differ by a few fp32 ulps (relative ~1e-7 for W <= 4, observed 0 to 2 ulps); AdamW turns that
into parameter differences of the same relative order per step, which 5-7 steps cannot grow beyond
~1e-6 absolute on O(1) parameters. With bf16 params a last-ulp fp32 difference can flip one bf16
rounding (2^-8 relative on that element), which moves the loss by far less than 1e-3. The final
gradients (one extra backward, same parameters up to those ulps) agree to ~1e-6 relative. A real
error moves losses/parameters by >1e-2 (wrong rows, a lost accumulation) or the gradients by its own
relative size (a wrong divide factor, to which AdamW's update is blind).
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.utils._python_dispatch import TorchDispatchMode

import tide.fsdp
from tide.models import PRESETS, batch, loss_fn
from tide.train import fsdp_model, train_step

PARAM_ATOL, PARAM_RTOL = 1e-5, 1e-4
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4
LOSS_ATOL_FP32, LOSS_ATOL_BF16 = 1e-5, 1e-3

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# FSDP2's layout-conversion ops by role (torch 2.15 packs gradients with chunk_cat_mixed_dtype).
COPY_OPS = {"fsdp::all_gather_copy_in": "all_gather_copy_in", "fsdp::split_with_sizes_copy": "all_gather_copy_out",
            "fsdp::chunk_cat": "reduce_scatter_copy_in", "fsdp::chunk_cat_mixed_dtype": "reduce_scatter_copy_in"}


class CopyOpCounter(TorchDispatchMode):
    """Counts calls to FSDP2's layout-conversion ops (they are dispatcher ops, so the mode sees them)."""

    def __init__(self):
        super().__init__()
        self.counts = dict.fromkeys(COPY_OPS.values(), 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        role = COPY_OPS.get(func._schema.name)
        if role is not None:
            self.counts[role] += 1
        return func(*args, **(kwargs or {}))


def assert_like_stock(rank: int, tide_: dict, stock: dict, exact: bool) -> None:
    """A TIDE run's results against stock's from the same seed: losses, parameters and gradients bit for bit
    (``exact``), else the gradients of the extra backward to the reduce's tolerances."""
    import numpy as np

    assert len(stock["grads"]) == len(tide_["grads"]) > 0
    if exact:
        assert tide_["losses"] == stock["losses"], (tide_["losses"], stock["losses"])
        for key in ("params", "grads"):
            for i, (a, b) in enumerate(zip(tide_[key], stock[key])):
                assert np.array_equal(a, b), f"rank {rank} {key} {i}: max |diff| {np.abs(a - b).max():.3e}"
    else:
        for i, (a, b) in enumerate(zip(tide_["grads"], stock["grads"])):
            torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                       msg=f"rank {rank} grad {i}")


def _full_params(model) -> list:
    # numpy, not tensors: torch's multiprocessing would pass tensors through shared memory that dies
    # with the rank process.
    return [p.detach().full_tensor().float().numpy().copy() for p in model.parameters()]


def _train(cfg, rank, *, use_tide, steps, mp=None, accum=1, no_sync=False, prefetch=False, count_ops=False,
           setup=None, **fsdp_kwargs):
    """Build (``setup`` runs after sharding), train ``steps`` steps, return model, optimizer, results."""
    model = fsdp_model(cfg, device="cpu", mp_policy=mp, use_tide=use_tide, prefetch=prefetch, **fsdp_kwargs)
    if setup is not None:
        setup(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tide.reset_stats()
    counter = CopyOpCounter()
    losses = []
    for step in range(steps):
        if count_ops:
            with counter:
                losses.append(train_step(model, optim, cfg, step, rank, accum=accum, no_sync=no_sync).item())
        else:
            losses.append(train_step(model, optim, cfg, step, rank, accum=accum, no_sync=no_sync).item())
    stats = tide.stats()["fsdp"]
    # One more backward without an optimizer step: AdamW is blind to a uniformly mis-scaled gradient,
    # so the test also compares the reduced gradients themselves.
    tokens, targets = batch(cfg, steps * accum, rank)
    loss_fn(model(tokens), targets).backward()
    if not steps:  # no step trained: the paths that backward took
        stats = tide.stats()["fsdp"]
    grads = [p.grad.full_tensor().numpy().copy() for p in model.parameters() if p.grad is not None]
    optim.zero_grad(set_to_none=True)
    return model, optim, {"losses": losses, "params": _full_params(model), "grads": grads,
                          "stats": stats, "copy_ops": counter.counts}


def _pair(cfg, rank, *, steps=5, stock_setup=None, tide_setup=None, **kw) -> dict:
    _, _, stock = _train(cfg, rank, use_tide=False, steps=steps, setup=stock_setup, **kw)
    _, _, tide_ = _train(cfg, rank, use_tide=True, steps=steps, setup=tide_setup, **kw)
    return {"stock": stock, "tide": tide_}


def _count_post_accumulate_hooks(counter: list):
    def setup(model):
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda _p: counter.append(1))
    return setup


def _state_dict_roundtrip(cfg, rank, ckpt_dir: str) -> dict:
    """Train with TIDE, save the sharded model+optimizer state with DCP, load it into a fresh TIDE model,
    train one more step on both: the reloaded run must continue bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim, _ = _train(cfg, rank, use_tide=True, steps=3, mp=BF16)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    fresh = fsdp_model(cfg, device="cpu", mp_policy=BF16, use_tide=True, seed=123)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_optim.zero_grad()
    fmsd, fosd = get_state_dict(fresh, fresh_optim)
    state = {"model": fmsd, "optim": fosd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(fresh, fresh_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded_equal = all((a == b).all() for a, b in zip(_full_params(model), _full_params(fresh)))
    tide.reset_stats()
    cont = train_step(model, optim, cfg, 3, rank).item()
    cont_fresh = train_step(fresh, fresh_optim, cfg, 3, rank).item()
    return {"loaded_equal": loaded_equal, "continued": (cont, cont_fresh),
            "params_equal": all((a == b).all() for a, b in zip(_full_params(model), _full_params(fresh))),
            "stats": tide.stats()["fsdp"]}


def parity(rank: int, world_size: int, ckpt_dir: str) -> dict:
    """Every parity configuration on one world size (one spawn: spawning dominates the test time)."""
    torch.set_num_threads(1)
    tiny = PRESETS["tiny"]
    tied = PRESETS["tiny"].__class__(**{**PRESETS["tiny"].__dict__, "tie_embeddings": True})
    out = {}
    # bf16 params / fp32 reduce, reshard after forward, explicit prefetch; TIDE with force-sum (same
    # values as stock's AVG: sum then /W). Copy ops are counted in both runs (stock is the control).
    out["bf16_prefetch"] = _pair(tiny, rank, mp=BF16, prefetch=True, count_ops=True,
                                 tide_setup=lambda m: m.set_force_sum_reduction_for_comms(True))
    # No mixed precision, no reshard after forward, tied head, 2 micro-batches accumulating into the
    # sharded .grad (TIDE adds in place when every shard is even), post-accumulate-grad hooks.
    hooks = {"stock": [], "tide": []}
    out["fp32_tied_accum"] = _pair(tied, rank, accum=2, reshard_after_forward=False,
                                   stock_setup=_count_post_accumulate_hooks(hooks["stock"]),
                                   tide_setup=_count_post_accumulate_hooks(hooks["tide"]))
    out["fp32_tied_accum"]["hooks"] = {k: len(v) for k, v in hooks.items()}

    # bf16 + no_sync accumulation (fp32 unsharded grads reach the reduce) with gradient_divide_factor 3:
    # stock runs it as force-sum + post-divide (gloo has no PREMUL_SUM), TIDE as a plain divide factor.
    def divide_by_3(force_sum):
        def setup(m):
            m.set_gradient_divide_factor(3.0)
            m.set_force_sum_reduction_for_comms(force_sum)
        return setup
    out["bf16_no_sync_factor"] = _pair(tiny, rank, mp=BF16, accum=2, no_sync=True,
                                       stock_setup=divide_by_3(True), tide_setup=divide_by_3(False))
    out["state_dict"] = _state_dict_roundtrip(tiny, rank, ckpt_dir)
    return out


# ------------------------------------------------------------------------------------------------ fallbacks
def _shard_dim1(world_size):
    from torch.distributed.tensor import Shard

    def fn(param):
        return Shard(1) if param.dim() == 2 and param.shape[1] % world_size == 0 else None
    return fn


def _async_unshard(model):
    model._set_unshard_async_op(True)


def _frozen_bf16_param(model):
    # A frozen bf16 parameter in block 0's fp32 group: that group's all-gather mixes dtypes (stock's
    # uint8 path); its reduce only sees fp32 grads (stock FSDP2 itself needs uniform grad dtypes).
    frozen = torch.nn.Parameter(torch.randn(7, 3).to(torch.bfloat16), requires_grad=False)
    model.layers[0].register_parameter("frozen_bf16", frozen)


def fallbacks_2(rank: int, world_size: int) -> dict:
    """Fallback cases on 2 ranks: each trains stock and TIDE-enabled; the reasons come from stats()."""
    torch.set_num_threads(1)
    tiny = PRESETS["tiny"]
    return {
        "cpu_offload": _pair(tiny, rank, steps=3, offload_policy=CPUOffloadPolicy(pin_memory=False)),
        "async_op": _pair(tiny, rank, steps=3, stock_setup=_async_unshard, tide_setup=_async_unshard),
        "mixed_param_dtypes": _pair(tiny, rank, steps=3, before_shard=_frozen_bf16_param),
    }


def fallbacks_4(rank: int, world_size: int) -> dict:
    """reshard_after_forward=2 (post-forward mesh) on 4 ranks."""
    torch.set_num_threads(1)
    return {"reshard_int": _pair(PRESETS["tiny"], rank, steps=3, reshard_after_forward=2, mp=BF16)}


def world_size_1(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    return {"ws1": _pair(PRESETS["tiny"], rank, steps=3, mp=BF16)}


def enable_disable(rank: int, world_size: int) -> dict:
    """enable twice (idempotent, updates rs_mode), then disable; FSDP2's own comms stay in place throughout."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    from tide.fsdp import decide

    torch.set_num_threads(1)
    cfg = PRESETS["tiny"]
    model, optim, first = _train(cfg, rank, use_tide=True, steps=1)
    groups = tide.fsdp.param_groups(model)
    states = [decide.of_group(g) for g in groups]
    tide.fsdp.enable(model, rs_mode="slot_reuse")

    def fsdp_comms_untouched():
        return all(type(g._all_gather_comm) is DefaultAllGather and type(g._reduce_scatter_comm) is DefaultReduceScatter
                   for g in groups)
    once = fsdp_comms_untouched() and all(
        decide.of_group(g) is state and state[1].rs_mode == "slot_reuse" for g, state in zip(groups, states))
    tide.reset_stats()
    train_step(model, optim, cfg, 1, rank)
    slot_reuse = tide.stats()["fsdp"]
    tide.fsdp.disable(model)
    restored = fsdp_comms_untouched() and all(decide.of_group(g) is None for g in groups)
    tide.reset_stats()
    train_step(model, optim, cfg, 2, rank)
    return {"first": first["stats"], "once": once, "slot_reuse": slot_reuse, "restored": restored,
            "after_disable": tide.stats()["fsdp"], "groups": len(groups)}


def multinode_parity(rank: int, world_size: int) -> dict:
    """Emulated nodes (the caller sets ``LOCAL_WORLD_SIZE``): bf16 params In-Place with prefetch, fp32
    params Slot-Reuse with 2 accumulating micro-batches."""
    torch.set_num_threads(1)
    tiny = PRESETS["tiny"]
    return {"bf16_in_place": _pair(tiny, rank, steps=4, mp=BF16, prefetch=True, rs_mode="in_place"),
            "fp32_slot_reuse": _pair(tiny, rank, steps=4, accum=2, rs_mode="slot_reuse")}


def release_points(rank: int, world_size: int) -> dict:
    """When FSDP's use of the CUDA transport releases the arena's leased data region (tide/fsdp/wiring.py):
    once at the end of each root forward, never at a block's, and once at the end of each backward
    however many TIDE collectives asked for it; nothing queued outside backward. ``release_leases`` is
    replaced by a recorder (the hooks look it up when they fire): on CPU there is no arena to release."""
    from tide.fsdp import wiring

    torch.set_num_threads(1)
    calls = []
    wiring.release_leases = lambda: calls.append(len(calls))
    cfg = PRESETS["tiny"]
    model = fsdp_model(cfg, device=torch.device("cpu"), mp_policy=BF16, use_tide=True)
    counts = {}
    for step in range(2):
        tokens, targets = batch(cfg, step, rank)
        before = len(calls)
        logits = model(tokens)
        counts[f"forward{step}"] = len(calls) - before
        asks = torch.ones(2, requires_grad=True) * 2  # a node whose gradient hook asks twice, as two collectives would
        asks.register_hook(lambda g: (wiring.release_at_backward_end(), wiring.release_at_backward_end(), g)[-1])
        before = len(calls)
        (loss_fn(logits, targets) + asks.sum()).backward()
        counts[f"backward{step}"] = len(calls) - before
    before = len(calls)
    wiring.release_at_backward_end()
    counts["outside_backward"] = len(calls) - before
    return counts


# ------------------------------------------------------------------------------------------ torch releases
def untested_signature(rank: int, world_size: int) -> dict:
    """A torch whose ``foreach_reduce`` gained a parameter no seam wrapper knows (set up in this fresh
    process before TIDE installs): every collective takes stock, counted with the reason."""
    import functools
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group

    torch.set_num_threads(1)
    real = _fsdp_collectives.foreach_reduce
    params = list(inspect.signature(real).parameters.values())

    @functools.wraps(real)
    def foreach_reduce(*args, future_flag=None, **kwargs):
        return real(*args, **kwargs)
    future = inspect.Parameter("future_flag", inspect.Parameter.KEYWORD_ONLY, default=None)
    foreach_reduce.__signature__ = inspect.Signature(params + [future])
    _fsdp_collectives.foreach_reduce = _fsdp_param_group.foreach_reduce = foreach_reduce
    names = [p.name for p in params]
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    expected = ", ".join(names[:len(names) - len(keyword_only)] + ["*"] + keyword_only + ["future_flag"])
    tiny = PRESETS["tiny"]
    pair = _pair(tiny, rank, steps=3, mp=BF16)
    return {"stats": pair["tide"]["stats"], "losses": pair["tide"]["losses"], "stock_losses": pair["stock"]["losses"],
            "expected_params": expected}


def newer_torch(rank: int, world_size: int) -> dict:
    """A torch newer than the tested range whose signatures match: one warning, then TIDE."""
    import warnings

    torch.set_num_threads(1)
    torch.__version__ = "2.99.0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, run = _train(PRESETS["tiny"], rank, use_tide=True, steps=2, mp=BF16)
        _train(PRESETS["tiny"], rank, use_tide=True, steps=1, mp=BF16)
    return {"stats": run["stats"], "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}


def grad_dtypes(rank: int, world_size: int) -> dict:
    """bf16 params with an fp32 reduce, and one fp32 weight whose ``grad_dtype`` is bf16 (torch 2.15+:
    its sharded gradient is kept in bf16). Records the gradient dtypes each TIDE reduce saw, and the final
    sharded gradients' dtypes and values, for stock and TIDE."""
    from tide.fsdp import seam

    torch.set_num_threads(1)
    seen = []
    reduce = seam.reduce_scatter_into_shards

    def recording(grads, *args, **kwargs):
        seen.append(sorted({str(g.dtype) for g in grads}))
        return reduce(grads, *args, **kwargs)
    seam.reduce_scatter_into_shards = recording

    def bf16_grad(model):
        if hasattr(torch.Tensor, "grad_dtype"):
            model.layers[0].mlp.w1.weight.grad_dtype = torch.bfloat16
    out = {}
    for use_tide in (False, True):
        model = fsdp_model(PRESETS["tiny"], device="cpu", mp_policy=BF16, use_tide=use_tide, before_shard=bf16_grad)
        # SGD: AdamW's foreach step refuses a bf16 gradient on an fp32 parameter (stock alike).
        optim = torch.optim.SGD(model.parameters(), lr=1e-2)
        tide.reset_stats()
        losses = [train_step(model, optim, PRESETS["tiny"], step, rank).item() for step in range(3)]
        tokens, targets = batch(PRESETS["tiny"], 3, rank)
        loss_fn(model(tokens), targets).backward()
        out["tide" if use_tide else "stock"] = {
            "losses": losses, "stats": tide.stats()["fsdp"],
            "grads": [(str(p.grad.dtype), p.grad.full_tensor().float().numpy().copy()) for p in model.parameters()]}
    out["seen"] = seen
    return out


def slot_reuse_decisions(rank: int, world_size: int) -> dict:
    """Whether the Slot-Reuse hook would move each finished gradient (the decision before it looks for a
    slot, which only a CUDA arena has), with whether the gradient has its parameter's dtype (torch 2.15
    gives norm weights fp32 gradients, which stay where they are): yes for those in a plain bf16 step, no
    in the reducing micro-batch after a no_sync one, where the gradient carries earlier micro-batches."""
    from tide.fsdp import hooks

    torch.set_num_threads(1)
    cfg = PRESETS["tiny"]
    model = fsdp_model(cfg, device="cpu", mp_policy=BF16, use_tide=True, rs_mode="slot_reuse")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optim, cfg, 0, rank)  # lazy init: the unsharded params exist from here on
    decisions = []
    for group in tide.fsdp.param_groups(model):
        for fp in group.fsdp_params:
            fp._unsharded_param.register_post_accumulate_grad_hook(
                lambda param, g=group, fp=fp: decisions.append(
                    (hooks.movable(g, fp, param), param.grad.dtype == param.dtype)))
    train_step(model, optim, cfg, 1, rank)
    plain = list(decisions)
    decisions.clear()
    train_step(model, optim, cfg, 2, rank, accum=2, no_sync=True)
    return {"plain": plain, "no_sync": decisions}


def keep_unsharded_storage(rank: int, world_size: int) -> dict:
    """torch 2.15+: blocks that keep their unsharded storage across reshard gather on stock."""
    torch.set_num_threads(1)

    def keep(model):
        for layer in model.layers:
            layer.set_keep_unsharded_storage(True)
    return _pair(PRESETS["tiny"], rank, steps=3, mp=BF16, stock_setup=keep, tide_setup=keep)


def _partial_all_reduce_grads(model, cfg, rank, accum: int = 2) -> list:
    """``accum`` micro-batches, the replicas' all-reduce on the last only (``set_requires_all_reduce``): the
    earlier ones reduce-scatter into FSDP's partial output. The reduced full gradients."""
    for a in range(accum):
        model.set_requires_all_reduce(a == accum - 1)
        tokens, targets = batch(cfg, a, rank)
        (loss_fn(model(tokens), targets) / accum).backward()
    return [p.grad.full_tensor().numpy().copy() for p in model.parameters() if p.grad is not None]


def _halve_after_all_reduce(model):
    model.set_all_reduce_hook(lambda grad: grad.mul_(0.5))


def hsdp(rank: int, world_size: int, replicas: int, case: str, steps: int) -> dict:
    """HSDP on a (replicas, world_size / replicas) mesh, stock then TIDE: ``plain`` steps, ``hook`` (an
    all-reduce hook), ``force_sum`` (sums in the collectives, one divide after), each ``steps`` AdamW steps
    and one more backward; ``partial``: the gradients of two micro-batches, the all-reduce on the last."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))
    tiny = PRESETS["tiny"]
    setup = {"hook": _halve_after_all_reduce,
             "force_sum": lambda m: m.set_force_sum_reduction_for_comms(True)}.get(case)
    if case != "partial":
        return _pair(tiny, rank, steps=steps, mesh=mesh, mp=BF16, stock_setup=setup, tide_setup=setup)
    out = {}
    for name, use_tide in (("stock", False), ("tide", True)):
        model = fsdp_model(tiny, device="cpu", mp_policy=BF16, use_tide=use_tide, mesh=mesh)
        tide.reset_stats()
        out[name] = {"grads": _partial_all_reduce_grads(model, tiny, rank), "stats": tide.stats()["fsdp"]}
    return out


def _shard_experts_dim1(world_size: int):
    """Shard(1) for 3-D expert weights (torchtitan's placement for MoE experts) and for 2-D weights whose
    dim 1 divides evenly; dim 0 for the rest."""
    from torch.distributed.tensor import Shard

    def fn(param):
        return Shard(1) if param.dim() >= 2 and param.shape[1] % world_size == 0 else None
    return fn


def shard_dims(rank: int, world_size: int, preset: str, steps: int) -> dict:
    """``Shard(1)`` params beside dim-0 ones in the same groups, stock then TIDE."""
    import dataclasses

    torch.set_num_threads(1)
    cfg = PRESETS[preset]
    if preset == "tiny_moe":
        cfg = dataclasses.replace(cfg, n_layers=2)
    return _pair(cfg, rank, steps=steps, shard_placement_fn=_shard_experts_dim1(world_size))


def extensions(rank: int, world_size: int, steps: int) -> dict:
    """A tensor extension (tests/fsdp/int8_weights.py: int8 rows and fp32 scales gathered, bf16 weights
    rebuilt) on the blocks' evenly sharded weights, beside plain params in the same groups; stock then
    TIDE, with bf16 params and an fp32 reduce, and each run's hook calls."""
    from tests.fsdp.int8_weights import Int8RowsWeight, int8_rows

    torch.set_num_threads(1)
    runs = {}
    for name, use_tide in (("stock", False), ("tide", True)):
        Int8RowsWeight.calls.update(pre=0, post=0)
        _, _, runs[name] = _train(PRESETS["tiny"], rank, use_tide=use_tide, steps=steps, mp=BF16, count_ops=True,
                                  before_shard=int8_rows(world_size))
        runs[name]["hook_calls"] = dict(Int8RowsWeight.calls)
    return runs


def subclass_weights(rank: int, world_size: int, hooks: bool, set_to_none: bool, steps: int) -> dict:
    """Tensor-subclass weights (tests/fsdp/pair_weights.py): ``PairWeight`` (extension hooks; its gradient is
    a ``TwoTensor``) or a plain ``TwoTensor`` (gathered as its sharded data), on 3 MLP blocks and the root,
    stock then TIDE from the same seed and data: ``steps`` Adam steps zeroing gradients with
    ``set_to_none`` (False: each reduce accumulates into the existing sharded gradients), then one more
    backward. Losses, parameters and gradients as plain tensors (a ``TwoTensor``'s two stacked)."""
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.two_tensor import TwoTensor

    from tests.fsdp.pair_weights import PairWeight, as_plain, mlp_stack

    torch.set_num_threads(1)
    runs = {}
    for name, use_tide in (("stock", False), ("tide", True)):
        torch.manual_seed(0)
        model = mlp_stack(PairWeight if hooks else TwoTensor)
        for block in model:
            fully_shard(block)
        fully_shard(model)
        if use_tide:
            tide.fsdp.enable(model)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(1 + rank)
        x = torch.randn(4, 8)
        tide.reset_stats()
        losses = []
        for _ in range(steps):
            loss = model(x).sum()
            losses.append(as_plain(loss.detach()).tolist())
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=set_to_none)
        model(x).sum().backward()
        runs[name] = {"losses": losses, "stats": tide.stats()["fsdp"],
                      "params": [as_plain(p.detach().full_tensor()).numpy().copy() for p in model.parameters()],
                      "grads": [as_plain(p.grad.full_tensor()).numpy().copy() for p in model.parameters()]}
    return runs


# ---------------------------------------------------------------------------------------------- FSDP2 APIs
def _user_comms():
    """A user's own all-gather and reduce-scatter comms (``set_custom_all_gather`` / ``set_custom_reduce_scatter``):
    FSDP2's defaults, counting their calls."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class CountingAllGather(DefaultAllGather):
        calls = 0

        def __call__(self, *args, **kwargs):
            CountingAllGather.calls += 1
            return super().__call__(*args, **kwargs)

    class CountingReduceScatter(DefaultReduceScatter):
        calls = 0

        def __call__(self, *args, **kwargs):
            CountingReduceScatter.calls += 1
            return super().__call__(*args, **kwargs)
    return CountingAllGather, CountingReduceScatter


def fsdp_apis(rank: int, world_size: int, steps: int) -> dict:
    """FSDP2's public APIs that set a group's comms, on every FSDP module of the tiny model: stock, TIDE with
    the API called after ``enable``, and TIDE with it called before; each ``steps`` AdamW steps and one more
    backward. Per case and run: results, ``tide.stats()["fsdp"]``, the user comms' calls, the RuntimeWarnings
    and the classes of the groups' FSDP2 comms after setup; and the error ``set_symm_mem_for_comm`` raises on
    gloo, stock and enabled."""
    import warnings

    from torch.distributed.fsdp import FSDPModule

    torch.set_num_threads(1)
    cfg = PRESETS["tiny"]
    user_all_gather, user_reduce_scatter = _user_comms()
    # case: (the FSDPModule method, a call of it); cases whose method this torch lacks are left out.
    cases = {
        "allocate_from_pg": ("set_allocate_memory_from_process_group_for_comm",
                             lambda m: m.set_allocate_memory_from_process_group_for_comm(True)),
        "allocate_from_pg_off": ("set_allocate_memory_from_process_group_for_comm",
                                 lambda m: m.set_allocate_memory_from_process_group_for_comm(False)),
        "custom_all_gather": ("set_custom_all_gather", lambda m: m.set_custom_all_gather(user_all_gather())),
        "custom_reduce_scatter": ("set_custom_reduce_scatter",
                                  lambda m: m.set_custom_reduce_scatter(user_reduce_scatter())),
        "separate_reduce_scatter_group": ("set_separate_reduce_scatter_group",
                                          lambda m: m.set_separate_reduce_scatter_group(True, recurse=False)),
        # Reads the reduce-scatter comm to refuse symmetric memory with more than one buffer.
        "reduce_scatter_max_input_buffers": ("set_reduce_scatter_max_input_buffers",
                                             lambda m: m.set_reduce_scatter_max_input_buffers(2, recurse=False)),
    }
    cases = {case: api for case, (method, api) in cases.items() if hasattr(FSDPModule, method)}

    def on_every_fsdp_module(api):
        def setup(model):
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    api(m)
        return setup

    def comm_classes(model):
        return sorted({f"{type(g._all_gather_comm).__name__}/{type(g._reduce_scatter_comm).__name__}"
                       for g in tide.fsdp.param_groups(model)})

    out = {}
    for case, api in cases.items():
        setups = {"stock": (False, on_every_fsdp_module(api)),
                  "tide_after": (True, on_every_fsdp_module(api)),
                  "tide_before": (False, lambda m, api=api: (on_every_fsdp_module(api)(m), tide.fsdp.enable(m)))}
        out[case] = {}
        for name, (use_tide, setup) in setups.items():
            user_all_gather.calls = user_reduce_scatter.calls = 0
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model, _, run = _train(cfg, rank, use_tide=use_tide, steps=steps, setup=setup)
            run["user_comm_calls"] = (user_all_gather.calls, user_reduce_scatter.calls)
            run["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
            run["comms"] = comm_classes(model)
            out[case][name] = run
    # Symmetric memory needs NCCL: on gloo the call raises, and must raise as on stock.
    out["symm_mem_errors"] = {}
    for use_tide in (False, True) if hasattr(FSDPModule, "set_symm_mem_for_comm") else ():
        try:
            on_every_fsdp_module(lambda m: m.set_symm_mem_for_comm())(fsdp_model(cfg, device="cpu", use_tide=use_tide))
        except Exception as e:  # noqa: BLE001 (compared with stock's)
            out["symm_mem_errors"][use_tide] = f"{type(e).__name__}: {e}"
    return out


def comms_set_between_steps(rank: int, world_size: int) -> list[dict]:
    """``tide.stats()["fsdp"]`` of each of three steps of the tiny model on TIDE: with FSDP2's own comms, with a
    user's own on every FSDP module (set between steps), and with FSDP2's again."""
    import warnings

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    torch.set_num_threads(1)
    cfg = PRESETS["tiny"]
    model = fsdp_model(cfg, device="cpu", use_tide=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step, comms in enumerate((None, _user_comms(), (DefaultAllGather, DefaultReduceScatter))):
        if comms is not None:
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_custom_all_gather(comms[0]())
                    m.set_custom_reduce_scatter(comms[1]())
        tide.reset_stats()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the user comms' warning has its own test
            train_step(model, optim, cfg, step, rank)
        out.append(tide.stats()["fsdp"])
    return out


def steady_calls(rank: int, world_size: int, steps: int = 3) -> dict:
    """The ``tide/`` functions each all-gather and reduce of the tiny model on TIDE calls, per step: (file,
    function) pairs, profiled around the seam's ``foreach_all_gather`` and ``_reduce``."""
    import sys
    from pathlib import Path

    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _pg

    from tide.fsdp import seam

    root = Path(tide.__file__).resolve().parent
    calls: dict = {}
    step_now = [0]

    def profiled(kind, fn):
        def run(*args, **kwargs):
            entered = set()

            def tracer(frame, event, _):
                if event == "call":
                    path = Path(frame.f_code.co_filename).resolve()
                    if path.is_relative_to(root):
                        entered.add((path.relative_to(root.parent).as_posix(), frame.f_code.co_name))
            sys.setprofile(tracer)
            try:
                return fn(*args, **kwargs)
            finally:
                sys.setprofile(None)
                calls.setdefault(step_now[0], {}).setdefault(kind, []).append(sorted(entered))
        return run

    torch.set_num_threads(1)
    cfg = PRESETS["tiny"]
    model = fsdp_model(cfg, device="cpu", use_tide=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = _pg.foreach_all_gather, seam._reduce
    _pg.foreach_all_gather, seam._reduce = profiled("all_gather", saved[0]), profiled("reduce", saved[1])
    try:
        for step in range(steps):
            step_now[0] = step
            train_step(model, optim, cfg, step, rank)
    finally:
        _pg.foreach_all_gather, seam._reduce = saved
    return calls


# ---------------------------------------------------------------------------------------------- CommDebugMode
def comm_debug_counts(rank: int, world_size: int, steps: int) -> dict:
    """What ``CommDebugMode`` counts, stock then TIDE, for the tiny model with bf16 params and explicit
    prefetch: per step the collectives of the forward and of the backward (one mode each), and per module and
    phase over a whole step (one mode); plus the run's ``tide.stats()["fsdp"]``."""
    from torch.distributed.tensor.debug import CommDebugMode

    torch.set_num_threads(1)
    cfg = PRESETS["tiny"]

    def named(counts: dict) -> dict:
        return {str(op): n for op, n in counts.items()}
    out = {}
    for name, use_tide in (("stock", False), ("tide", True)):
        model = fsdp_model(cfg, device="cpu", mp_policy=BF16, use_tide=use_tide, prefetch=True)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tide.reset_stats()
        phases = []
        for step in range(steps):
            tokens, targets = batch(cfg, step, rank)
            with CommDebugMode() as forward:
                loss = loss_fn(model(tokens), targets)
            with CommDebugMode() as backward:
                loss.backward()
            optim.step()
            optim.zero_grad()
            phases.append({"forward": named(forward.get_comm_counts()), "backward": named(backward.get_comm_counts())})
        tokens, targets = batch(cfg, steps, rank)
        with CommDebugMode() as whole:
            loss_fn(model(tokens), targets).backward()
        modules = {module: {phase: named(c) for phase, c in counts.items()}
                   for module, counts in whole.comm_module_counts.items()}
        out[name] = {"phases": phases, "modules": modules, "stats": tide.stats()["fsdp"]}
    return out
