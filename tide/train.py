"""Main command: train the Llama-like model with stock FSDP2 and with TIDE, then compare.

    python -m tide.train [--ranks 4] [--steps 10] [--model tiny] [--device auto] [--backend auto]
    python -m tide.train --compile [--model small] ...
    torchrun --nproc-per-node 4 -m tide.train ...

``--compile``: the model sharded SimpleFSDP-style (tide/compile/simple_fsdp.py: DTensor ``Shard(0)`` parameters
gathered at each read, resharded after forward) with its forward and loss compiled by Inductor, compiled stock
(Inductor's best FSDP bucketing and overlap of this torch) against compiled TIDE (``tide.compile.enable()``);
the table adds, per compiled graph, the collectives TIDE replaced and, from each variant's generated code,
how many of its collectives are exposed (no compute between the call and its wait). Stock's functional
collectives over gloo cannot take CUDA tensors: with ranks sharing a GPU only compiled TIDE runs. Inductor's
kernels are cached per rank between runs (under the temporary directory): the first run compiles them all
(minutes on a 2-core CPU), later runs reuse them.

Without torchrun it spawns ``--ranks`` local ranks (CPU + gloo without a GPU; one rank per GPU with
NCCL when GPUs exist), the stock run and the TIDE run each in processes of their own. Under torchrun
(RANK/WORLD_SIZE set) both run in-process, one after the other. Rank 0 prints a progress line per step
and a final table: loss per step for both runs and their max difference, median step time, peak memory
(CUDA: the allocator's peak plus TIDE's arena; CPU: the processes' max RSS, which torchrun's single
process cannot split between the two runs) and the layout-conversion bytes TIDE removed per step (0 when
no collective took the TIDE path, e.g. with one rank).
"""
from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import tide.fsdp
from tide import transport
from tide.launch import CUDA_RANK_ENV, RankError, exit_cleanly, run_ranks
from tide.meta.layout import GroupLayout
from tide.models import PRESETS, Llama, LlamaConfig, batch, loss_fn


def fsdp_model(cfg: LlamaConfig, *, device, mp_policy: MixedPrecisionPolicy | None = None, use_tide: bool = False,
               rs_mode: str = "in_place", prefetch: bool = False, seed: int = 0, before_shard=None,
               outer_units: bool = False, **fsdp_kwargs) -> Llama:
    """The model with ``fully_shard`` on every block and on the root; ``fsdp_kwargs`` go to every call.
    ``prefetch`` sets explicit forward/backward prefetch of the next/previous block; ``before_shard(model)``
    may change the model before sharding. ``outer_units`` shards the embedding, the final norm and the head
    as units of their own, so the root holds no parameter and every collective is a unit's (a CUDA graph
    captured over a gloo group, where the root's stock collectives could not be captured)."""
    torch.manual_seed(seed)
    with torch.device(device):  # built where it trains: no host copy of a large model
        model = Llama(cfg)
    if before_shard is not None:
        before_shard(model)
    if mp_policy is not None:
        fsdp_kwargs["mp_policy"] = mp_policy
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    if outer_units:
        if cfg.tie_embeddings:
            raise ValueError("tide.train.fsdp_model: outer_units needs untied embeddings (the head shares the "
                             "embedding's weight)")
        for unit in (model.embed, model.norm, model.head):
            fully_shard(unit, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    if prefetch:
        layers = list(model.layers)
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
    if use_tide:
        tide.fsdp.enable(model, rs_mode=rs_mode)
    return model


def float8_blocks(model: Llama) -> None:
    """torchao's float8 training on the blocks' linears with FSDP2's float8 all-gather
    (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``, a torchtitan option), as a ``before_shard``
    of :func:`fsdp_model`. The head stays bf16 (its vocab need not be a multiple of 16). Needs torchao, and a
    GPU with float8 matmuls (compute capability 8.9+) to train."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise RuntimeError("tide.train.float8_blocks: torchao is not installed (pip install torchao)") from e
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda module, fqn: fqn.startswith("layers."))


def train_step(model, optim, cfg: LlamaConfig, step: int, rank: int, *, accum: int = 1, no_sync: bool = False,
               device="cpu", batch_size: int = 2, seq_len: int | None = None) -> torch.Tensor:
    """One optimizer step over ``accum`` micro-batches of ``batch_size`` x ``seq_len`` tokens (with
    ``no_sync``: only the last reduces). Returns this rank's loss (mean over micro-batches), detached.
    The step is declared to TIDE (``tide.call_identity(step=...)``): a rank that skipped a step raises on
    every rank at its next TIDE call instead of pairing that step's collectives with its peers' (CPU)."""
    total = torch.zeros((), device=device)
    with tide.call_identity(step=step):
        for a in range(accum):
            if no_sync:
                model.set_requires_gradient_sync(a == accum - 1)
            tokens, targets = batch(cfg, step * accum + a, rank, batch_size, device=device, seq_len=seq_len)
            loss = loss_fn(model(tokens), targets) / accum
            loss.backward()
            total += loss.detach()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return total


def removed_bytes_per_step(model: Llama) -> int:
    """Layout-conversion bytes TIDE removes per training step on one rank, from the layout plan of every
    group: one unshard in forward, one more in backward for groups resharded after forward, one reduce."""
    total = 0
    for g in tide.fsdp.param_groups(model):
        ps = g.fsdp_params
        ws = g._all_gather_process_group.size() if ps else 1
        layout = GroupLayout([tuple(p._orig_size) for p in ps],
                             [(p.param_dtype or p.orig_dtype).itemsize for p in ps], ws,
                             grad_itemsizes=[(p.param_dtype or p.orig_dtype).itemsize for p in ps])
        conv = layout.layout_conversion_bytes([p.orig_dtype.itemsize for p in ps])
        unshards = 2 if g.post_forward_mesh_info is not None else 1
        total += unshards * (conv["all_gather_copy_in"] + conv["split_with_sizes_copy"]) + conv["chunk_cat"]
    return total


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA max_memory_allocated"
    # ru_maxrss is KiB on Linux; it is the process high-water mark (covers both runs).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process max RSS (CPU)"


def _run(label: str, args, cfg: LlamaConfig, rank: int, world_size: int, device: torch.device) -> dict:
    use_tide = label == "tide"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    model = fsdp_model(cfg, device=device, mp_policy=mp, use_tide=use_tide, rs_mode=args.rs_mode, seed=args.seed)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tide.reset_stats()
    losses, times = [], []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = train_step(model, optim, cfg, step, rank, device=device)
        dist.all_reduce(loss)  # mean over ranks, also a barrier for the timing
        loss = loss.item() / world_size
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if rank == 0:
            print(f"[{label:5s}] step {step + 1}/{args.steps}  loss {loss:.6f}  {times[-1] * 1e3:8.1f} ms", flush=True)
    peak, peak_kind = peak_memory(device)
    if use_tide and device.type == "cuda":
        # TIDE's symmetric memory is not in the caching allocator's counters: add it (the flag words; the
        # slots and ring are leased from the allocator, which counts them).
        peak += sum(a.symmetric_bytes for a in transport.arenas())
        peak_kind += " + TIDE's symmetric memory"
    stats = tide.stats()["fsdp"]
    ran_tide = stats["all_gather"].get("tide", 0) + stats["reduce_scatter"].get("tide", 0) > 0
    return {"losses": losses, "median_step_s": statistics.median(times[1:] or times), "peak": peak,
            "peak_kind": peak_kind, "stats": stats, "removed": removed_bytes_per_step(model) if ran_tide else 0}


def _table(stock: dict, tide_: dict, args, world_size: int, device_type: str, shared_process: bool) -> str:
    lines = [f"\nTIDE vs stock FSDP2: model={args.model} ranks={world_size} device={device_type} "
             f"backend={args.backend} torch={torch.__version__} params={'bf16/fp32 reduce' if args.bf16 else 'fp32'}",
             f"{'step':>5} {'stock loss':>12} {'tide loss':>12} {'|diff|':>10}"]
    diffs = []
    for i, (a, b) in enumerate(zip(stock["losses"], tide_["losses"])):
        diffs.append(abs(a - b))
        lines.append(f"{i + 1:>5} {a:>12.6f} {b:>12.6f} {diffs[-1]:>10.2e}")
    mib = 1 << 20
    if device_type == "cpu" and shared_process:
        peak = f"stock {stock['peak'] / mib:.1f} MiB; tide not measurable (one process ran both, max RSS only grows)"
    else:
        peak = f"stock {stock['peak'] / mib:.1f} MiB   tide {tide_['peak'] / mib:.1f} MiB   ({tide_['peak_kind']})"
    removed = (f"{tide_['removed'] / mib:.3f} MiB per step per rank (GroupLayout plan)" if tide_["removed"]
               else "0 (no collective took the TIDE path: see the path counts)")
    lines += [
        f"max |loss diff|            {max(diffs):.3e}",
        (f"median step time           stock {stock['median_step_s'] * 1e3:.1f} ms   "
         f"tide {tide_['median_step_s'] * 1e3:.1f} ms"),
        f"peak memory, rank 0        {peak}",
        f"layout conversion removed  {removed}",
        f"tide path counts           {tide_['stats']}",
    ]
    if device_type == "cpu":
        lines.append("note: on CPU the tide ops run the reference backend (one gloo collective per parameter), "
                     "so step times compare gloo call counts, not the CUDA transport")
    return "\n".join(lines)


def run(rank: int, world_size: int, args, label: str) -> dict:
    """One training run (``label``: ``"stock"``, ``"tide"``, ``"compiled_stock"`` or ``"compiled_tide"``) on
    this rank."""
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if label.startswith("compiled_"):
        from tide import train_compiled

        out = train_compiled.run(label, args, PRESETS[args.model], rank, world_size, device)
        out["peak"], out["peak_kind"] = peak_memory(device)
        return out
    return _run(label, args, PRESETS[args.model], rank, world_size, device)


def labels(args) -> tuple[str, ...]:
    """The runs to compare: eager stock and TIDE, or (``--compile``) compiled stock where it can run, and TIDE."""
    if not args.compile:
        return "stock", "tide"
    return ("compiled_tide",) if args.device == "cuda" and args.backend == "gloo" else ("compiled_stock",
                                                                                          "compiled_tide")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="tide-train", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--ranks", type=int, default=None, help="local ranks to spawn (default: GPUs, or 4 on CPU)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--rs-mode", choices=tide.fsdp.RS_MODES, default="in_place")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--fp32", dest="bf16", action="store_false",
                   help="no mixed precision (default: bf16 params, fp32 reduce)")
    p.add_argument("--compile", action="store_true",
                   help="SimpleFSDP compiled by Inductor: compiled stock against compiled TIDE (tide.compile)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before spawned ranks are killed")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.backend == "auto":
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl needs --device cuda")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun decides the ranks
        if args.ranks is not None and args.ranks != int(os.environ["WORLD_SIZE"]):
            p.error(f"--ranks {args.ranks} under torchrun, which started {os.environ['WORLD_SIZE']} ranks: "
                    "set the rank count with torchrun's --nproc-per-node")
        args.ranks = int(os.environ["WORLD_SIZE"])
    if args.ranks is None:
        args.ranks = torch.cuda.device_count() if args.device == "cuda" else 2 if args.compile else 4
    if args.compile and PRESETS[args.model].n_experts:
        p.error(f"--compile needs a dense --model (the MoE routing breaks the compiled graph), got {args.model}")
    if args.ranks < 1 or args.steps < 1:
        p.error("--ranks and --steps must be >= 1")
    if args.timeout <= 0:
        p.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.backend == "nccl" and args.ranks > torch.cuda.device_count():
        p.error(f"--backend nccl needs one GPU per rank: {args.ranks} ranks, {torch.cuda.device_count()} GPUs")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if args.device == "cuda":
            for key, value in CUDA_RANK_ENV.items():  # multicast off before NCCL reads its environment
                os.environ.setdefault(key, value)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
        try:
            results = [run(rank, world_size, args, label) for label in labels(args)]
            if rank == 0:
                print(_report(results, args, world_size, shared_process=True), flush=True)
        finally:
            dist.destroy_process_group()
        exit_cleanly()  # torch 2.13's gloo teardown aborts now and then after a clean run
    print(f"tide.train: spawning {args.ranks} ranks ({args.device}, {args.backend}), model={args.model}, "
          f"steps={args.steps}{', compiled' if args.compile else ''}", flush=True)
    try:
        results = [run_ranks(run, args.ranks, args, label, backend=args.backend, device_type=args.device,
                             timeout=args.timeout)[0] for label in labels(args)]
    except (RankError, TimeoutError) as e:
        print(f"tide.train: {e}", file=sys.stderr, flush=True)
        return 1
    print(_report(results, args, args.ranks, shared_process=False), flush=True)
    return 0


def _report(results: list[dict], args, world_size: int, shared_process: bool) -> str:
    if args.compile:
        from tide import train_compiled

        stock = results[0] if len(results) == 2 else None
        return train_compiled.table(stock, results[-1], args, world_size, args.device)
    return _table(*results, args, world_size, args.device, shared_process=shared_process)


if __name__ == "__main__":
    sys.exit(main())
