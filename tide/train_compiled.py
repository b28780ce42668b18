"""``python -m tide.train --compile``: one compiled run per variant, and the table comparing them (tide/train.py
is the command).

The model of ``tide.models`` sharded SimpleFSDP-style (tide/compile/simple_fsdp.py: DTensor ``Shard(0)`` parameters
gathered at each read, resharded after forward), its forward and loss compiled by Inductor: ``compiled_stock`` with
Inductor's best FSDP bucketing and overlap of this torch, ``compiled_tide`` after ``tide.compile.enable()``. Step 0's
generated code gives each graph's collectives and how many are exposed (tide/compile/exposure.py).
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from tide.models import Llama, LlamaConfig, batch, loss_fn


def run(label: str, args, cfg: LlamaConfig, rank: int, world_size: int, device: torch.device) -> dict:
    """One compiled run: ``compiled_stock`` or ``compiled_tide`` (see the module doc); step 0's generated code
    gives each graph's exposure."""
    import tempfile

    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh

    import tide.compile
    from tide.compile import exposure, simple_fsdp

    use_tide = label == "compiled_tide"
    # A cache of Inductor's kernels per rank (the ranks' graphs differ where shards are uneven), kept between runs
    # and shared by the two variants: the first run compiles every kernel, later ones reuse them.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"tide_train_inductor_{os.getuid()}",
                                                         f"rank{rank}_of_{world_size}")
    torch._dynamo.reset()
    tide.compile.reset_report()
    # Intermediates rounded to their dtype as in eager: else Inductor fuses stock's fp32 cast of a bf16 gradient
    # into the kernel that made it and never rounds it, while TIDE's op reads it rounded (docs/compile.md).
    options = {"emulate_precision_casts": True, **({} if use_tide else simple_fsdp.best_stock_options(device.type))}
    with simple_fsdp.reshard_after_forward(), config.patch(options):
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = Llama(cfg)
        simple_fsdp.simple_fsdp(model, init_device_mesh(device.type, (world_size,)),
                                param_dtype=torch.bfloat16 if args.bf16 else torch.float32)
        optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
        if use_tide:
            tide.compile.enable()
            tide.compile.prepare(model, param_dtype=torch.bfloat16 if args.bf16 else None)
        loss_of = torch.compile(lambda tokens, targets: loss_fn(model(tokens), targets), fullgraph=True, dynamic=False)
        tide.reset_stats()
        losses, times, graphs = [], [], []
        try:
            for step in range(args.steps):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                if use_tide:
                    tide.compile.release()

                def forward_backward():
                    loss = loss_of(*batch(cfg, step, rank, device=device))
                    loss.backward()
                    return loss

                if step == 0:
                    loss, codes = run_and_get_code(forward_backward)
                    graphs = [exposure.summary(exposure.of_code(code)) for code in codes]
                else:
                    loss = forward_backward()
                optim.step()
                optim.zero_grad(set_to_none=True)
                loss = loss.detach()
                dist.all_reduce(loss)
                loss = loss.item() / world_size
                times.append(time.perf_counter() - t0)
                losses.append(loss)
                if rank == 0:
                    print(f"[{label}] step {step + 1}/{args.steps}  loss {loss:.6f}  {times[-1] * 1e3:8.1f} ms",
                          flush=True)
        finally:
            if use_tide:
                tide.compile.disable()
    return {"losses": losses, "median_step_s": statistics.median(times[1:] or times), "graphs": graphs,
            "report": tide.compile.report(), "ops": tide.stats()["ops"]}


def _graph_lines(name: str, graphs: list[dict]) -> list[str]:
    lines = []
    for i, graph in enumerate(graphs):
        what = "forward" if i == 0 else "backward" if i == 1 else f"graph {i}"
        cells = [f"{kind} {c['calls']} calls, {c['exposed']} exposed ({c['exposed_unread']} waited before a read)"
                 for kind, c in graph.items()]
        lines.append(f"  {name:14s} {what:9s} " + ("; ".join(cells) or "no collective"))
    return lines


def table(stock: dict | None, tide_: dict, args, world_size: int, device_type: str) -> str:
    lines = [f"\ncompiled TIDE vs compiled stock (SimpleFSDP, Inductor): model={args.model} ranks={world_size} "
             f"device={device_type} backend={args.backend} torch={torch.__version__}"]
    if stock is None:
        lines.append("compiled stock: not run (its functional collectives over gloo cannot take CUDA tensors)")
        lines += [f"{'step':>5} {'tide loss':>12}"] + [f"{i + 1:>5} {b:>12.6f}" for i, b in enumerate(tide_["losses"])]
    else:
        lines.append(f"{'step':>5} {'stock loss':>12} {'tide loss':>12} {'|diff|':>10}")
        lines += [f"{i + 1:>5} {a:>12.6f} {b:>12.6f} {abs(a - b):>10.2e}"
                  for i, (a, b) in enumerate(zip(stock["losses"], tide_["losses"]))]
        lines.append(f"median step time           stock {stock['median_step_s'] * 1e3:.1f} ms   "
                     f"tide {tide_['median_step_s'] * 1e3:.1f} ms")
    mib = 1 << 20
    if stock is None:
        lines.append(f"median step time           tide {tide_['median_step_s'] * 1e3:.1f} ms")
        lines.append(f"peak memory, rank 0        tide {tide_['peak'] / mib:.1f} MiB ({tide_['peak_kind']})")
    else:
        lines.append(f"peak memory, rank 0        stock {stock['peak'] / mib:.1f} MiB   "
                     f"tide {tide_['peak'] / mib:.1f} MiB ({tide_['peak_kind']})")
    report = tide_["report"]
    replaced = "; ".join(f"{kind}: {c.get('tide', 0)} collectives in {c.get('buckets', 0)} TIDE calls"
                         + "".join(f", {n} left to stock ({r})" for r, n in c.items() if r.startswith("stock:"))
                         for kind, c in report.items() if isinstance(c, dict))
    lines += [f"replaced by TIDE            {replaced} ({report['graphs']} graphs)",
              "collectives per graph, from the generated code (exposed: no compute between a call and its wait)"]
    if stock is not None:
        lines += _graph_lines("compiled stock", stock["graphs"])
    lines += _graph_lines("compiled tide", tide_["graphs"])
    lines.append(f"tide graph ops             {tide_['ops']}")
    if device_type == "cpu":
        lines.append("note: on CPU the tide ops run the reference backend (one gloo collective per parameter), so "
                     "step times compare gloo call counts, not the CUDA transport")
    return "\n".join(lines)
