"""Training step of ``tide.models``' decoder under FSDP2: stock against TIDE, over a tokens-per-GPU sweep.

Presets (``--preset``): ``llama8b`` (Llama-3.1-8B-shaped blocks: dim 4096, ffn 14336, 32 heads, vocab
128256), ``moe`` (Qwen3-30B-A3B-shaped blocks: dim 2048, 16 heads of 128, 128 experts of ffn 768 as 3-D
parameters sharded on the expert dim, top-8, grouped GEMMs, vocab 151936), or a small one for smoke
runs. ``--blocks`` blocks (default 4) plus the root (embedding, final norm, head), every block and the
root ``fully_shard``-ed with bf16 params and fp32 reduce, explicit forward/backward prefetch (FSDP2's implicit
prefetch alone with ``--implicit-prefetch``: CSV names end in ``_implicit``), AdamW, ``--batch`` sequences of
tokens-per-GPU / batch tokens each.

Variants, each in processes of its own (a clean allocator and one symmetric-memory backend each):
``stock``; ``stock_nccl_ce`` (stock FSDP2 whose all-gather is NCCL's zero-SM copy-engine all-gather,
``bench/nccl_ce.py`` through ``set_custom_all_gather``, where torch and NCCL allow); ``tide_in_place``;
``tide_slot_reuse``. Per (variant, tokens): median step time over ``--steps`` steps after ``--warmup``
(the slowest rank's), peak memory of rank 0 (``max_memory_allocated`` plus TIDE's symmetric arena,
which the allocator does not count; ``device_used_mib``: the device's used memory after the steps, which
also holds what the allocator never sees, such as NCCL's communicators), and the CUDA graphs
instantiated per step after warm-up (``cudaGraphInstantiate`` calls in a profiled step). Writes ``train_step_8b.csv`` /
``train_step_moe.csv`` (``train_step_<preset>.csv`` for the small presets; ``_compiled`` added with a compiled variant)
and a PNG under ``--out``. With fewer GPUs than ranks the ranks share a GPU over gloo: a smoke run, not NVLink numbers.
``--local-world-size L`` emulates nodes of L ranks (``TIDE_CUDA_MULTINODE=1``: TIDE's variants run the multi-node
schedule, every round point-to-point; stock is unchanged) and writes ``<name>_multinode.csv``: the schedule's cost on
these GPUs, not what it gains across real nodes. ``--segments`` records the caching allocator's history on rank 0
(slower) and writes ``<name>_segments.csv``: per variant, the segments the allocator created, summed by the Python frame
that asked for each (where reserved memory goes; it found three causes of the multi-node step's reserved memory).

``--cuda-graphs`` adds the captured variants ``stock_graph``, ``tide_in_place_graph`` and
``tide_slot_reuse_graph``: forward and backward captured in one CUDA graph as torchtitan captures them
(``tide.graph_step.GraphStep``: an eager step, then capture, then replays; the optimizer outside), beside
the eager ones, and writes ``<name>_graphs.csv``. Every variant of such a run shards the embedding, norm and
head as units of their own (``tide.train.fsdp_model(outer_units=True)``), so the root holds no parameter:
over gloo (ranks sharing a GPU) only TIDE's collectives can be captured, and ``stock_graph`` is left out
there. With graphs, ``peak_reserved_mib`` is the figure to compare: a graph's pool keeps its segments.

``compiled_stock`` and ``compiled_tide`` (named in ``--variants``; dense presets): the same model sharded
SimpleFSDP-style (``tide/compile/simple_fsdp.py``: every parameter a ``Shard(0)`` DTensor gathered in bf16 at each read,
its gradient reduce-scattered in fp32, the parameters gathered again in the backward) with its forward and loss
compiled by Inductor (one graph, static shapes), stock collectives; ``compiled_tide`` compiled after
``tide.compile.enable()``, its arenas made by ``tide.compile.prepare`` before the first step and released after
each; ``compiled_stock`` with Inductor's best FSDP bucketing and overlap scheduling on the torch it runs on
(``tide.compile.simple_fsdp.best_stock_options``). Their rows join the same CSV and PNG (``ops_stats``:
``tide.stats()["ops"]``, which backend TIDE's graph ops took), and compiled_tide is compared with compiled_stock.
compiled_stock needs NCCL (stock's functional collectives over gloo with CUDA tensors crash the rank): where ranks share
a GPU it is left out. ``--device cpu`` runs the compiled variants on gloo CPU ranks (a smoke run). Every row also has
``first_loss``, the first step's loss, before any update: the same model and data in every variant.

``--hsdp R`` trains on a (R, ranks / R) replicate x shard mesh (``_hsdp<R>.csv``); ``--shard-experts`` places the
MoE preset's 3-D expert weights with ``Shard(1)`` through ``shard_placement_fn`` (``_shard1.csv``); ``--float8``
trains the blocks' linears in torchao's float8 with FSDP2's float8 all-gather, stock and TIDE alike
(``tide.train.float8_blocks``; needs torchao; ``_float8.csv``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out, log2_axes, pyplot, require_cuda, run_meta, write_csv  # noqa: E402

VARIANTS = ("stock", "stock_nccl_ce", "tide_in_place", "tide_slot_reuse")
COMPILED_VARIANTS = ("compiled_stock", "compiled_tide")
GRAPH_VARIANTS = ("stock_graph", "tide_in_place_graph", "tide_slot_reuse_graph")
DEFAULT_TOKENS = {"llama8b": "1024,4096,8192", "moe": "1024,4096"}
CSV_NAMES = {"llama8b": "train_step_8b", "moe": "train_step_moe"}
COLUMNS = ("variant", "tokens_per_gpu", "median_step_ms", "peak_mib", "graphs_built_per_step", "gpus", "ranks", "date",
           "device", "torch")


def graph_instantiations(fn) -> int:
    """``cudaGraphInstantiate`` calls made while ``fn`` runs (torch.profiler's runtime API events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.name.startswith("cudaGraphInstantiate"))


def segment_sites(snapshot: dict) -> list[dict]:
    """The segment allocations in ``snapshot`` (``torch.cuda.memory._snapshot()`` with its history recorded),
    summed by the innermost Python frame outside torch's own modules (torch.distributed's count: FSDP is
    one), largest first: ``{"site": "file.py:function", "segments", "mib"}``."""
    sums: dict[str, tuple[int, int]] = {}
    for trace in snapshot.get("device_traces", []):
        for entry in trace:
            if entry.get("action") != "segment_alloc":
                continue
            site = next((f"{os.path.basename(f['filename'])}:{f['name']}" for f in entry.get("frames", [])
                         if "/torch/" not in f["filename"] or "/torch/distributed/" in f["filename"]),
                        "(no Python frame)")
            count, nbytes = sums.get(site, (0, 0))
            sums[site] = (count + 1, nbytes + entry["size"])
    return [{"site": site, "segments": count, "mib": nbytes / 2**20}
            for site, (count, nbytes) in sorted(sums.items(), key=lambda kv: -kv[1][1])]


def _graph_step(model, optim, cfg, rank, device, batch_size, seq):
    """The step function of a captured variant: eager at its first call, captured at its second."""
    from tide.graph_step import GraphStep
    from tide.models import batch, loss_fn

    captured = GraphStep(model, loss_fn)

    def step(i):
        tokens, targets = batch(cfg, i, rank, batch_size, device=device, seq_len=seq)
        loss = captured(tokens, targets)
        optim.step()
        captured.zero_grad(optim)
        return loss

    return step, captured


def _layout_kwargs(world_size: int, hsdp: int | None, shard_experts: bool) -> dict:
    """``fully_shard`` keywords of ``--hsdp R`` (a (R, W / R) replicate x shard mesh) and ``--shard-experts``
    (``Shard(1)`` for the 3-D expert weights, as torchtitan places them)."""
    kw = {}
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        kw["mesh"] = init_device_mesh("cuda", (hsdp, world_size // hsdp), mesh_dim_names=("replicate", "shard"))
    if shard_experts:
        from torch.distributed.tensor import Shard

        kw["shard_placement_fn"] = lambda param: Shard(1) if param.dim() == 3 else None
    return kw


@contextlib.contextmanager
def _fsdp2_model(variant, cfg, rank, world_size, device, batch_size, prefetch, graphs_run, hsdp, shard_experts,
                 float8):
    """An FSDP2 variant's ``make_step(seq) -> (step, captured graph or None)``; TIDE's variants go back to stock
    FSDP2 at the end."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import tide.fsdp
    from tide.train import float8_blocks, fsdp_model, train_step

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tide_mode = {"tide_in_place": "in_place", "tide_slot_reuse": "slot_reuse"}.get(variant.removesuffix("_graph"))
    model = fsdp_model(cfg, device=device, mp_policy=mp, use_tide=tide_mode is not None,
                       rs_mode=tide_mode or "in_place", prefetch=prefetch, seed=0, outer_units=graphs_run,
                       before_shard=float8_blocks if float8 else None,
                       **_layout_kwargs(world_size, hsdp, shard_experts))
    if variant == "stock_nccl_ce":
        import nccl_ce

        comm = nccl_ce.fsdp_comm(nccl_ce.new_group())
        for module in list(model.layers) + [model]:
            module.set_custom_all_gather(comm)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make_step(seq):
        if variant.endswith("_graph"):
            return _graph_step(model, optim, cfg, rank, device, batch_size, seq)

        def step(i):
            return train_step(model, optim, cfg, i, rank, device=device, batch_size=batch_size, seq_len=seq)

        return step, None

    yield make_step
    if tide_mode is not None:
        tide.fsdp.disable(model)


@contextlib.contextmanager
def _compiled_model(variant, cfg, rank, world_size, device, batch_size, inductor_cache):
    """A compiled variant's ``make_step``: the model sharded SimpleFSDP-style (tide/compile/simple_fsdp.py: bf16
    gathers, fp32 reduce-scatters, the parameters gathered again in the backward), its forward and loss compiled by
    Inductor; ``compiled_stock`` with Inductor's best FSDP bucketing and overlap of this torch
    (``simple_fsdp.best_stock_options``), ``compiled_tide`` after ``tide.compile.enable()``, its arenas made by
    ``tide.compile.prepare`` before the first step and their regions released after each. Inductor caches in
    ``inductor_cache``/rank<r> (see :func:`main`)."""
    from torch._inductor import config
    from torch.distributed.device_mesh import init_device_mesh

    import tide.compile
    from tide import transport
    from tide.compile import simple_fsdp
    from tide.models import Llama, batch, loss_fn

    tide_run = variant == "compiled_tide"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(inductor_cache, f"rank{rank}")
    stock_options = {} if tide_run else simple_fsdp.best_stock_options(device.type)
    with simple_fsdp.reshard_after_forward(), config.patch(stock_options):
        torch.manual_seed(0)
        with torch.device(device):  # built where it trains, as tide.train.fsdp_model builds it
            model = Llama(cfg)
        simple_fsdp.simple_fsdp(model, init_device_mesh(device.type, (world_size,)), param_dtype=torch.bfloat16,
                                reduce_dtype=torch.float32)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loss_of = torch.compile(lambda tokens, targets: loss_fn(model(tokens), targets), fullgraph=True,
                                dynamic=False)
        arenas = []
        if tide_run:
            tide.compile.enable()
            arenas = tide.compile.prepare(model, param_dtype=torch.bfloat16)  # [] on CPU

        def make_step(seq):
            def step(i):
                tokens, targets = batch(cfg, i, rank, batch_size, device=device, seq_len=seq)
                loss = loss_of(tokens, targets)
                loss.backward()
                optim.step()
                optim.zero_grad(set_to_none=True)
                if tide_run:
                    tide.compile.release()
                return loss.detach()

            return step, None

        yield make_step
    if tide_run:
        tide.compile.disable()
        for arena in arenas:
            transport.disable(arena.group_name)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(variant, tokens, step, graph, steps, warmup, device) -> dict:
    """One row: ``step(i)`` run ``warmup`` times, then ``steps`` times timed (CUDA figures stay 0 on CPU)."""
    import tide
    from tide import transport

    tide.reset_stats()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first_loss = None  # before any update: the same in every variant
    for i in range(warmup):
        loss = step(i)
        if first_loss is None:
            first_loss = float(loss)
    times, issue_times = [], []
    leasing_s = -sum(a.leases.seconds for a in transport.arenas())
    for i in range(warmup, warmup + steps):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(i)
        issue_times.append(time.perf_counter() - t0)  # the host's part: the step is queued, not done
        _sync(device)
        times.append(time.perf_counter() - t0)
        if first_loss is None:
            first_loss = float(loss)
    leasing_s += sum(a.leases.seconds for a in transport.arenas())
    graphs = graph_instantiations(lambda: step(warmup + steps)) if device.type == "cuda" else 0
    arena_bytes = sum(a.symmetric_bytes for a in transport.arenas())  # outside the allocator's counters
    allocated = reserved = used = 0
    if device.type == "cuda":
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        free, total = torch.cuda.mem_get_info(device)  # what the allocator cannot see: NCCL's communicators too
        used = total - free
    stats = tide.stats()
    gathers = stats["ops"]  # the graph all-gathers of compiled_tide: in a slot, or on the direct lane
    direct = sum(n for k, n in gathers.items() if k.startswith("all_gather_start:allocator:"))
    ran = warmup + steps + (device.type == "cuda")  # the profiled step of graph_instantiations too
    return {"variant": variant, "tokens_per_gpu": tokens, "median_step_ms": statistics.median(times) * 1e3,
            "peak_mib": (allocated + arena_bytes) / 2**20, "peak_reserved_mib": (reserved + arena_bytes) / 2**20,
            "device_used_mib": used / 2**20,
            "graphs_built_per_step": graphs, "host_issue_ms": statistics.median(issue_times) * 1e3,
            "p90_step_ms": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
            "arena_mib": arena_bytes / 2**20, "first_loss": first_loss, "final_loss": float(loss),
            "stats": str(stats["fsdp"]), "arena_stats": str(stats["wiring"]),
            "ops_stats": str(stats["ops"]),  # the tide ops' backends: the graph ops' of the compiled variants
            "ag_slot_per_step": gathers.get("all_gather_start:slot", 0) / ran, "ag_direct_per_step": direct / ran,
            "multinode_stats": str(stats["multinode"]),  # rail rounds by implementation
            # cumulative over this process's steps: about 2 leases a step, and maps only while the
            # allocator moves a lease to new segments
            "leases": sum(a.leases.count for a in transport.arenas()),
            "peer_maps": sum(a.leases.maps_opened for a in transport.arenas()),
            # the measured steps' time in the data region's leases (the store exchange included)
            "lease_ms_per_step": leasing_s / steps * 1e3,
            "capture_s": graph.capture_s if graph is not None else 0.0}


def _variant_rank(rank, world_size, variant, preset, blocks, tokens_list, batch_size, steps, warmup, prefetch,
                  segments, graphs_run, hsdp=None, shard_experts=False, float8=False, device_type="cuda",
                  inductor_cache=""):
    import tide.compile
    from tide.models import PRESETS

    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if segments and rank == 0:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    cfg = dataclasses.replace(PRESETS[preset], n_layers=blocks, seq_len=max(tokens_list) // batch_size)
    if variant in COMPILED_VARIANTS:
        built = _compiled_model(variant, cfg, rank, world_size, device, batch_size, inductor_cache)
    else:
        built = _fsdp2_model(variant, cfg, rank, world_size, device, batch_size, prefetch, graphs_run, hsdp,
                             shard_experts, float8)
    rows, sites = [], []
    with built as make_step:
        for tokens in tokens_list:
            step, graph = make_step(tokens // batch_size)
            rows.append(_measure(variant, tokens, step, graph, steps, warmup, device))
            del step, graph  # a captured step's graph and pool go before the next token count's
            if rank == 0:
                _print_row(rows[-1])
        if variant == "compiled_tide":
            _check_graph_ops(rows)
        if rank == 0 and variant == "compiled_tide":
            print(f"{variant}: tide.compile.report() {tide.compile.report()}", flush=True)
        if segments and rank == 0:
            sites = [{"variant": variant, **site} for site in segment_sites(torch.cuda.memory._snapshot())]
            torch.cuda.memory._record_memory_history(enabled=None)
    return rows, sites


def _print_row(r: dict) -> None:
    stats = r["ops_stats"] if r["variant"] in COMPILED_VARIANTS else r["arena_stats"]
    print(f"{r['variant']:16s} {r['tokens_per_gpu']:6d} tok/GPU  median {r['median_step_ms']:8.2f} ms"
          f"  host {r['host_issue_ms']:7.2f} ms  peak {r['peak_mib']:9.1f} MiB (arena {r['arena_mib']:.0f})"
          f"  graphs/step {r['graphs_built_per_step']}  loss {r['final_loss']:.4f}"
          + (f"  gathers/step {r['ag_slot_per_step']:.0f} in slots, {r['ag_direct_per_step']:.0f} direct lane"
             if r["variant"] == "compiled_tide" else "") + f"  {stats}", flush=True)


def _check_graph_ops(rows: list[dict]) -> None:
    """compiled_tide's steps must have run TIDE's graph ops: a rewrite that matched nothing would time stock."""
    import tide.compile

    for r in rows:
        if not all(f"{op}:" in r["ops_stats"] for op in ("all_gather_start", "reduce_scatter_start")):
            raise RuntimeError(f"train_step.py: compiled_tide at {r['tokens_per_gpu']} tokens ran no TIDE graph op "
                               f"(tide.stats()['ops']: {r['ops_stats']}; tide.compile.report(): "
                               f"{tide.compile.report()})")


def _check_compiled(p, args, variants: list, backend: str, cfg) -> None:
    """Refuse the flags the compiled variants do not take; drop ``compiled_stock`` where it cannot run."""
    if args.device == "cpu" and (eager := [v for v in variants if v not in COMPILED_VARIANTS]):
        p.error(f"--device cpu runs only the compiled variants {COMPILED_VARIANTS}, not {eager}")
    if not any(v in COMPILED_VARIANTS for v in variants):
        return
    if cfg.n_experts:
        p.error(f"--preset {args.preset}: the compiled variants need a dense preset (the MoE routing's bincount "
                "breaks the compiled graph)")
    flags = {"--hsdp": args.hsdp, "--shard-experts": args.shard_experts, "--float8": args.float8,
             "--local-world-size": args.local_world_size}
    if taken := [flag for flag, on in flags.items() if on]:
        p.error(f"the compiled variants (SimpleFSDP: every parameter Shard(0) over one mesh dim) take none of {taken}")
    if args.segments and args.device == "cpu":
        p.error("--segments records the CUDA allocator's history: not with --device cpu")
    if "compiled_stock" in variants and args.device == "cuda" and backend != "nccl":
        print("train_step.py: no compiled_stock variant: ranks share a GPU, and stock's functional collectives "
              "over gloo with CUDA tensors crash the rank")
        variants.remove("compiled_stock")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama8b", help="llama8b, moe, or a small preset of tide.models")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--tokens", default=None, help="tokens per GPU per step, comma-separated (default by preset)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--ranks", type=int, default=None, help="default: the GPU count if >= 2, else 2")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--local-world-size", type=int, default=None,
                   help="emulate nodes of this many ranks (TIDE's variants run the multi-node schedule)")
    p.add_argument("--implicit-prefetch", action="store_true",
                   help="no explicit forward/backward prefetch: FSDP2's implicit overlap alone")
    p.add_argument("--segments", action="store_true",
                   help="record the allocator's history on rank 0 and write <name>_segments.csv (slower)")
    p.add_argument("--hsdp", type=int, default=None, metavar="R",
                   help="HSDP: R replicas of ranks/R shards each (writes <name>_hsdp<R>.csv)")
    p.add_argument("--shard-experts", action="store_true",
                   help="Shard(1) for the MoE preset's 3-D expert weights (writes <name>_shard1.csv)")
    p.add_argument("--float8", action="store_true",
                   help="torchao float8 linears in the blocks with FSDP2's float8 all-gather "
                        "(writes <name>_float8.csv)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="add the captured variants (" + ", ".join(GRAPH_VARIANTS) + "); writes <name>_graphs.csv")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the compiled variants on gloo CPU ranks, a smoke run (no GPU figures)")
    p.add_argument("--out", default=str(default_out()))
    args = p.parse_args(argv)
    if args.device == "cuda":
        require_cuda("train_step.py")
    from tide.launch import CUDA_RANK_ENV, run_ranks
    from tide.models import PRESETS

    if args.preset not in PRESETS:
        p.error(f"--preset must be one of {sorted(PRESETS)}, got {args.preset!r}")
    tokens = [int(t) for t in (args.tokens or DEFAULT_TOKENS.get(args.preset, "256")).split(",")]
    variants = args.variants.split(",") + (list(GRAPH_VARIANTS) if args.cuda_graphs else [])
    known = VARIANTS + COMPILED_VARIANTS + (GRAPH_VARIANTS if args.cuda_graphs else ())
    if bad := [v for v in variants if v not in known]:
        p.error(f"--variants: unknown {bad}; choose from {known}")
    if args.cuda_graphs and args.warmup < 2:
        p.error("--cuda-graphs needs --warmup >= 2 (an eager step, then the capture)")
    if args.blocks < 1 or args.batch < 1 or any(t % args.batch for t in tokens):
        p.error("--blocks and --batch must be >= 1 and every --tokens value a multiple of --batch")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    ranks = args.ranks or (gpus if gpus >= 2 else 2)
    backend = "nccl" if args.device == "cuda" and gpus >= ranks else "gloo"
    _check_compiled(p, args, variants, backend, PRESETS[args.preset])
    L, env = args.local_world_size, dict(CUDA_RANK_ENV)
    if L is not None:
        if not (1 <= L < ranks and ranks % L == 0):
            p.error(f"--local-world-size must divide the ranks ({ranks}) and be smaller, got {L}")
        env.update(LOCAL_WORLD_SIZE=str(L), TIDE_CUDA_MULTINODE="1")
    if "stock_nccl_ce" in variants:
        import nccl_ce

        why_not = nccl_ce.available() if backend == "nccl" else "ranks share a GPU"
        if why_not is not None:
            print(f"train_step.py: no stock_nccl_ce variant: {why_not}")
            variants.remove("stock_nccl_ce")
    if "stock_graph" in variants and backend != "nccl":
        print("train_step.py: no stock_graph variant: ranks share a GPU, "
              "and stock's gloo collectives cannot be captured")
        variants.remove("stock_graph")
    if args.hsdp is not None and not (1 <= args.hsdp <= ranks and ranks % args.hsdp == 0):
        p.error(f"--hsdp must divide the ranks ({ranks}), got {args.hsdp}")
    if args.shard_experts and not PRESETS[args.preset].n_experts:
        p.error(f"--shard-experts needs a preset with experts (moe, tiny_moe), got {args.preset!r}")
    if args.float8:
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            p.error("--float8 needs torchao (pip install torchao)")
    if args.cuda_graphs and L is not None:
        p.error("--cuda-graphs and --local-world-size: a multi-node step is not captured (capture_multinode)")
    if not variants:
        p.error("--variants: none of them can run here")
    rows, segment_rows = [], []
    # The compiled variants' Inductor cache: one per rank (the ranks' graphs differ where shards are uneven,
    # docs/compile.md), shared by this run's variants (compiled_tide reuses compiled_stock's kernels), and new
    # for each run (a graph an earlier run cached on one rank only would skip that rank's plan exchange, which
    # its peers then wait for).
    with tempfile.TemporaryDirectory(prefix="train_step_inductor_") as inductor_cache:
        for variant in variants:
            per_rank = run_ranks(_variant_rank, ranks, variant, args.preset, args.blocks, tokens, args.batch,
                                 args.steps, args.warmup, not args.implicit_prefetch, args.segments, args.cuda_graphs,
                                 args.hsdp, args.shard_experts, args.float8, args.device, inductor_cache,
                                 backend=backend, device_type=args.device, env=env, timeout=580)
            for i, r in enumerate(per_rank[0][0]):
                rows.append({**r, "median_step_ms": max(pr[0][i]["median_step_ms"] for pr in per_rank)})
            segment_rows += per_rank[0][1]
    mode = "one GPU per rank" if gpus >= ranks else f"{ranks} ranks sharing {gpus} GPU (smoke, gloo stock path)"
    if args.device == "cpu":
        mode = f"{ranks} CPU ranks over gloo (smoke, no GPU figures)"
    if L is not None:
        mode = f"{ranks // L} nodes x {L} EMULATED, {mode}"
    if args.implicit_prefetch:
        mode += ", implicit prefetch only"
    if args.cuda_graphs:
        mode += ", embedding/norm/head as units"
    if args.hsdp:
        mode += f", HSDP {args.hsdp} x {ranks // args.hsdp}"
    if args.shard_experts:
        mode += ", experts Shard(1)"
    if args.float8:
        mode += ", float8 linears (torchao)"
    meta = run_meta(gpus=gpus, ranks=ranks, backend=backend, preset=args.preset, blocks=args.blocks, batch=args.batch,
                    steps=args.steps, warmup=args.warmup, mode=mode, local_world_size=L or ranks,
                    prefetch="implicit" if args.implicit_prefetch else "explicit",
                    **({"device": "cpu"} if args.device == "cpu" else {}))
    rows = [{**{k: {**r, **meta}[k] for k in COLUMNS}, **r, **meta} for r in rows]
    name = (CSV_NAMES.get(args.preset, f"train_step_{args.preset}") + ("_multinode" if L is not None else "")
            + ("_implicit" if args.implicit_prefetch else "") + ("_graphs" if args.cuda_graphs else "")
            + (f"_hsdp{args.hsdp}" if args.hsdp else "") + ("_shard1" if args.shard_experts else "")
            + ("_float8" if args.float8 else "")
            + ("_compiled" if any(v.startswith("compiled") for v in variants) else ""))
    out = Path(args.out)
    write_csv(out / f"{name}.csv", rows)
    if args.segments:
        write_csv(out / f"{name}_segments.csv", [{**r, "tokens": ",".join(map(str, tokens))} for r in segment_rows])
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for v in variants:
            sel = [r for r in rows if r["variant"] == v]
            axes[0].plot([r["tokens_per_gpu"] for r in sel], [r["median_step_ms"] for r in sel], marker="o", label=v)
            axes[1].plot([r["tokens_per_gpu"] for r in sel], [r["peak_mib"] / 1024 for r in sel], marker="o", label=v)
        log2_axes(axes, "tokens per GPU", ("median step (ms)", "peak memory, rank 0 (GiB)"))
        fig.suptitle(f"{args.preset} x{args.blocks} blocks, {mode}, {meta['device']}, {meta['date']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=120)
    # each variant against its stock: the compiled ones against compiled_stock
    stock = {(r["variant"] in COMPILED_VARIANTS, r["tokens_per_gpu"]): r for r in rows
             if r["variant"] in ("stock", "compiled_stock")}
    base = {id(r): stock.get((r["variant"] in COMPILED_VARIANTS, r["tokens_per_gpu"])) for r in rows}
    print(f"SUMMARY train_step {args.preset} ({mode}): " + "; ".join(
        f"{r['variant']} {r['tokens_per_gpu']} tok {r['median_step_ms']:.1f} ms"
        + (f" ({(r['median_step_ms'] / base[id(r)]['median_step_ms'] - 1) * 100:+.0f}%)"
           if base[id(r)] not in (None, r) else "")
        + f" {r['peak_mib'] / 1024:.2f} GiB g{r['graphs_built_per_step']}" for r in rows))


if __name__ == "__main__":
    main()
