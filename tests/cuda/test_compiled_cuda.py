"""TIDE's graph ops inside compiled training on CUDA (skipped without CUDA): the SimpleFSDP toy of the compile
tests (uneven shards, bf16 params with fp32 reduce, tied weights, activation checkpointing) compiled with
Inductor after ``tide.compile.enable()``, on two ranks sharing one GPU over gloo.

Three runs from the same seed and data, each returning per step the loss and every parameter's gradient
shard: TIDE's reference backend (no arena), the CUDA transport (``tide.compile.prepare``), and the transport
with forward and backward captured into one CUDA graph and replayed. The transport runs must equal the
reference bit for bit, and ``tide.stats()`` must show the copy-engine paths (``all_gather_start:slot``, or
``all_gather_start:allocator:<why>`` on the direct lane, and ``*:tide``), not the reference backend. Data is fresh per
run (the seed is in every message).
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.cuda import ranks
from tide.launch import run_ranks

pytestmark = pytest.mark.cuda

STEPS = 3


def _step_fn(model):
    """Forward and loss compiled; backward through the compiled graph's backward."""
    from tests.compile import simple_fsdp

    compiled = torch.compile(lambda tokens, targets: simple_fsdp.loss_fn(model(tokens), targets), dynamic=False)

    def step(tokens, targets):
        loss = compiled(tokens, targets)
        loss.backward()
        return loss.detach()

    return step


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.to_local().detach().clone() for p in model.parameters()]


def _run(rank: int, ws: int, seed: int, variant: str) -> dict:
    from torch._inductor import config
    from torch.distributed.device_mesh import init_device_mesh

    import tide
    import tide.compile
    from tests.compile import simple_fsdp
    from tide import transport

    torch._dynamo.reset()
    mesh = init_device_mesh("cuda", (ws,))
    model = simple_fsdp.build(mesh, seed=seed)
    if variant != "reference":
        tide.compile.prepare(model, param_dtype=torch.bfloat16)
    batches = [tuple(t.cuda() for t in simple_fsdp.batch(seed + k, rank)) for k in range(STEPS)]
    tide.compile.enable()
    try:
        with config.patch(emulate_precision_casts=True):
            step = _step_fn(model)
            for p in model.parameters():
                p.grad = None
            step(*batches[0])  # compiles and warms up (the captured variant records its graph after it)
            tide.reset_stats()
            out = []
            if variant == "captured":
                static = [t.clone() for t in batches[0]]
                tide.compile.release()  # the capture leases its own region
                graph = torch.cuda.CUDAGraph()
                for p in model.parameters():
                    p.grad.zero_()
                with torch.cuda.graph(graph):
                    loss = step(*static)
            for tokens, targets in batches:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.zero_()
                if variant == "captured":
                    static[0].copy_(tokens)
                    static[1].copy_(targets)
                    graph.replay()
                else:
                    loss = step(tokens, targets)
                out.append((loss.clone(), _grads(model)))
            torch.cuda.synchronize()
            stats = tide.stats()["ops"]
    finally:
        tide.compile.disable()
    if variant == "captured":
        del graph
    tide.compile.release()
    for a in transport.arenas():
        transport.disable(a.group_name)
    return {"steps": [(loss.cpu(), [g.cpu() for g in grads]) for loss, grads in out], "stats": stats}


def compiled_rank(rank: int, ws: int, seed: int) -> dict:
    return {variant: _run(rank, ws, seed, variant) for variant in ("reference", "transport", "captured")}


def test_compiled_simple_fsdp_on_the_transport_matches_the_reference(ext):
    seed = random.SystemRandom().randrange(1 << 20)
    ws = 2
    for rank, r in enumerate(run_ranks(compiled_rank, ws, seed, backend="gloo", device_type="cuda", env=ranks.ENV,
                                       timeout=580)):
        ref = r["reference"]
        assert ref["stats"].get("all_gather_start:reference:no_arena", 0) > 0, (seed, ref["stats"])
        for variant in ("transport", "captured"):
            got = r[variant]
            for k, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(got["steps"], ref["steps"])):
                ranks.assert_bits(f"seed {seed} rank {rank} {variant} step {k} loss", loss, want_loss)
                for i, (g, w) in enumerate(zip(grads, want_grads)):
                    ranks.assert_bits(f"seed {seed} rank {rank} {variant} step {k} grad {i}", g, w)
            stats = got["stats"]
            # every gather on the copy engines: in a slot, or on the direct lane when live outputs hold both
            assert not any(":stock:" in k or ":reference" in k for k in stats), (seed, variant, stats)
            assert stats.get("all_gather_start:slot", 0) > 0 and stats.get("reduce_scatter_start:allocator", 0) > 0
        assert r["transport"]["stats"].get("reduce_scatter_params_:tide", 0) > 0, (seed, r["transport"]["stats"])
