"""Rank functions of the compile tests (run by ``tide.launch.run_ranks``): the SimpleFSDP toy trained a few SGD
steps compiled without TIDE's pass (stock) and with it, from the same seed and data, returning losses, full
parameters, what the compiled graphs hold (``graph_checks.summarize``) and the rewrite's reports."""
from __future__ import annotations

import contextlib
import os

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from tests.compile import graph_checks, simple_fsdp

STEPS = 3


def _aot_eager(rewrite: bool, graphs: list, reports: list):
    """aot_eager with the rewrite applied to each forward and backward graph (``rewrite``), recording them."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    import tide.compile

    def compiler(gm, example_inputs):
        if rewrite:
            reports.append(tide.compile.rewrite(gm))
        graphs.append(graph_checks.summarize(gm.graph))
        return make_boxed_func(gm)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


class Recorder(CustomGraphPass):
    """A post-grad pass that records what the graph holds (a ``CustomGraphPass``, so the FX graph cache works)."""

    def __init__(self, graphs: list):
        self.graphs = graphs

    def __call__(self, graph) -> None:
        self.graphs.append(graph_checks.summarize(graph))

    def uuid(self) -> bytes:
        return b"tests.compile.workers.Recorder"


@contextlib.contextmanager
def _inductor(rewrite: bool, graphs: list):
    """Inductor with ``tide.compile.enable()`` (``rewrite``), the post-grad graph recorded after every pass.
    Intermediates are rounded to their dtype as in eager (``emulate_precision_casts``): else a bf16 gradient
    fused into stock's fp32 cast is never rounded, while TIDE's op reads it rounded."""
    from torch._inductor import config

    import tide.compile

    from tide.compile.inductor import PassChain

    if rewrite:
        tide.compile.enable()
    passes = [p for p in (config.post_grad_custom_post_pass,) if p is not None]
    try:
        with config.patch(post_grad_custom_post_pass=PassChain(passes + [Recorder(graphs)]),
                          emulate_precision_casts=True):
            yield
    finally:
        if rewrite:
            tide.compile.disable()


def train(rank: int, world_size: int, backend: str, rewrite: bool) -> dict:
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh

    import tide.compile
    from tide.compile import exposure

    torch._dynamo.reset()
    counters.clear()
    tide.compile.reset_report()
    mesh = init_device_mesh("cpu", (world_size,))
    model = simple_fsdp.build(mesh)
    graphs, reports = [], []
    compiled = torch.compile(lambda tokens, targets: simple_fsdp.loss_fn(model(tokens), targets), fullgraph=True,
                             dynamic=False,
                             backend=_aot_eager(rewrite, graphs, reports) if backend == "aot_eager" else "inductor")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, exposures = [], []
    with _inductor(rewrite, graphs) if backend == "inductor" else contextlib.nullcontext():
        for step in range(STEPS):
            def forward_backward():
                loss = compiled(*simple_fsdp.batch(step, rank))
                loss.backward()
                return loss

            if backend == "inductor" and step == 0:  # the code Inductor generates: what each graph exposes
                loss, codes = run_and_get_code(forward_backward)
                exposures = [exposure.summary(exposure.of_code(code)) for code in codes]
            else:
                loss = forward_backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    params = [p.detach().full_tensor().numpy() for p in model.parameters()]
    cache = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    return {"losses": losses, "params": params, "graphs": graphs, "plans": [r.plan for r in reports],
            "report": tide.compile.report(), "stats": tide.stats()["ops"], "fx_graph_cache": cache,
            "exposures": exposures}


def compare(rank: int, world_size: int, backend: str = "aot_eager", cache_dir: str = "") -> dict:
    """Stock, then TIDE. Inductor's caches go to ``cache_dir``/rank<r>: with uneven shards the ranks' graphs
    differ while Dynamo's (of the global DTensor shapes) do not, and a shared cache mixes them up."""
    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    return {"stock": train(rank, world_size, backend, False), "tide": train(rank, world_size, backend, True)}


def divergent_plan(rank: int, world_size: int) -> str:
    """Rank 1 plans one bucket per collective (the others one per module): every rank must raise."""
    from tide.compile import plan

    if rank == 1:
        original = plan.buckets
        plan.buckets = lambda matches, position: [b for m in matches for b in original([m], position)]
    try:
        train(rank, world_size, "aot_eager", True)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _classified(name: str, param, placements, grad_placements, rewrite: bool) -> tuple[list, torch.Tensor]:
    """What the matchers say of one parameter read ``param.redistribute(placements)`` compiled with aot_eager
    (forward and backward), and the parameter's local gradient (with the rewrite applied: ``rewrite``)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    import tide.compile
    from tide.compile import patterns

    found = []

    def compiler(gm, example_inputs):
        found.extend((f.kind, getattr(f, "reason", "tide"), getattr(f, "scale", None))
                     for f in map(patterns.classify, gm.graph.nodes) if f is not None)
        if rewrite:
            tide.compile.rewrite(gm)
        return make_boxed_func(gm)

    torch._dynamo.reset()
    param.grad = None

    def read(x):
        return (param.redistribute(placements=placements).to_local(grad_placements=grad_placements) * x).sum()

    torch.compile(read, backend=aot_autograd(fw_compiler=compiler, bw_compiler=compiler), fullgraph=True,
                  dynamic=False)(torch.arange(4.0)[:, None] if name == "avg" else torch.ones(())).backward()
    return found, param.grad.to_local().clone()


def lowerings(rank: int, world_size: int) -> dict:
    """DTensor's real lowerings: an uneven ``Shard(0)`` parameter with an ``avg`` gradient (rewritten: its
    gradient must equal stock's), a ``Shard(1)`` parameter, and HSDP's replicate-dim all-reduce."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    import tide.compile

    mesh = init_device_mesh("cpu", (world_size,))
    hsdp = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    cases = {
        "avg": (distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]), [Replicate()], [Partial("avg")]),
        "shard1": (distribute_tensor(torch.randn(6, 5), mesh, [Shard(1)]), [Replicate()], [Partial()]),
        "hsdp": (distribute_tensor(torch.randn(5, 4), hsdp, [Replicate(), Shard(0)]), [Replicate(), Replicate()],
                 [Partial(), Partial()]),
    }
    out = {}
    tide.compile.reset_report()
    for name, (tensor, placements, grads) in cases.items():
        param = nn.Parameter(tensor)
        found, stock_grad = _classified(name, param, placements, grads, rewrite=False)
        _, tide_grad = _classified(name, param, placements, grads, rewrite=True)
        out[name] = {"found": found, "grads_equal": torch.equal(stock_grad, tide_grad)}
    return {"cases": out, "report": tide.compile.report()}


def stages(rank: int, world_size: int) -> list[str]:
    """Two pipeline stages of ``world_size // 2`` data-parallel ranks, each stage with its own model: the plans
    differ between stages and are agreed within each stage's group only."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    model = simple_fsdp.simple_fsdp(nn.Linear(8, 5 + 2 * mesh.get_local_rank("pp")), mesh["dp"])
    graphs, reports = [], []
    step = torch.compile(lambda x: model(x).float().square().sum(), backend=_aot_eager(True, graphs, reports),
                         fullgraph=True, dynamic=False)
    step(torch.ones(3, 8, dtype=torch.bfloat16)).backward()
    return [r.plan for r in reports]


def joint(rank: int, world_size: int) -> dict:
    """One training step (forward, loss and backward) traced into one graph by make_fx over the local shards, as
    torchtitan's GraphTrainer traces it, run as traced (stock) and after ``tide.compile.rewrite``."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.fx.experimental.proxy_tensor import make_fx

    import tide.compile

    mesh = init_device_mesh("cpu", (world_size,))
    model = simple_fsdp.build(mesh)
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    slots = [(m, n, index[id(p)]) for m in model.modules() for n, p in m._parameters.items() if p is not None]

    def step(shards, tokens, targets):
        dparams = [DTensor.from_local(s, mesh, [Shard(0)], shape=p.shape, stride=p.stride(), run_check=False)
                   for s, p in zip(shards, params)]
        for module, name, i in slots:
            module._parameters[name] = dparams[i]
        try:  # the checkpointed block reads its parameters again in the backward
            loss = simple_fsdp.loss_fn(model(tokens), targets)
            grads = torch.autograd.grad(loss, dparams)
        finally:
            for module, name, i in slots:
                module._parameters[name] = params[i]
        return [loss] + [g.to_local() for g in grads]

    shards = [p.detach().to_local().requires_grad_() for p in params]
    tokens, targets = simple_fsdp.batch(0, rank)
    stock = make_fx(step, tracing_mode="fake")(shards, tokens, targets)
    rewritten = copy.deepcopy(stock)
    report = tide.compile.rewrite(rewritten)
    outputs = [[t.detach().numpy() for t in gm(shards, tokens, targets)] for gm in (stock, rewritten)]
    return {"stock": outputs[0], "tide": outputs[1], "graph": graph_checks.summarize(rewritten.graph),
            "report": report.as_dict()}


def gathered_buffer_reuse(rank: int, world_size: int) -> list[str]:
    """The lines of Inductor's code for a graph that could take over ``all_gather_start``'s output buffer for a
    later buffer of its size and dtype (the output dead by then) that reuse that buffer."""
    import re

    from torch._inductor.utils import run_and_get_code

    import tide.compile  # noqa: F401  (the op's lowering)

    group = torch.distributed.group.WORLD.group_name

    def fn(x, m, w):
        (out,) = torch.ops.tide.all_gather_start([x + 1], world_size, group)  # an input of its own: aligned
        total = torch.ops._c10d_functional.wait_tensor(out).sum()  # the output's last reader
        return torch.mm(m * total, w).relu().sum(0)  # mm: (W*4, 4), made once the output is dead

    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(fn, fullgraph=True), torch.randn(4, 4), torch.randn(4 * world_size, 5),
                                  torch.randn(5, 4))
    code = "\n".join(codes)
    gathered = {m.group(1) for m in re.finditer(r"(buf\d+) = buf\d+\[0\]", code)}
    return [line.strip() for line in code.splitlines() if "# reuse" in line
            and any(re.search(rf"\b{name}\b", line) for name in gathered)]


def independent_calls(rank: int, world_size: int, pin: bool) -> list[str]:
    """The order in which Inductor's code issues three reduce-scatters that nothing orders (their gradients made
    in FX order a, b, c, b's the largest), with TIDE's ordering dependencies (``pin``) or without."""
    import re

    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    from tide.compile import schedule

    group = torch.distributed.group.WORLD.group_name
    wait, scatter = torch.ops._c10d_functional.wait_tensor, torch.ops.tide.reduce_scatter_start

    def fn(a, b, c):
        shards = [scatter([g @ g], 1.0, None, world_size, group)[0] for g in (a, b, c)]
        return sum(wait(s).sum() for s in shards)

    class Pin(CustomGraphPass):
        def __call__(self, graph) -> None:
            if pin:
                schedule.pin(graph, [])

        def uuid(self) -> None:
            return None

    torch._dynamo.reset()
    with config.patch(post_grad_custom_post_pass=Pin()):
        _, (code,) = run_and_get_code(torch.compile(fn, fullgraph=True), torch.randn(4, 4), torch.randn(64, 64),
                                      torch.randn(8, 8))
    inputs = dict(re.findall(r"extern_kernels\.mm\((\w+), \w+, out=(\w+)\)", code))
    names = {v: k for k, v in inputs.items()}
    return [names[b] for b in re.findall(r"tide\.reduce_scatter_start\.default\(\[(\w+)\]", code)]


def out_of_step_compile(rank: int, world_size: int, fault: str) -> str:
    """``fault``: ``"no_pass"``: rank 1 compiles without TIDE's pass; ``"recompile"``: after a step that every rank
    compiled, rank 0 alone calls with another shape (a recompile of its own). Returns the error, if any."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.distributed.device_mesh import init_device_mesh

    import tide.compile

    torch._dynamo.reset()
    model = simple_fsdp.build(init_device_mesh("cpu", (world_size,)))
    rewrite = not (fault == "no_pass" and rank == 1)

    def compiler(gm, example_inputs):
        if rewrite:
            tide.compile.rewrite(gm)
        return make_boxed_func(gm)

    step = torch.compile(lambda tokens, targets: simple_fsdp.loss_fn(model(tokens), targets), dynamic=False,
                         backend=aot_autograd(fw_compiler=compiler, bw_compiler=compiler))
    try:
        step(*simple_fsdp.batch(0, rank)).backward()
        if fault == "recompile":
            step(*simple_fsdp.batch(1, rank, batch_size=3 if rank == 0 else 2)).backward()
    except Exception as e:  # noqa: BLE001  (what each rank saw is the result)
        return f"{type(e).__name__}: {e}"
    return "no error"
