"""Rank functions of the CUDA-graph capture tests (tests/cuda/test_capture.py; importable without CUDA).

Op level: a sequence of TIDE-AG and TIDE-RS calls (outputs bound in both slots, gradients in fresh
tensors and in a slot, accumulating and not) is run eagerly once, captured into one graph, then
replayed with fresh random inputs copied into its static buffers and its outputs poisoned first; every
replay is compared bit for bit with the reference backend and with the eager transport on the same
inputs, run between the replays.

FSDP2 level: torchtitan's pattern (tide.graph_step.GraphStep): one eager step, then forward + backward
captured and replayed, the optimizer outside the graph, gradients zeroed in place; the losses and every
step's gradients are compared with eager TIDE (bit for bit) and eager stock FSDP2 (within the reduce's
tolerances) trained from the same seed on the same data.
"""
from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.cuda.ranks import ag_case, assert_bits, poison, cuda_all_gather, cuda_reduce_scatter, ref_all_gather, \
    ref_reduce_scatter, rs_case

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fault_scenarios  # noqa: E402

# name: (rs_mode, explicit prefetch)
CONFIGS = {
    "in_place_prefetch": ("in_place", True),
    "slot_reuse_prefetch": ("slot_reuse", True),
    "in_place_implicit": ("in_place", False),
    "slot_reuse_implicit": ("slot_reuse", False),
}


class _Sequence:
    """Static buffers of two all-gathers and two reduce-scatters, and the calls that use them."""

    def __init__(self, arena, seed: int, rank: int, world_size: int) -> None:
        self.arena, self.rank, self.W, self.name = arena, rank, world_size, dist.group.WORLD.group_name
        self.rng = random.Random(seed)  # the same on every rank: shapes, dtypes, modes
        self.ag = [ag_case(self.rng, world_size, rank, seed + i, self.rng.randint(2, 9)) for i in range(2)]
        self.rs = []
        for i in range(2):
            grads, init, scale, _ = rs_case(self.rng, world_size, rank, seed + 10 + i, self.rng.randint(2, 9))
            self.rs.append((grads, init, scale, i == 1))  # the second accumulates
        dev = arena.device
        self.shards = [[s.to(dev) for s in shards] for shards, _ in self.ag]
        self.grads_in = [[g.to(dev) for g in grads] for grads, *_ in self.rs]
        self.shard_grads = [[s.to(dev) for s in init] for _, init, *_ in self.rs]
        self.outs = self.grads = None

    def issue(self) -> None:
        """The four calls; outputs and slot gradients are views into the arena's slots (leased here)."""
        from tide.meta import plans

        a, W = self.arena, self.W
        self.outs = []
        for slot, ((shards_cpu, out_dtypes), shards) in enumerate(zip(self.ag, self.shards)):
            layout = plans.all_gather_layout([s.shape for s in shards], out_dtypes, W)
            outs = a.slot_views(layout, out_dtypes, slot)
            torch.ops.tide.all_gather_into_params_(shards, outs, W, self.name)
            self.outs.append(outs)
        # The first reduce-scatter reads gradients in fresh tensors, the second at their places in slot 2.
        grads_cpu = self.rs[1][0]
        self.grads = [self.grads_in[0], a.grad_views([g.shape for g in grads_cpu], [g.dtype for g in grads_cpu], 2)]
        for (_, _, scale, acc), grads, outs in zip(self.rs, self.grads, self.shard_grads):
            torch.ops.tide.reduce_scatter_params_(grads, outs, scale, acc, W, self.name)

    def refill(self, seed: int) -> list:
        """Fresh random inputs (copied into the static buffers, outputs poisoned); their CPU copies."""
        gen = torch.Generator().manual_seed(seed * 1000 + self.rank)
        fresh = {"shards": [[torch.randn(s.shape, generator=gen).to(s.dtype) for s in shards]
                            for shards in self.shards],
                 "grads": [[torch.randn(g.shape, generator=gen).to(g.dtype) for g in grads] for grads in self.grads],
                 "init": [[torch.randn(o.shape, generator=gen) for o in outs] for outs in self.shard_grads]}
        for dst, src in zip(self.shards + self.grads, fresh["shards"] + fresh["grads"]):
            for d, s in zip(dst, src):
                d.copy_(s)
        for outs, init, (*_, acc) in zip(self.shard_grads, fresh["init"], self.rs):
            for o, i in zip(outs, init):
                o.copy_(i) if acc else o.fill_(float("nan"))
        for outs in self.outs:
            for o in outs:
                poison(o)
        return fresh

    def check(self, fresh, what: str) -> None:
        """The outputs of the last issue against the reference backend and the eager transport, bit for bit."""
        for k, ((_, out_dtypes), outs) in enumerate(zip(self.ag, self.outs)):
            want = ref_all_gather(fresh["shards"][k], out_dtypes, self.W, self.name)
            eager = cuda_all_gather(self.arena, fresh["shards"][k], out_dtypes, self.W, self.name, bound=True)
            for i, (g, w, e) in enumerate(zip(outs, want, eager)):
                assert_bits(f"rank {self.rank} {what} all_gather {k} param {i} vs reference", g, w)
                assert_bits(f"rank {self.rank} {what} all_gather {k} param {i} vs eager", g, e)
        for k, ((_, _, scale, acc), outs) in enumerate(zip(self.rs, self.shard_grads)):
            grads, init = fresh["grads"][k], fresh["init"][k]
            want = ref_reduce_scatter(grads, init, scale, acc, self.W, self.name)
            eager = cuda_reduce_scatter(self.arena, grads, init, scale, acc, self.W, self.name,
                                        "autograd" if k == 0 else "slot")
            for i, (g, w, e) in enumerate(zip(outs, want, eager)):
                assert_bits(f"rank {self.rank} {what} reduce_scatter {k} param {i} vs reference", g, w)
                assert_bits(f"rank {self.rank} {what} reduce_scatter {k} param {i} vs eager", g, e)


def _captured_sequence(seed: int, rank: int, world_size: int):
    """The arena, the op sequence and its graph: run eagerly once, then captured (its lease in the graph)."""
    from tide import transport

    # Three slots (two all-gathers' outputs, one reduce-scatter's gradients); a ring the pushes wrap.
    arena = transport.enable(dist.group.WORLD, slot_bytes=4 << 20, rs_ring_bytes=64 << 10, num_slots=3)
    seq = _Sequence(arena, seed, rank, world_size)
    seq.issue()  # eager: plans agreed, extension loaded
    torch.cuda.synchronize()
    arena.release()  # a capture leases its own region, in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seq.issue()
    arena.release()  # eager work leases its own again
    return arena, seq, graph


def captured_ops(rank: int, world_size: int, seed: int, replays: int) -> dict:
    import tide

    tide.reset_stats()
    arena, seq, graph = _captured_sequence(seed, rank, world_size)
    captured = dict(tide.stats()["ops"])
    for r in range(replays):
        fresh = seq.refill(seed + 100 + r)
        graph.replay()
        torch.cuda.synchronize()
        seq.check(fresh, f"replay {r}")
        arena.release()  # the eager checks' lease
    del graph
    torch.cuda.synchronize()
    from tide.transport import watchdog

    return {"captured_stats": captured, "stats": tide.stats()["ops"], "replays": replays,
            "watched": watchdog.WATCHDOG.captured()}


def replay_fault(rank: int, world_size: int, scenario: str, fault_file: str) -> str:
    """The captured sequence replayed; rank 1 dies right after launching its third replay
    (``dies_in_replay``) or stops before its first (``never_replays``, alive past the peers' bound)."""
    _, seq, graph = _captured_sequence(7, rank, world_size)
    for r in range(5):
        if rank == fault_scenarios.FAULTY_RANK and scenario == "never_replays":
            fault_scenarios.stall(fault_file)
        seq.refill(r)
        graph.replay()
        if rank == fault_scenarios.FAULTY_RANK and scenario == "dies_in_replay" and r == 2:
            fault_scenarios.die(fault_file)
        torch.cuda.synchronize()
    return "finished"


# ----------------------------------------------------------------------------------------- FSDP2 level
def _cfg():
    from tide.models import PRESETS

    return dataclasses.replace(PRESETS["tiny"], n_layers=4)


def _train(rank: int, variant: str, rs_mode: str, prefetch: bool, steps: int) -> dict:
    import tide.fsdp
    from tests.fsdp.workers import BF16
    from tide.graph_step import GraphStep
    from tide.models import batch, loss_fn
    from tide.train import fsdp_model

    cfg = _cfg()
    dev = torch.device("cuda", torch.cuda.current_device())
    model = fsdp_model(cfg, device=dev, mp_policy=BF16, prefetch=prefetch, outer_units=True)
    if not variant.startswith("stock"):
        tide.fsdp.enable(model, rs_mode=rs_mode, transport="auto")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tide.reset_stats()
    step = GraphStep(model, loss_fn) if variant.endswith("_graph") else None
    losses, grads = [], []
    for s in range(steps):
        tokens, targets = batch(cfg, s, rank, device=dev)
        if step is not None:
            loss = step(tokens, targets)
        else:
            loss = loss_fn(model(tokens), targets)
            loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.to_local().float().cpu().numpy().copy() for p in model.parameters()])
        optim.step()
        optim.zero_grad(set_to_none=False)  # as GraphStep.zero_grad: every variant accumulates into zeros
    torch.cuda.synchronize()
    stats = tide.stats()
    out = {"losses": losses, "grads": grads, "fsdp": stats["fsdp"], "ops": stats["ops"], "wiring": stats["wiring"],
           "replays": step.replays if step is not None else 0}
    if step is not None:  # gradients set to None after the capture: the next call refuses to replay
        optim.zero_grad(set_to_none=True)
        try:
            step(tokens, targets)
        except RuntimeError as e:
            out["stale_grads"] = str(e)
    del step
    torch.cuda.synchronize()
    if not variant.startswith("stock"):
        tide.fsdp.disable(model)
    return out


def captured_training(rank: int, world_size: int, names: list, steps: int) -> dict:
    """Per configuration: stock, eager TIDE and captured TIDE; over NCCL also stock captured (gloo's
    collectives cannot be captured)."""
    variants = ("stock", "tide", "tide_graph") + (("stock_graph",) if dist.get_backend() == "nccl" else ())
    return {name: {v: _train(rank, v, *CONFIGS[name], steps) for v in variants} for name in names}
