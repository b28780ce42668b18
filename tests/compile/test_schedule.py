"""Where the rewrite places TIDE's calls and waits (tide/compile/schedule.py), on make_fx graphs in one process:
all-gathers one block ahead (``TIDE_COMPILE_PREFETCH``), waits before the first read, reduce-scatters waited
before the next one; the exposure measure of tide/compile/exposure.py on the result; and the dependencies
that pin the order for Inductor."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tests.compile.test_patterns import BF16, _gather, _scatter
from tide.compile import exposure, rewriter, schedule

BLOCKS = ("layers.0", "layers.1", "layers.2")


def _blocks_step():
    """Three blocks' forward (each gathers its weight and bias, then a matmul) and backward (each block's
    weight gradient from a matmul, reduce-scattered), in one graph, module names as GraphTrainer gives them."""
    def fn(p0, b0, p1, b1, p2, b2, x):
        acts = [x]
        for p, b in ((p0, b0), (p1, b1), (p2, b2)):
            acts.append(torch.relu(acts[-1] @ _gather(p).t() + _gather(b)))
        grads = []
        for a_in, a_out in reversed(list(zip(acts, acts[1:]))):
            weight_grad = a_out.t() @ a_in
            grads.append(_scatter(weight_grad))  # read by the graph's output only
        return acts[-1], grads

    shapes = [(4, 8), (4,)] * 3
    gm = make_fx(fn, tracing_mode="fake")(*[torch.zeros(s) for s in shapes], torch.zeros(5, 8, dtype=BF16))
    collectives = [n for n in gm.graph.nodes if schedule.is_collective(n)]
    gathers, scatters = collectives[:6], collectives[6:]
    for node, block in zip(gathers + scatters, [b for b in BLOCKS for _ in (0, 1)] + list(reversed(BLOCKS))):
        node.meta["custom"] = {"module_fqn": f"{block}.linear"}
    return gm


def _rewritten(monkeypatch, depth):
    monkeypatch.setenv("TIDE_COMPILE_PREFETCH", str(depth))
    gm = _blocks_step()
    report = rewriter.rewrite(gm, agree=False)
    assert report.depth == depth and report.as_dict() == {"all_gather": {"buckets": 3, "tide": 6},
                                                         "reduce_scatter": {"buckets": 3, "tide": 3}}
    return gm


def _starts_and_first_waits(gm, op):
    nodes = list(gm.graph.nodes)
    starts = [n for n in nodes if n.target is op]
    waits = [min((nodes.index(w) for item in s.users for w in item.users)) for s in starts]
    return [nodes.index(s) for s in starts], waits


def test_all_gathers_are_issued_one_block_ahead(monkeypatch):
    gm = _rewritten(monkeypatch, 1)
    starts, waits = _starts_and_first_waits(gm, torch.ops.tide.all_gather_start.default)
    assert starts[1] < waits[0] and starts[2] < waits[1] and starts[2] > waits[0], (starts, waits)
    summary = exposure.summary(exposure.of_graph(gm.graph))
    assert summary["tide:all_gather"] == {"calls": 3, "exposed": 1, "exposed_unread": 0}, summary


def test_depth_zero_issues_each_gather_at_its_own_use(monkeypatch):
    """The exposure check of the test above fails when the placement is turned off."""
    gm = _rewritten(monkeypatch, 0)
    starts, waits = _starts_and_first_waits(gm, torch.ops.tide.all_gather_start.default)
    assert all(s < w for s, w in zip(starts, waits)) and starts[1] > waits[0] and starts[2] > waits[1]
    summary = exposure.summary(exposure.of_graph(gm.graph))
    assert summary["tide:all_gather"]["exposed"] == 3, summary


def test_two_blocks_ahead(monkeypatch):
    gm = _rewritten(monkeypatch, 2)
    starts, waits = _starts_and_first_waits(gm, torch.ops.tide.all_gather_start.default)
    assert starts[2] < waits[0], (starts, waits)


def test_reduce_scatters_wait_before_the_next_one(monkeypatch):
    gm = _rewritten(monkeypatch, 1)
    starts, waits = _starts_and_first_waits(gm, torch.ops.tide.reduce_scatter_start.default)
    assert starts[0] < waits[0] < starts[1] < waits[1] < starts[2] < waits[2], (starts, waits)
    found = [e for e in exposure.of_graph(gm.graph) if e.kind == "reduce_scatter"]
    assert [e.kernels > 0 for e in found] == [True, True, False] and found[2].read_at_once, found


def test_every_gather_wait_stands_right_before_its_first_reader(monkeypatch):
    gm = _rewritten(monkeypatch, 1)
    for wait in (n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.wait_tensor.default
                 and n.args[0].args[0].target is torch.ops.tide.all_gather_start.default):
        following = wait.next
        while schedule.is_view(following) or following.target is torch.ops._c10d_functional.wait_tensor.default:
            following = following.next
        assert any(x is wait or schedule.is_view(x) for x in following.all_input_nodes) \
            or following.op == "output", wait


def test_the_dependencies_pin_the_issue_order_and_the_placement(monkeypatch):
    gm = _rewritten(monkeypatch, 1)
    graph, nodes = gm.graph, list(gm.graph.nodes)
    chain = schedule.issue_order(graph)
    assert len(chain) == 6
    calls = [schedule.Call(None, s, [w for item in s.users for w in item.users]) for s in chain]
    deps = schedule.dependencies(graph, calls)
    for before, after in zip(chain, chain[1:]):
        assert before in deps[after]  # one collective after the other
    for call in calls:
        for wait in call.waits:
            earlier = [n for n in chain if nodes.index(n) < nodes.index(wait)]
            if earlier[-1] is not call.start:  # a call issued after this one: it stays before this wait
                assert earlier[-1] in deps[wait]
    assert all(nodes.index(d) < nodes.index(n) for n, ds in deps.items() for d in ds)  # no cycle


def test_exposure_of_generated_code():
    code = """
    def call(self, args):
        buf1 = torch.ops.tide.all_gather_start.default([buf0], 2, '0')
        buf2 = buf1[0]
        buf4 = torch.ops.tide.all_gather_start.default([buf3], 2, '0')
        buf5 = buf4[0]
        torch.ops._c10d_functional.wait_tensor.default(buf2)
        extern_kernels.mm(arg0_1, buf2, out=buf6)
        torch.ops._c10d_functional.wait_tensor.default(buf5)
        triton_poi_fused_0.run(buf6, buf5, 16, stream=stream0)
        buf7 = torch.ops._c10d_functional.reduce_scatter_tensor.default(buf6, 'sum', 2, '0')
        torch.ops._c10d_functional.wait_tensor.default(buf7)
        cpp_fused_add_1(buf8)
        return (buf7, )
    """
    found = exposure.of_code(code)
    assert [(e.op, e.tide, e.kernels, e.read_at_once) for e in found] == [
        ("all_gather_start", True, 0, True), ("all_gather_start", True, 1, False),
        ("reduce_scatter_tensor", False, 0, False)]
    assert exposure.summary(found) == {"stock:reduce_scatter": {"calls": 1, "exposed": 1, "exposed_unread": 1},
                                       "tide:all_gather": {"calls": 2, "exposed": 1, "exposed_unread": 0}}


@pytest.mark.parametrize("depth", ["-1", "x"])
def test_a_bad_depth_is_refused(monkeypatch, depth):
    monkeypatch.setenv("TIDE_COMPILE_PREFETCH", depth)
    with pytest.raises(ValueError, match="TIDE_COMPILE_PREFETCH must be an integer >= 0"):
        rewriter.rewrite(_blocks_step(), agree=False)


def test_stock_collectives_beside_tide_calls_are_in_the_issue_order_and_pinned(monkeypatch):
    """A Shard(1) parameter's gather (chunked and concatenated after the wait: left to stock) and an HSDP-style
    all-reduce of a gradient between TIDE's calls, with prefetch on: both stay c10d collectives, stand in the
    issue order the ranks agree on, and each is pinned after the collective before it and before the next."""
    monkeypatch.setenv("TIDE_COMPILE_PREFETCH", "1")
    c10d = torch.ops._c10d_functional

    def fn(p0, p1, p2, x):
        y = x @ _gather(p0).t()
        w1 = c10d.wait_tensor(c10d.all_gather_into_tensor(p1.to(BF16), 2, "0"))
        w1 = torch.cat(torch.chunk(w1, 2), dim=1)  # Shard(1): gathered on dim 0, then moved to dim 1
        y = y @ w1
        y = y @ _gather(p2).t()
        grad = y.t() @ y
        reduced = c10d.wait_tensor(c10d.all_reduce(_scatter(grad), "sum", "1"))  # the replicate dim
        return y, reduced

    gm = make_fx(fn, tracing_mode="fake")(torch.zeros(4, 8), torch.zeros(8, 1), torch.zeros(1, 2),
                                          torch.zeros(5, 8, dtype=BF16))
    for node, block in zip([n for n in gm.graph.nodes if schedule.is_collective(n)],
                           ["layers.0", "layers.1", "layers.2", "layers.2", "layers.2"]):
        node.meta["custom"] = {"module_fqn": f"{block}.linear"}
    report = rewriter.rewrite(gm, agree=False)
    assert report.plan.splitlines() == [  # layers.2's gather prefetched past layers.1's stock one
        "all_gather forward layers.0 on 0/2: [(4, 8) bfloat16]",
        "all_gather forward layers.2 on 0/2: [(1, 2) bfloat16]",
        "all_gather stock:shard_dim",
        "reduce_scatter forward layers.2 on 0/2: [(2, 2) bfloat16->float32 x1]",
        "all_reduce stock:all_reduce"], report.plan
    chain = schedule.issue_order(gm.graph)
    deps = schedule.dependencies(gm.graph, [])
    assert all(before in deps[after] for before, after in zip(chain, chain[1:])), (chain, deps)
