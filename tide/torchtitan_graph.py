"""TIDE for torchtitan 0.3's graph trainer (``torchtitan.experiments.graph_trainer``): a pass pipeline named
``tide`` and its post-init hook, registered when ``tide.torchtitan`` is imported (``--module tide.torchtitan``)::

    torchrun --nproc-per-node 8 -m torchtitan.train --module tide.torchtitan \\
        --config graph_trainer.llama3.graph_trainer_llama3_8b --compile.pass_pipeline tide

The pipeline is the graph trainer's default one (``construct_default_graph_passes``) with
``tide.compile.rewrite`` on the traced joint forward-backward graph in place of its FSDP bucketing and
reordering pass (``joint_transformer_block_bucketing_reordering_pass``): SimpleFSDP's per-parameter
all-gathers and reduce-scatters become TIDE's graph ops, one per transformer block (or other module below
the root) and direction (docs/compile.md). Every other pass stays. The hook runs when the trainer is built,
before the first step traces: ``tide.compile.prepare`` on each model part creates TIDE's arenas for its
data-parallel groups (none on CPU), gathering in ``--training.mixed_precision_param``. A pre-train-step hook
gives the arenas' leased regions back before each step (``tide.compile.release``), so that the activations'
peak never holds them and a step captured into a CUDA graph leases its own.
"""
from __future__ import annotations

import functools

import tide.compile

__all__ = ["PIPELINE", "BUCKETING_PASS", "is_graph_trainer_config", "rewrite_pass", "tide_passes", "prepare_models",
           "release_regions", "register"]

PIPELINE = "tide"
BUCKETING_PASS = "joint_transformer_block_bucketing_reordering_pass"
# Flags that schedule the bucketing pass's collectives, which the tide pipeline does not emit.
_FSDP_SCHEDULING_FLAGS = ("enable_fsdp_ag_rs_overlap", "enable_fsdp_dense_region_overlap")


def is_graph_trainer_config(config) -> bool:
    """Whether a 0.3 ``Trainer.Config`` is the graph trainer's (it selects a pass pipeline)."""
    return hasattr(getattr(config, "compile", None), "pass_pipeline")


def rewrite_pass(gm, example_inputs):
    """A graph-trainer pass: ``tide.compile.rewrite`` on the joint graph, in place."""
    tide.compile.rewrite(gm)
    return gm


def _pass_name(pass_fn) -> str:
    return pass_fn.func.__name__ if isinstance(pass_fn, functools.partial) else pass_fn.__name__


def tide_passes(traced_result, config, *, parallel_dims=None) -> list:
    """The default pipeline with :func:`rewrite_pass` in place of the FSDP bucketing pass (absent, as in the
    default pipeline, when a precompiled artifact already holds the passed graph)."""
    from torchtitan.experiments.graph_trainer.passes import construct_default_graph_passes

    for flag in _FSDP_SCHEDULING_FLAGS:
        if getattr(config.compile, flag, False):
            raise ValueError(f"tide.torchtitan_graph: --compile.{flag} schedules the collectives of "
                             f"{BUCKETING_PASS}, which the '{PIPELINE}' pipeline replaces; leave it off")
    passes = construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims)
    return [rewrite_pass if _pass_name(p) == BUCKETING_PASS else p for p in passes]


def prepare_models(trainer) -> None:
    """The post-init hook: TIDE's arenas for every model part, in the trainer's parameter dtype."""
    from torchtitan.config import TORCH_DTYPE_MAP

    training = getattr(trainer.config, "training", None)
    name = getattr(training, "mixed_precision_param", None)
    param_dtype = TORCH_DTYPE_MAP[name] if name is not None else None
    for model in trainer.model_parts:
        tide.compile.prepare(model, param_dtype=param_dtype)


def release_regions(trainer) -> None:
    """The pre-train-step hook: every rank gives its arenas' regions back at the same point."""
    tide.compile.release()


def register() -> None:
    """Register the ``tide`` pipeline and its hooks with the graph trainer."""
    from torchtitan.experiments.graph_trainer.registry import (register_pass_pipeline, register_post_init_hook,
                                                               register_pre_train_step_hook)

    register_pass_pipeline(PIPELINE)(tide_passes)
    register_post_init_hook(PIPELINE)(prepare_models)
    register_pre_train_step_hook(PIPELINE)(release_regions)
