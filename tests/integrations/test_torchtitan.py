"""torchtitan's llama3 debug model trained through ``tide.torchtitan`` on 2 CPU gloo ranks, against the
same command line without it (torchtitan 0.2.x: ``--experimental.custom_import`` and ``tide_llama3``;
0.3.x: ``--module tide.torchtitan``, picked by the installed version). Losses and gradient norms must be
bit-exact (2 ranks: TIDE's rank-order fp32 sum and gloo's sum of two values round alike), every
all-gather and reduce-scatter of the TIDE run must take TIDE's path, and none of the stock run's.
Skipped when torchtitan is not installed; a torchtitan that is installed but does not import fails.
"""
from importlib import metadata

import pytest

try:
    metadata.version("torchtitan")
except metadata.PackageNotFoundError:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
pytest.importorskip("tokenizers")

from tests.integrations import titan_harness as harness  # noqa: E402
from tide.launch import run_ranks  # noqa: E402

STEPS = 3
VERSION = harness.torchtitan_minor()
KINDS = ("all_gather", "reduce_scatter")


def train(root, name: str, tide: bool, **kwargs) -> list:
    tok_dir, data_dir = root / "tokenizer", root / "data"
    argv = harness.cli_args(VERSION, tide, str(tok_dir), str(data_dir), str(root / name), STEPS, **kwargs)
    return run_ranks(harness.rank_main, 2, argv, tide, timeout=300)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan")
    harness.make_assets(str(root))
    return root


@pytest.fixture(scope="module")
def runs(root):
    return {"stock": train(root, "stock", False), "tide": train(root, "tide", True)}


def test_losses_bit_exact(runs):
    for rank, (stock, tide) in enumerate(zip(runs["stock"], runs["tide"])):
        assert [m[0] for m in stock["metrics"]] == list(range(1, STEPS + 1)), stock["metrics"]
        # (step, global mean loss, max local loss, gradient norm), as floats: equal, not close.
        assert tide["metrics"] == stock["metrics"], f"rank {rank}"
        assert stock["metrics"][-1][1] < stock["metrics"][0][1]  # it trains


def test_every_collective_on_tide(runs):
    for rank, (stock, tide) in enumerate(zip(runs["stock"], runs["tide"])):
        for kind in KINDS:
            assert set(tide["fsdp"][kind]) == {"tide"}, (rank, tide["fsdp"])
            assert tide["fsdp"][kind]["tide"] >= STEPS, (rank, tide["fsdp"])
            assert "tide" not in stock["fsdp"][kind], (rank, stock["fsdp"])  # the control: no TIDE without it


def test_integration_probe(runs):
    probe = runs["tide"][0]["probe"]
    assert "TIDE_RS_MODE" in probe["TIDE_RS_MODE"] and "'bogus'" in probe["TIDE_RS_MODE"]
    assert "TIDE_FSDP_TRANSPORT" in probe["TIDE_FSDP_TRANSPORT"]
    assert probe["no_fsdp"]["same_model"]
    assert any("without FSDP2 module" in m for m in probe["no_fsdp"]["log"]), probe["no_fsdp"]
    if VERSION < (0, 3):
        assert probe["specs"] == dict.fromkeys(probe["specs"], True)
    else:
        assert probe["configs"] == dict.fromkeys(probe["configs"], True)
        assert probe["unknown_config"] is None


@pytest.mark.skipif(VERSION < (0, 3), reason="torchtitan 0.3's spmd_types backend")
def test_spmd_types_backend_takes_tide(root, runs):
    """0.3's default backend: FSDP2 keeps the parameters as DTensors on the SPMD mesh, all of whose axes
    are data parallel here, which TIDE serves."""
    spmd = train(root, "spmd_types", True, spmd_backend="spmd_types")
    for rank, (stock, tide) in enumerate(zip(runs["stock"], spmd)):
        assert tide["metrics"] == stock["metrics"], f"rank {rank}"  # data parallel only: the backends train alike
        for kind in KINDS:
            assert set(tide["fsdp"][kind]) == {"tide"}, (rank, tide["fsdp"])
