"""The bucket plan and the rewrite on make_fx graphs in one process (the rank runs are in test_end_to_end.py):
buckets per module and kind, a plan that reads nothing only short ranks have, and the rewritten graph."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tests.compile import graph_checks
from tests.compile.test_patterns import BF16, _gather, _scatter
from tide.compile import patterns, plan, rewriter

MODULES = ("embed", "layers.0", "layers.0", "layers.1")


def _step(short: bool):
    """A forward and backward of three modules' parameters as one graph, on a short rank (``short``: its
    shards of the 7-row parameters have 3 rows, so they are padded and the gathers sliced) or a full one."""
    def fn(p0, p1, p2, p3, g0, g1, g2, g3):
        pad = 1 if short else 0
        gathered = [_gather(p0), _gather(p1, pad=pad), _gather(p2, pad=pad), _gather(p3)]
        scattered = [_scatter(g) for g in (g3, g2, g1)] + [_scatter(g0, op="avg")]
        return gathered, scattered

    shard_rows = 3 if short else 4
    shapes = [(8, 4), (shard_rows, 4), (shard_rows,), (4, 4)]
    grads = [(16, 4), (7, 4), (7,), (8, 4)]
    args = [torch.zeros(s) for s in shapes] + [torch.zeros(s, dtype=BF16) for s in grads]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    collectives = [n for n in gm.graph.nodes if n.target in (patterns.ALL_GATHER, patterns.REDUCE_SCATTER)]
    gathers = [n for n in collectives if n.target is patterns.ALL_GATHER]
    scatters = [n for n in collectives if n.target is patterns.REDUCE_SCATTER]
    for node, module in zip(gathers + scatters[::-1], MODULES + MODULES):
        node.meta["custom"] = {"module_fqn": module}
    return gm


def _plan(gm):
    """The buckets of ``gm`` and the plan text of its rewrite (``gm`` is rewritten)."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = [f for f in map(patterns.classify, gm.graph.nodes) if f is not None]
    buckets = plan.buckets([f for f in found if isinstance(f, patterns.Match)], position)
    return buckets, rewriter.rewrite(gm, agree=False).plan


def test_one_bucket_per_module_and_kind_in_graph_order():
    buckets, _ = _plan(_step(short=False))
    assert [(b.kind, b.name(), len(b.members)) for b in buckets] == [
        ("all_gather", "embed", 1), ("all_gather", "layers.0", 2), ("all_gather", "layers.1", 1),
        ("reduce_scatter", "layers.1", 1), ("reduce_scatter", "layers.0", 2), ("reduce_scatter", "embed", 1)]
    assert [m.scale for m in buckets[-1].members] == [0.5]


def test_the_plan_is_the_same_on_short_and_full_ranks():
    short, full = _plan(_step(short=True))[1], _plan(_step(short=False))[1]
    assert short == full and plan.digest(short) == plan.digest(full)
    assert "all_gather forward layers.0 on 0/2: [(4, 4) bfloat16, (4,) bfloat16]" in short
    assert "reduce_scatter forward layers.0 on 0/2: [(7,) bfloat16->float32 x1, (7, 4) bfloat16->float32 x1]" in short


def test_without_module_names_a_matmul_ends_a_bucket():
    def fn(p0, p1, p2, x):
        w0, w1 = _gather(p0), _gather(p1)
        y = x @ w0.t() @ w1
        return y @ _gather(p2).t()

    gm = make_fx(fn, tracing_mode="fake")(torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(4, 8),
                                          torch.zeros(3, 8, dtype=BF16))
    buckets, _ = _plan(gm)
    assert [(b.name(), len(b.members)) for b in buckets] == [("-", 2), ("-", 1)]


def test_a_shard_made_after_the_first_gather_starts_a_new_bucket():
    def fn(p):
        first = _gather(p)
        return first, _gather(first[:4] * 2)  # its shard depends on the first gather

    gm = make_fx(fn, tracing_mode="fake")(torch.zeros(4, 8))
    buckets, _ = _plan(gm)
    assert [len(b.members) for b in buckets] == [1, 1]


@pytest.mark.parametrize("short", [True, False])
def test_rewrite_leaves_tide_ops_and_no_glue(short):
    gm = _step(short)
    before = graph_checks.summarize(gm.graph)
    report = rewriter.rewrite(gm, agree=False)
    after = graph_checks.summarize(gm.graph)
    assert before["c10d"] == 8 and before["fp32_casts"] == 4 and before["cats"] == 2, before
    assert report.as_dict() == {"all_gather": {"buckets": 3, "tide": 4}, "reduce_scatter": {"buckets": 3, "tide": 4}}
    assert (after["all_gather_start"], after["reduce_scatter_start"], after["c10d"]) == (3, 3, 0), after
    assert after["fp32_casts"] == after["cats"] == after["splits"] == after["pads_not_for_all_gather"] == 0, after
    assert after["dead"] == 0, after
    waits = [n for n in gm.graph.nodes if n.target is patterns.WAIT]
    assert len(waits) == 8 and all(w.args[0].args[0].target in (torch.ops.tide.all_gather_start.default,
                                                                 torch.ops.tide.reduce_scatter_start.default)
                                   for w in waits)


def test_the_glue_check_catches_a_pad_left_behind(monkeypatch):
    """The end-to-end tests' graph check fails when the rewrite keeps the reduce-scatter's pads and casts."""
    monkeypatch.setattr(rewriter, "_erase_unused", lambda graph, nodes: 0)
    gm = _step(short=True)
    rewriter.rewrite(gm, agree=False)
    summary = {**graph_checks.summarize(gm.graph), "backward": True}
    with pytest.raises(AssertionError):
        graph_checks.assert_rewritten(summary)


def test_all_gather_start_takes_the_shards_where_the_first_gather_was():
    gm = _step(short=True)
    rewriter.rewrite(gm, agree=False)
    nodes = list(gm.graph.nodes)
    starts = [n for n in nodes if n.target is torch.ops.tide.all_gather_start.default]
    layer0 = starts[1]
    assert [a.target for a in layer0.args[0]] == [torch.ops.aten.constant_pad_nd.default] * 2
    first_wait = min(nodes.index(u) for item in layer0.users for u in item.users)
    assert all(nodes.index(a) < nodes.index(layer0) < first_wait for a in layer0.args[0])


def test_stable_topological_sort_moves_only_what_must_move():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    b = graph.call_function(torch.abs, (x,))
    c = graph.call_function(torch.exp, (b,))
    a = graph.call_function(torch.neg, (c,))
    d = graph.call_function(torch.sin, (x,))
    graph.output((a, d))
    b.prepend(a)  # a now stands before its input c
    rewriter.stable_topological_sort(graph)
    graph.lint()
    assert [n.name for n in graph.nodes] == ["x", "abs_1", "exp", "neg", "sin", "output"]


def test_a_collective_waited_on_twice_is_served_once():
    """Inductor 2.15 merges identical gathers (a tied weight read by two modules) into one collective that
    keeps both waits: the rewrite serves it, and both readers get its output."""
    def fn(p):
        x = p.to(BF16)
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(x, 2, "0")
        return torch.ops._c10d_functional.wait_tensor(gathered) * 2, \
            torch.ops._c10d_functional.wait_tensor(gathered) + 1

    gm = make_fx(fn, tracing_mode="fake")(torch.zeros(4, 8))
    (waits,) = [list(n.users) for n in gm.graph.nodes if n.target is patterns.ALL_GATHER]
    assert len(waits) == 2  # traced as Inductor 2.15 leaves it
    report = rewriter.rewrite(gm, agree=False)
    assert report.counts == {"all_gather": {"buckets": 1, "tide": 1}}, report.counts
    nodes = list(gm.graph.nodes)
    assert not any(n.target is patterns.ALL_GATHER for n in nodes)
    (wait,) = [n for n in nodes if n.target is patterns.WAIT]
    assert {u.target for u in wait.users} == {torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor}
