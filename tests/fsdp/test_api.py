"""tide.fsdp API: argument errors, torch releases and signatures, enable/disable on a live FSDP2 model."""
import pytest
import torch

import tide.fsdp
from tests.fsdp import workers
from tide.fsdp import compat, fallbacks
from tide.launch import run_ranks


def test_bad_rs_mode():
    with pytest.raises(ValueError, match=r"tide.fsdp.enable: rs_mode must be one of .*'bogus'"):
        tide.fsdp.enable(torch.nn.Linear(2, 2), rs_mode="bogus")


@pytest.mark.parametrize("fn", [tide.fsdp.enable, tide.fsdp.disable])
def test_not_a_module(fn):
    with pytest.raises(TypeError, match=rf"tide.fsdp.{fn.__name__}: module must be a torch.nn.Module .* got str"):
        fn("notamodule")


def test_no_fsdp_module():
    with pytest.raises(ValueError, match="tide.fsdp.enable: module \\(Linear\\) contains no FSDP2 module"):
        tide.fsdp.enable(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("version, tested", [
    ("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0+cpu", True), ("2.14.1+cu130", True), ("2.15.0", True),
    ("2.10.0", False), ("2.16.0.dev20261126", False), ("3.0.0", False),
])
def test_tested_range(version, tested):
    assert compat.is_tested(version) is tested


def test_pyproject_never_caps_torch():
    import re
    from pathlib import Path

    from packaging.specifiers import SpecifierSet

    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    spec = SpecifierSet(re.search(r'dependencies = \["torch([^"]*)"\]', text).group(1))
    assert all(v in spec for v in ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0", "2.16.0", "3.0.0")), spec
    assert "2.10.0" not in spec


def test_reduce_arity_matches_this_torch():
    assert compat.REDUCE_ARITY == (6 if compat.torch_version() < (2, 13) else 7)


def test_stats_shape():
    tide.reset_stats()
    assert tide.stats() == {"fsdp": {"all_gather": {}, "reduce_scatter": {}}, "wiring": {}, "ops": {}, "multinode": {},
                            "arenas": {}}


def test_enable_twice_then_disable():
    for r in run_ranks(workers.enable_disable, 2, timeout=120):
        assert r["groups"] == 3
        assert set(r["first"]["all_gather"]) == {"tide"}
        assert r["once"]
        assert set(r["slot_reuse"]["reduce_scatter"]) == {"tide"}
        assert r["restored"]
        assert set(r["after_disable"]["all_gather"]) == {"stock:not_enabled"}
        assert set(r["after_disable"]["reduce_scatter"]) == {"stock:not_enabled"}


@pytest.mark.parametrize("hosts,nodes,serve,reason", [
    (["a", "a"], None, False, None), (["a"] * 8, None, False, None), (["a"] * 9, None, False, "nvlink_domain"),
    (["a", "a", "b", "b"], None, False, "nvlink_domain"),  # one node may not span hosts
    (["a"] * 4, (2, 2), False, "nvlink_domain"),  # several nodes, not opted in on CUDA
    (["a"] * 4, (2, 2), True, None),  # emulated nodes on one host
    (["a", "a", "b", "b"], (2, 2), True, None),  # real nodes, one host each
    (["a", "b", "a", "b"], (2, 2), True, "nvlink_domain"),  # a node spanning hosts
    (["a"] * 18, (2, 9), True, "nvlink_domain"),  # a node larger than one NVLink domain
    (["a"] * 4, (1, 4), True, None),  # one node of four
])
def test_nvlink_domain_contract(hosts, nodes, serve, reason):
    from tide.meta.multinode import Topology

    topo = Topology(*nodes) if nodes else None
    assert fallbacks.contract_reason(9, hosts, topo, serve) == reason


def test_install_twice_keeps_a_later_patcher_chained_without_a_cycle():
    """A patcher installed after TIDE wraps TIDE's wrapper; installing again must not take that patcher
    as TIDE's stock path (the two would call each other forever)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    from tide import registry
    from tide.fsdp import seam

    seam.install()
    tide_wrapper, stock = pg.foreach_all_gather, registry.stock_functions["foreach_all_gather"]

    def later_patcher(*args, **kwargs):
        return tide_wrapper(*args, **kwargs)

    pg.foreach_all_gather = later_patcher
    try:
        seam.install()
        assert pg.foreach_all_gather is later_patcher
        assert registry.stock_functions["foreach_all_gather"] is stock
    finally:
        pg.foreach_all_gather = tide_wrapper


def test_fallback_table_lists_every_reason():
    """docs/fsdp.md's fallback table and the seam's reasons are the same set."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "fsdp.md").read_text()
    table = doc[doc.index("## Fallbacks"):]
    table = table[:table.index("\n\n", table.index("| reason"))]
    documented = set(re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.M))
    assert documented == set(fallbacks.REASONS)


def _facts(rank, world_size, flags):
    import os

    import torch.distributed as dist

    os.environ["TIDE_CUDA_MULTINODE"] = flags[rank]
    try:
        return fallbacks.group_facts(dist.group.WORLD)
    except (RuntimeError, ValueError) as e:
        return str(e)


def test_group_facts_come_from_every_rank():
    import socket

    assert run_ranks(_facts, 3, ["", "", ""]) == [([socket.gethostname()] * 3, False)] * 3
    assert run_ranks(_facts, 3, ["1", "1", "1"]) == [([socket.gethostname()] * 3, True)] * 3


def test_ranks_that_disagree_on_tide_cuda_multinode_all_raise():
    for answer in run_ranks(_facts, 3, ["1", "", "1"]):
        assert "disagree on TIDE_CUDA_MULTINODE (set on group ranks [0, 2])" in answer, answer


def test_an_invalid_tide_cuda_multinode_raises_on_every_rank():
    own, peers = "tide: TIDE_CUDA_MULTINODE must be 0 or 1, got 'yes'", "group ranks [1] of group"
    answers = run_ranks(_facts, 3, ["1", "yes", "1"])
    assert own in answers[1] and all(peers in a for a in answers[::2]), answers


def test_import_tide_exposes_fsdp_and_ops():
    import subprocess
    import sys

    code = ("import sys, tide; assert 'tide.fsdp' not in sys.modules; "
            "assert hasattr(tide.ops, 'schemas') and tide.fsdp.enable; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_seam_has_a_wrapper_for_this_torch():
    from tide.fsdp import seam

    wrappers, differed = compat.choose_wrappers(seam.SHAPES)
    assert differed is None
    per_param = compat.torch_version() >= (2, 15)
    assert (wrappers["foreach_reduce"] is seam.foreach_reduce_per_param_dtype) is per_param
    assert (wrappers["foreach_all_gather_copy_out"] is seam.foreach_all_gather_copy_out_with_output_fn) is per_param


def test_an_unknown_fsdp2_signature_is_named(monkeypatch):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from tide.fsdp import seam

    def foreach_all_gather_copy_out(fsdp_params, all_gather_result, group, *, layout=None):  # reordered upstream
        raise AssertionError("not called")

    monkeypatch.setattr(_fsdp_collectives, "foreach_all_gather_copy_out", foreach_all_gather_copy_out)
    wrappers, differed = compat.choose_wrappers(seam.SHAPES)
    assert wrappers is None
    assert differed == "foreach_all_gather_copy_out(fsdp_params, all_gather_result, group, *, layout)"


def test_an_untested_torch_trains_on_stock_with_the_reason():
    for r in run_ranks(workers.untested_signature, 2, timeout=180):
        reason = "stock:untested_torch:foreach_reduce(" + r["expected_params"] + ")"
        # 3 steps: 3 groups gather in forward, 2 blocks again in backward; 3 reduce.
        assert r["stats"]["all_gather"] == {reason: 5 * 3} and r["stats"]["reduce_scatter"] == {reason: 3 * 3}, r
        assert r["losses"] == r["stock_losses"]


def test_a_newer_torch_with_matching_signatures_warns_once_and_runs_tide():
    for r in run_ranks(workers.newer_torch, 2, timeout=180):
        assert r["warnings"] == ["tide.fsdp.enable: torch 2.99.0 is outside the releases TIDE's FSDP2 seam is tested "
                                 "on (2.11 to 2.15); its FSDP2 signatures match, so TIDE runs"], r["warnings"]
        assert set(r["stats"]["all_gather"]) == {"tide"} and set(r["stats"]["reduce_scatter"]) == {"tide"}, r


def test_the_leased_region_is_released_after_the_root_forward_and_each_backward():
    for r in run_ranks(workers.release_points, 2, timeout=120):
        assert r == {"forward0": 1, "backward0": 1, "forward1": 1, "backward1": 1, "outside_backward": 0}, r
