"""torchtitan 0.3's graph trainer (SimpleFSDP traced into one make_fx graph per step) on its llama3 debug
model, 2 CPU gloo ranks: the ``tide`` pass pipeline (``--module tide.torchtitan ... --compile.pass_pipeline
tide``) against the graph trainer's default pipeline (``--module graph_trainer.llama3``). Losses and gradient
norms must be bit-exact (2 ranks: TIDE's rank-order fp32 sum and gloo's sum of two values round alike; the
default pipeline's bucketing only concatenates), every FSDP collective of the traced graph must be TIDE's,
and the default pipeline's graph must still hold c10d ones. The harness's CPU shims (titan_harness.py) and
no cudagraph pass, for both. Skipped without torchtitan's graph trainer (torchtitan 0.3, torch 2.14+).
"""
from collections import Counter

import pytest
import torch

if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 14):
    pytest.skip("torchtitan 0.3's graph trainer needs torch 2.14+", allow_module_level=True)
pytest.importorskip("tokenizers")
pytest.importorskip("torchtitan.experiments.graph_trainer.registry")

from tests.integrations import titan_harness as harness  # noqa: E402
from tide.launch import run_ranks  # noqa: E402

STEPS = 3
CONFIG = "graph_trainer_llama3_debugmodel"
KINDS = ("all_gather", "reduce_scatter")


def _graph_facts(trainer) -> dict:
    """What the traced step's graph holds after the pipeline's passes, what each collective of it exposes (the
    graph runs in node order outside its Inductor regions), and ``tide.compile.report()``."""
    import tide.compile
    import tide.torchtitan
    from tide.compile import exposure

    # Every collective op by name ("_c10d_functional::all_gather_into_tensor_out", "tide::all_gather_start", ...).
    nodes = Counter(n.target.name() for n in trainer._traced_step.gm.graph.nodes
                    if isinstance(n.target, torch._ops.OpOverload)
                    and n.target.namespace in ("_c10d_functional", "tide")
                    and n.target is not torch.ops._c10d_functional.wait_tensor.default)
    config = getattr(tide.torchtitan, f"graph_trainer.llama3.{CONFIG}")()
    return {"nodes": dict(nodes), "report": tide.compile.report(), "pipeline": trainer.config.compile.pass_pipeline,
            "exposure": exposure.summary(exposure.of_graph(trainer._traced_step.gm.graph)),
            "config_pipeline": config.compile.pass_pipeline, "layers": len(trainer.config.model_spec.model.layers)}


def rank_main(rank: int, world_size: int, argv: list[str]) -> dict:
    import tide.compile

    torch.set_num_threads(1)  # a core per rank
    harness.cpu_shims()
    tide.compile.reset_report()
    return harness.train(argv, inspect=_graph_facts)


def train(root, tide: bool) -> list:
    name = "tide" if tide else "default"
    module = ["--module", "tide.torchtitan", "--config", f"graph_trainer.llama3.{CONFIG}",
              "--compile.pass_pipeline", "tide"] if tide else ["--module", "graph_trainer.llama3", "--config", CONFIG]
    argv = [*module, f"--hf_assets_path={root / 'tokenizer'}", f"--dataloader.dataset_path={root / 'data'}",
            f"--dump_folder={root / name}", "--training.seq_len=64", "--training.local_batch_size=2",
            f"--training.steps={STEPS}", "--training.mixed_precision_param=float32",
            "--parallelism.data_parallel_shard_degree=2", "--metrics.log_freq=1", "--debug.seed=0",
            "--lr_scheduler.warmup_steps=1", "--compile.disable_passes=cudagraph_pass"]
    return run_ranks(rank_main, 2, argv, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("graph_trainer")
    harness.make_assets(str(root))
    return {"default": train(root, False), "tide": train(root, True)}


def test_losses_bit_exact(runs):
    for rank, (default, tide) in enumerate(zip(runs["default"], runs["tide"])):
        assert [m[0] for m in default["metrics"]] == list(range(1, STEPS + 1)), default["metrics"]
        # (step, global mean loss, max local loss, gradient norm), as floats: equal, not close.
        assert tide["metrics"] == default["metrics"], f"rank {rank}"
        assert default["metrics"][-1][1] < default["metrics"][0][1]  # it trains


def test_every_fsdp_collective_on_tide(runs):
    for rank, (default, tide) in enumerate(zip(runs["default"], runs["tide"])):
        facts, control = tide["inspect"], default["inspect"]
        assert facts["pipeline"] == "tide" and control["pipeline"] == "default"
        # One bucket per block and phase (the forward's gathers, each block's again in the backward, resharded after
        # forward, and the gradients), one for the embeddings, one for the final norm and the head.
        layers = facts["layers"]
        buckets = {"all_gather": 2 * layers + 2, "reduce_scatter": layers + 2}
        for kind in KINDS:
            counts = facts["report"][kind]
            assert counts["buckets"] == buckets[kind] and counts["tide"] > counts["buckets"], (rank, facts["report"])
            assert not [k for k in counts if k.startswith("stock:")], (rank, facts["report"])
            assert facts["nodes"].get(f"tide::{kind}_start", 0) == counts["buckets"], (rank, facts)
        # No c10d collective left, and the control: the default pipeline's are c10d (bucketed) all-gathers and
        # reduce-scatters.
        assert set(facts["nodes"]) == {f"tide::{kind}_start" for kind in KINDS}, (rank, facts)
        assert {name.split("::")[0] for name in control["nodes"]} == {"_c10d_functional"}, (rank, control)
        for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            assert any(name.startswith(f"_c10d_functional::{op}") for name in control["nodes"]), (rank, control)
        assert control["report"]["graphs"] == 0, control["report"]


def test_tide_exposes_no_more_transfers_than_the_default_pipeline(runs):
    """Per collective, the compute between its call and its first wait in the traced graph (node order): with its
    calls placed a block ahead, the ``tide`` pipeline exposes no more all-gathers or reduce-scatters than the
    default pipeline, which buckets and reorders for prefetch (its ManualOverlapScheduler)."""
    for default, tide in zip(runs["default"], runs["tide"]):
        for kind in KINDS:
            ours, theirs = tide["inspect"]["exposure"][f"tide:{kind}"], default["inspect"]["exposure"][f"stock:{kind}"]
            assert ours["exposed"] <= theirs["exposed"], (kind, ours, theirs)
            assert ours["exposed_unread"] == 0, (kind, ours)
        assert tide["inspect"]["exposure"]["tide:all_gather"]["exposed"] == 1, tide["inspect"]["exposure"]


def test_config_lookup_selects_the_tide_pipeline(runs):
    """``--module tide.torchtitan --config graph_trainer.llama3.NAME`` alone already selects the pipeline."""
    assert runs["tide"][0]["inspect"]["config_pipeline"] == "tide"


@pytest.mark.parametrize("flag", ["enable_fsdp_ag_rs_overlap", "enable_fsdp_dense_region_overlap"])
def test_fsdp_scheduling_flags_are_refused(flag):
    """They schedule the bucketing pass's collectives, which the tide pipeline replaces."""
    import tide.torchtitan
    from tide import torchtitan_graph

    config = getattr(tide.torchtitan, f"graph_trainer.llama3.{CONFIG}")()
    setattr(config.compile, flag, True)
    with pytest.raises(ValueError, match=f"--compile.{flag}"):
        torchtitan_graph.tide_passes(None, config)
