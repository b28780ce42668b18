"""The matchers on small make_fx graphs of DTensor's lowerings (written out with c10d's functional ops, traced with
fake tensors: no process group needed): what matches, its rank-invariant facts, and each stock reason."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tide  # noqa: F401  (registers torch.ops.tide)
from tide.compile import patterns

c10d = torch.ops._c10d_functional
BF16, FP32 = torch.bfloat16, torch.float32


def _trace(fn, *shapes_dtypes, mode="fake"):
    return make_fx(fn, tracing_mode=mode)(*(torch.zeros(s, dtype=d) for s, d in shapes_dtypes)).graph


def _found(graph):
    return [f for f in map(patterns.classify, graph.nodes) if f is not None]


def _gather(x, world_size=2, cast=BF16, pad=0):
    if cast is not None:
        x = x.to(cast)
    if pad:
        x = torch.constant_pad_nd(x, [0, 0] * (x.dim() - 1) + [0, pad])
    out = c10d.wait_tensor(c10d.all_gather_into_tensor(x, world_size, "0"))
    return out[:out.shape[0] - pad] if pad else out


def _scatter(grad, world_size=2, op="sum", cast=FP32):
    x = grad.to(cast) if cast is not None else grad
    rows = -(-x.shape[0] // world_size)
    if x.shape[0] % world_size:  # DTensor pads the short chunk, and adds zero-padded empty ones when too few
        pad = lambda t: torch.constant_pad_nd(t, [0, 0] * (x.dim() - 1) + [0, rows - t.shape[0]])  # noqa: E731
        pieces = list(torch.split(x, rows))
        pieces[-1] = pad(pieces[-1]) if pieces[-1].shape[0] < rows else pieces[-1]
        pieces += [pad(x.new_zeros((0, *x.shape[1:]))) for _ in range(world_size - len(pieces))]
        x = torch.cat(pieces)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, op, world_size, "0"))


@pytest.mark.parametrize("pad", [0, 1])
def test_all_gather_with_cast_and_pad_on_short_ranks(pad):
    graph = _trace(lambda p: _gather(p, pad=pad) * 2, ((4 - pad, 8), FP32))
    (m,) = _found(graph)
    assert isinstance(m, patterns.Match) and m.kind == "all_gather"
    assert m.facts == ((4, 8), BF16) and (m.world_size, m.group_name) == (2, "0")
    assert m.source.op == "placeholder" and m.input is m.collective.args[0]
    aten = torch.ops.aten
    assert [n.target for n in m.glue] == [aten._to_copy.default] + [aten.constant_pad_nd.default] * pad


def test_all_gather_without_cast_and_with_prims_convert_element_type():
    (m,) = _found(_trace(lambda p: _gather(p, cast=None), ((4, 8), FP32)))
    assert m.facts == ((4, 8), FP32) and m.glue == [] and m.source is m.input
    convert = lambda p: _gather(torch.ops.prims.convert_element_type(p, BF16), cast=None)  # noqa: E731
    (m,) = _found(_trace(convert, ((4, 8), FP32)))
    assert m.source.op == "placeholder" and m.facts == ((4, 8), BF16)


def test_reduce_scatter_uneven_avg_takes_the_original_grad():
    (m,) = _found(_trace(lambda g: _scatter(g, op="avg")[:3], ((7, 8), BF16)))
    assert isinstance(m, patterns.Match) and m.kind == "reduce_scatter"
    assert m.input.op == "placeholder" and m.facts == ((7, 8), BF16, FP32) and m.scale == 0.5
    targets = sorted(str(n.target) for n in m.glue)
    assert targets == sorted(["aten._to_copy.default", "aten.split.Tensor", "<built-in function getitem>",
                              "<built-in function getitem>", "aten.constant_pad_nd.default", "aten.cat.default"])


@pytest.mark.parametrize("world_size,rows", [(2, 8), (3, 7), (3, 9), (3, 4), (4, 5), (2, 1)])
def test_reduce_scatter_shapes(world_size, rows):
    (m,) = _found(_trace(lambda g: _scatter(g, world_size), ((rows, 4), BF16)))
    assert m.facts == ((rows, 4), BF16, FP32) and m.input.op == "placeholder"


def test_reduce_scatter_without_cast():
    (m,) = _found(_trace(lambda g: _scatter(g, cast=None), ((8, 4), FP32)))
    assert m.input.op == "placeholder" and m.glue == [] and m.facts == ((8, 4), FP32, FP32)


def _shard1_gather(x):  # DTensor's Shard(1) -> Replicate: gather dim 0, then chunk and cat on dim 1
    out = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, "0"))
    return torch.cat(torch.chunk(out, 2), dim=1)


def _shard1_scatter(g):  # Partial -> Shard(1): chunk on dim 1, cat on dim 0, reduce-scatter
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.cat(torch.chunk(g, 2, dim=1)), "sum", 2, "0"))


@pytest.mark.parametrize("fn,shape,dtype,kind,reason", [
    (_shard1_gather, (4, 3), BF16, "all_gather", "shard_dim"),
    (_shard1_scatter, (4, 6), FP32, "reduce_scatter", "input_shape"),
    (lambda p: _gather(p, cast=None), (4, 8), torch.int64, "all_gather", "dtype"),
    (lambda p: _gather(p, cast=None), (4, 8), torch.float64, "all_gather", "dtype"),
    (lambda p: _gather(p, world_size=1), (4, 8), FP32, "all_gather", "group_size_1"),
    (lambda g: _scatter(g, op="max"), (8, 4), FP32, "reduce_scatter", "reduce_op"),
    (lambda x: c10d.all_gather_into_tensor(x, 2, "0") + 1, (4, 8), FP32, "all_gather", "collective_users"),
    (lambda x: c10d.wait_tensor(c10d.all_reduce(x, "sum", "1")), (4, 8), FP32, "all_reduce", "all_reduce"),
])
def test_left_to_stock(fn, shape, dtype, kind, reason):
    (s,) = _found(_trace(fn, (shape, dtype)))
    assert isinstance(s, patterns.Stock) and (s.kind, s.reason) == (kind, reason), s


def test_dynamic_shapes_stay_stock():
    found = _found(_trace(lambda p, g: (_gather(p), _scatter(g, cast=None)), ((4, 8), FP32), ((8, 4), FP32),
                          mode="symbolic"))
    assert [(s.kind, s.reason) for s in found] == [("all_gather", "dynamic_shape"), ("reduce_scatter", "dynamic_shape")]


def test_module_names_from_graph_trainer_and_dynamo_metadata():
    graph = _trace(lambda p: _gather(p), ((4, 8), FP32))
    (m,) = _found(graph)
    node = m.collective
    assert patterns.module_of(node) == ""
    # Dynamo's stack, innermost last, named from the compiled frame's root (a lambda's closure, or the module)
    node.meta["nn_module_stack"] = {"a": ("L['model']", object), "b": ("L['model'].layers.0", object),
                                    "c": ("L['model'].layers.0.attn", object)}
    assert patterns.module_of(node) == "layers.0.attn"
    node.meta["nn_module_stack"] = {"a": ("L['self'].model", object), "b": ("L['self'].model.layers[3]", object),
                                    "c": ("L['self'].model.layers[3].mlp", object)}
    assert patterns.module_of(node) == "model.layers.3.mlp"
    node.meta["custom"] = {"module_fqn": "layers.3.attention.wo"}  # GraphTrainer names the leaf module
    assert patterns.module_of(node) == "layers.3.attention.wo"


@pytest.mark.parametrize("source, name", [
    ("L['model'].layers[0].attn", "layers.0.attn"),
    ("L['self'].model.layers._modules['12'].mlp", "model.layers.12.mlp"),
    ("getattr(getattr(L['self'].h, '3'), 'attn')", "h.3.attn"),
    ("G['model'].blocks['0']", "blocks.0"),
    ("L['self']", ""),
    ("self.lm_head", "lm_head"),
])
def test_module_name_reads_dynamo_source_strings(source, name):
    assert patterns.module_name(source) == name


@pytest.mark.parametrize("name, block", [
    ("layers.3.attention.wo", "layers.3"),
    ("model.layers.3.mlp.gate_proj", "model.layers.3"),  # Hugging Face nesting
    ("layers.3", "layers.3"),
    ("model.embed_tokens", ""),
    ("norm", ""),
    ("", ""),
])
def test_a_block_is_a_containers_child_whatever_the_nesting(name, block):
    assert patterns.block_of(name) == block
