"""TIDE on the CUDA transport under FSDP2 vs stock FSDP2 (skipped without CUDA).

W = 2 and 4 ranks (processes sharing the GPU over gloo when there are fewer GPUs than ranks, NCCL with
one GPU per rank), the Llama-like model with 4 blocks (uneven shards), bf16 params / fp32 reduce,
4 AdamW steps, both reduce-scatter modes, with and without explicit prefetch, reshard_after_forward
True/False. Each configuration trains stock then TIDE in the same rank process from the same seed and
data; losses, final parameters and one more backward's reduced gradients must agree within the
tolerances justified in tests/fsdp/workers.py (fp32 summation order of the reduce only). The stats
must show that the TIDE seam ran, that the transport (not the reference backend) ran every TIDE
collective, and how the all-gather outputs used the arena's slots.

Fallbacks: async unshard takes stock (the reduce still runs on the transport). CUDA-graph capture: the
seam's predicates are asked under a real capture for a model whose arena does not exist yet (both
collectives answer ``capture_before_arena``: a rendezvous cannot be captured); captured steps on TIDE are
tests/cuda/test_capture.py.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from tests.cuda import ranks
from tide.launch import run_ranks

pytestmark = pytest.mark.cuda

STEPS = 4
# name: (rs_mode, explicit prefetch, reshard_after_forward)
CONFIGS = {
    "in_place_prefetch_raf": ("in_place", True, True),
    "slot_reuse_prefetch_raf": ("slot_reuse", True, True),
    "slot_reuse_noprefetch_noraf": ("slot_reuse", False, False),
    "in_place_noprefetch_noraf": ("in_place", False, False),
    "slot_reuse_noprefetch_raf": ("slot_reuse", False, True),
}


# ------------------------------------------------------------------------------------------ rank side
def _cfg():
    from tide.models import PRESETS

    return dataclasses.replace(PRESETS["tiny"], n_layers=4)


def _train(rank: int, *, use_tide: bool, rs_mode: str, prefetch: bool, raf: bool, steps: int = STEPS,
           setup=None, on_step=None) -> dict:
    import tide.fsdp
    from tests.fsdp.workers import BF16
    from tide import transport
    from tide.models import batch, loss_fn
    from tide.train import fsdp_model, train_step

    cfg = _cfg()
    dev = torch.device("cuda", torch.cuda.current_device())
    model = fsdp_model(cfg, device=dev, mp_policy=BF16, prefetch=prefetch, reshard_after_forward=raf)
    if setup is not None:
        setup(model)
    if use_tide:
        tide.fsdp.enable(model, rs_mode=rs_mode, transport="auto")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tide.reset_stats()
    losses = []
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        losses.append(train_step(model, optim, cfg, step, rank, device=dev).item())
    tokens, targets = batch(cfg, steps, rank, device=dev)
    logits = model(tokens)
    leased_at_loss = [a.leases.held is not None for a in transport.arenas()]
    loss_fn(logits, targets).backward()
    del logits
    leased_after_backward = [a.leases.held is not None for a in transport.arenas()]
    leases = sum(a.leases.count for a in transport.arenas())
    torch.cuda.synchronize()
    # This rank's shards (stock and TIDE shard alike, so shards compare like full tensors): DTensor's
    # full_tensor() all-gathers through functional collectives, which segfault on gloo with CUDA tensors
    # in torch 2.11.
    grads = [p.grad.to_local().float().cpu().numpy().copy() for p in model.parameters() if p.grad is not None]
    optim.zero_grad(set_to_none=True)
    params = [p.detach().to_local().float().cpu().numpy().copy() for p in model.parameters()]
    stats = tide.stats()
    out = {"losses": losses, "params": params, "grads": grads, "stats": stats["fsdp"], "arena": stats["wiring"],
           "transport": stats["ops"], "multinode": stats["multinode"], "arenas": len(transport.arenas()),
           "leased_at_loss": leased_at_loss, "leased_after_backward": leased_after_backward, "leases": leases}
    if use_tide:
        out["direct_rails"] = len(tide.registry.direct_rails)
        tide.fsdp.disable(model)
        out["arenas_after_disable"] = len(transport.arenas())
        out["direct_rails_after_disable"] = len(tide.registry.direct_rails)
    return out


def _graph_capture_predicates(rank: int) -> dict:
    """Train one TIDE step (its arena created, then dropped by disable), then ask the seam's predicates
    for a fresh TIDE model that never ran a step, inside a real CUDA-graph capture of a trivial kernel:
    both collectives answer capture_before_arena."""
    import tide.fsdp
    from tide.fsdp import decide, fallbacks

    res = _train(rank, use_tide=True, rs_mode="in_place", prefetch=False, raf=True, steps=1)
    from tests.fsdp.workers import BF16
    from tide.train import fsdp_model

    dev = torch.device("cuda", torch.cuda.current_device())
    model = fsdp_model(_cfg(), device=dev, mp_policy=BF16, use_tide=True)
    g = tide.fsdp.param_groups(model)[-1]
    x = torch.zeros(4, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            x.add_(1)
            ag = fallbacks.all_gather_reason(g.fsdp_params, g._all_gather_process_group, False, g.device,
                                             decide.of_group(g)[0])
            grads = [torch.empty(p._orig_size, device=dev, dtype=torch.bfloat16) for p in g.fsdp_params]
            rs = fallbacks.reduce_reason(g.fsdp_params, grads, g._reduce_scatter_process_group,
                                         decide.of_group(g)[1], torch.float32, g.device)
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    tide.fsdp.disable(model)
    return {"ag": ag, "rs": rs, "replayed": x.tolist(), "trained": res["losses"]}


def _files_entered(rank: int) -> dict:
    """The ``tide/`` Python files one steady bound all-gather and one steady reduce-scatter of the seam enter, in
    order of first entry (profiled on the thread that runs each call: the forward's, autograd's in backward),
    after two steps have made the arena, its plans and leases: the third step's calls."""
    import sys
    from pathlib import Path

    import tide
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _pg
    from tide.fsdp import seam

    root = Path(tide.__file__).resolve().parent.parent
    calls = {"all_gather": [], "reduce": []}

    def profiled(kind, fn):
        def run(*args, **kwargs):
            files, funcs = [], set()

            def tracer(frame, event, _):
                if event == "call":
                    path = Path(frame.f_code.co_filename).resolve()
                    if path.is_relative_to(root / "tide"):
                        rel = path.relative_to(root).as_posix()
                        if rel not in files:
                            files.append(rel)
                        funcs.add(frame.f_code.co_name)
            sys.setprofile(tracer)
            try:
                return fn(*args, **kwargs)
            finally:
                sys.setprofile(None)
                calls[kind].append({"files": files, "funcs": sorted(funcs)})
        return run

    state = {}

    def setup(model):
        state["ag"], state["reduce"] = _pg.foreach_all_gather, seam._reduce

    def on_step(step):
        if step == 2:
            _pg.foreach_all_gather = profiled("all_gather", state["ag"])
            seam._reduce = profiled("reduce", state["reduce"])

    try:
        _train(rank, use_tide=True, rs_mode="slot_reuse", prefetch=True, raf=True, steps=3, setup=setup,
               on_step=on_step)
    finally:
        if state:
            _pg.foreach_all_gather, seam._reduce = state["ag"], state["reduce"]
    # A steady call: no lease taken in the call (the first call of a phase leases the data region).
    bound = [c["files"] for c in calls["all_gather"] if "bind_into_slot" in c["funcs"] and "_lease" not in c["funcs"]]
    reduces = [c["files"] for c in calls["reduce"] if "_tide_reduce" in c["funcs"] and "_lease" not in c["funcs"]]
    return {"all_gather": bound, "reduce": reduces}


def fsdp_cuda(rank: int, world_size: int, names: list, fallbacks: bool) -> dict:
    torch.manual_seed(0)
    out = {}
    for name in names:
        rs_mode, prefetch, raf = CONFIGS[name]
        kw = dict(rs_mode=rs_mode, prefetch=prefetch, raf=raf)
        out[name] = {"stock": _train(rank, use_tide=False, **kw), "tide": _train(rank, use_tide=True, **kw)}
    if fallbacks:
        def async_unshard(model):
            model._set_unshard_async_op(True)

        kw = dict(rs_mode="slot_reuse", prefetch=True, raf=True, setup=async_unshard)
        out["async_op"] = {"stock": _train(rank, use_tide=False, **kw), "tide": _train(rank, use_tide=True, **kw)}
        out["graph_capture"] = _graph_capture_predicates(rank)
        out["files_entered"] = _files_entered(rank)
    return out


# ------------------------------------------------------------------------------------------ test side
def _close(what: str, got, want, atol: float, rtol: float) -> None:
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    diff = (got - want).abs()
    assert torch.allclose(got, want, atol=atol, rtol=rtol), (
        f"{what}: max |diff| {diff.max().item():.3e} (atol {atol}, rtol {rtol}); got {got.flatten()[:4].tolist()}, "
        f"want {want.flatten()[:4].tolist()}")


def _assert_parity(name: str, r: dict) -> None:
    from tests.fsdp import workers

    stock, tide_ = r["stock"], r["tide"]
    _close(f"{name} losses", tide_["losses"], stock["losses"], workers.LOSS_ATOL_BF16, 0)
    assert len(stock["params"]) == len(tide_["params"]) > 0
    for i, (a, b) in enumerate(zip(tide_["params"], stock["params"])):
        _close(f"{name} param {i}", torch.from_numpy(a), torch.from_numpy(b), workers.PARAM_ATOL, workers.PARAM_RTOL)
    assert len(stock["grads"]) == len(tide_["grads"]) > 0
    for i, (a, b) in enumerate(zip(tide_["grads"], stock["grads"])):
        _close(f"{name} grad {i}", torch.from_numpy(a), torch.from_numpy(b), workers.GRAD_ATOL, workers.GRAD_RTOL)


def _assert_transport_ran(name: str, t: dict, rs_mode: str, raf: bool, ag_tide: bool = True) -> None:
    calls = t["transport"]
    direct = "all_gather_into_params_:stock:outputs_not_in_slot"
    assert not any(":stock" in k for k in calls if k != direct), \
        f"{name}: a tide op took the reference backend: {calls}"
    assert calls.get("reduce_scatter_params_:tide", 0) == t["stats"]["reduce_scatter"].get("tide", 0) > 0, (name, calls)
    assert t["stats"]["reduce_scatter"] == {"tide": t["stats"]["reduce_scatter"].get("tide", 0)}, (name, t["stats"])
    assert t["stats"]["reduce_scatter"]["tide"] > 0, (name, t["stats"])
    arena = t["arena"]
    assert arena.get("arena:created") == 1 and t["arenas"] == 1 and t["arenas_after_disable"] == 0, (name, arena, t)
    # The data region is leased per phase: none at the loss or after backward, at most a forward and a
    # backward lease per step (STEPS steps and one more forward and backward).
    assert t["leased_at_loss"] == [False] and t["leased_after_backward"] == [False], (name, t)
    assert 0 < t["leases"] <= 2 * (STEPS + 1), (name, t["leases"])
    if ag_tide:
        ag = t["stats"]["all_gather"]
        assert ag.get("tide", 0) > 0 and set(ag) <= {"tide", "stock:arena_busy"}, (name, ag)
        # Blocks that reshard after forward are gathered straight into their slot; the root (and
        # reshard_after_forward=False blocks) keep stock's outputs, gathered in place by the op's
        # reference path, with no slot-sized copy beside them.
        assert arena.get("ag:direct", 0) > 0 and arena["ag:direct"] == calls.get(direct, 0), (name, arena, calls)
        if raf:
            assert arena.get("ag:bound", 0) > 0, (name, arena)
            assert arena["ag:bound"] == calls.get("all_gather_into_params_:tide", 0), (name, arena, calls)
        else:
            assert "ag:bound" not in arena and "all_gather_into_params_:tide" not in calls, (name, arena, calls)
    # Every reduce ran on TIDE; Slot-Reuse (gradients read from the slot) only for groups bound in a slot
    # (blocks resharded after forward), the others In-Place.
    ran = {k: v for k, v in arena.items() if k.startswith("rs:") and k != "rs:grad_into_slot"}
    allowed = {"rs:in_place"} if rs_mode == "in_place" else {"rs:slot_reuse", "rs:in_place"}
    assert set(ran) <= allowed and sum(ran.values()) == t["stats"]["reduce_scatter"]["tide"], (name, arena, t["stats"])
    # Slot-Reuse hooks move the gradients of slot-bound blocks into their slot regions as autograd
    # finishes them; nothing is bound without reshard_after_forward, so nothing moves then.
    if rs_mode == "slot_reuse" and raf and ag_tide:
        assert arena.get("rs:slot_reuse", 0) > 0 and arena.get("rs:grad_into_slot", 0) > 0, (name, arena)
    else:
        assert "rs:grad_into_slot" not in arena and "rs:slot_reuse" not in arena, (name, arena)


def _backend(world_size: int) -> str:
    return "nccl" if torch.cuda.device_count() >= world_size else "gloo"


@pytest.fixture(scope="module", params=[2, 4])
def fsdp_run(request, ext):
    ws = request.param
    names = list(CONFIGS) if ws == 2 else ["in_place_prefetch_raf", "slot_reuse_prefetch_raf",
                                          "slot_reuse_noprefetch_noraf"]
    results = run_ranks(fsdp_cuda, ws, names, ws == 2, backend=_backend(ws), device_type="cuda", env=ranks.ENV,
                        timeout=420)
    return ws, names, results


def test_parity_and_transport(fsdp_run):
    ws, names, results = fsdp_run
    for rank, res in enumerate(results):
        for name in names:
            rs_mode, _, raf = CONFIGS[name]
            r = res[name]
            _assert_parity(f"W={ws} rank {rank} {name}", r)
            _assert_transport_ran(f"W={ws} rank {rank} {name}", r["tide"], rs_mode, raf)
            # The stock model is not opted in: the installed seam hands every call to stock FSDP2.
            for kind in ("all_gather", "reduce_scatter"):
                assert set(r["stock"]["stats"][kind]) <= {"stock:not_enabled"}, r["stock"]["stats"]
            assert r["stock"]["transport"] == {} and r["stock"]["arena"] == {}


def test_async_unshard_takes_stock(fsdp_run):
    ws, _, results = fsdp_run
    if ws != 2:
        pytest.skip("fallbacks run on 2 ranks")
    for rank, res in enumerate(results):
        r = res["async_op"]
        _assert_parity(f"rank {rank} async_op", r)
        t = r["tide"]
        assert set(t["stats"]["all_gather"]) == {"stock:async_op"}, t["stats"]
        _assert_transport_ran(f"rank {rank} async_op", t, "slot_reuse", True, ag_tide=False)
        assert "all_gather_into_params_:tide" not in t["transport"]


def test_capture_before_the_arena_takes_stock(fsdp_run):
    ws, _, results = fsdp_run
    if ws != 2:
        pytest.skip("fallbacks run on 2 ranks")
    for res in results:
        r = res["graph_capture"]
        assert r["ag"] == "capture_before_arena" and r["rs"] == "capture_before_arena", r
        assert r["replayed"] == [1.0] * 4


def _steady_path_files(section: str) -> list[str]:
    """The Python files docs/design.md's numbered steps of ``section`` name (the steady call), in order of first
    mention."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    start = doc.index(section)
    text = doc[start:doc.index("\n#", start + 1)]
    steps = "\n".join(line for line in text.splitlines() if re.match(r"(\d+\. | {3})\S", line))
    files = []
    for f in re.findall(r"(tide/[\w/]+\.py)", steps):
        if f not in files:
            files.append(f)
    return files


def test_design_md_names_every_file_a_steady_call_enters(fsdp_run):
    """docs/design.md's paths of one all-gather and one reduce-scatter name, in their numbered steps, every
    ``tide/`` Python file a steady call of the seam enters, in the order it first enters them (the C++ files
    they name must exist: tests/test_house.py)."""
    ws, _, results = fsdp_run
    if ws != 2:
        pytest.skip("profiled on 2 ranks")
    for rank, res in enumerate(results):
        entered = res["files_entered"]
        for kind, section in (("all_gather", "### The path of one all-gather"),
                              ("reduce", "### The path of one reduce-scatter")):
            assert entered[kind], f"rank {rank}: no steady {kind} was profiled"
            named = _steady_path_files(section)
            for files in entered[kind]:
                assert files == named, (f"rank {rank}: a steady {kind} entered {files}; docs/design.md's "
                                        f"{section!r} names {named}")
