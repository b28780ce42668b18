"""What a compiled graph holds, counted (the tests assert on these counts): TIDE's ops, c10d FSDP collectives,
and the reduce-scatter glue TIDE removes (fp32 casts, pads not feeding an all-gather, splits, cats, casts or pads
feeding a reduce-scatter (an fp32 cast, a pad, a cat), and the dead nodes glue left behind would be)."""
from __future__ import annotations

import torch
from torch.fx import Graph

from tide.compile.schedule import pinned_inputs, pinned_target

aten, prims, c10d = torch.ops.aten, torch.ops.prims, torch.ops._c10d_functional
CASTS = {aten._to_copy.default, prims.convert_element_type.default}


def _fp32_cast(node) -> bool:
    val = node.meta.get("val")
    return node.target in CASTS and isinstance(val, torch.Tensor) and val.dtype == torch.float32


def summarize(graph: Graph) -> dict:
    """The counts, reading a node pinned in ``control_deps`` (Inductor's graphs) as the op it wraps."""
    calls = [n for n in graph.nodes if n.op == "call_function"]
    count = lambda pred: sum(1 for n in calls if pred(n))  # noqa: E731
    target = {n: pinned_target(n) for n in calls}
    ag_start, rs_start = torch.ops.tide.all_gather_start.default, torch.ops.tide.reduce_scatter_start.default
    glue = lambda n: _fp32_cast(n) or n.target in (aten.constant_pad_nd.default, aten.cat.default)  # noqa: E731
    return {
        "backward": any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes),
        "all_gather_start": count(lambda n: target[n] is ag_start),
        "reduce_scatter_start": count(lambda n: target[n] is rs_start),
        "glue_into_reduce_scatter": sum(1 for n in calls if target[n] is rs_start for g in pinned_inputs(n)
                                        if glue(g)),
        "c10d": count(lambda n: target[n] in (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)),
        "fp32_casts": count(_fp32_cast),
        "pads_not_for_all_gather": count(lambda n: n.target is aten.constant_pad_nd.default
                                         and not any(target.get(u) is ag_start for u in n.users)),
        "splits": count(lambda n: n.target in (aten.split.Tensor, aten.split_with_sizes.default)),
        "cats": count(lambda n: n.target is aten.cat.default),
        "dead": count(lambda n: not n.users and not n.is_impure()),
    }


def assert_rewritten(summary: dict) -> None:
    """TIDE's ops, no c10d FSDP collective, and in a backward graph none of the reduce-scatter's glue."""
    assert summary["c10d"] == 0, summary
    assert summary["all_gather_start"] + summary["reduce_scatter_start"] > 0, summary
    assert summary["dead"] == 0, summary
    if summary["backward"]:
        assert summary["reduce_scatter_start"] > 0 and summary["glue_into_reduce_scatter"] == 0, summary
        assert summary["pads_not_for_all_gather"] == summary["splits"] == summary["cats"] == 0, summary
