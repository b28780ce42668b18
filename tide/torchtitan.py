"""TIDE for torchtitan: ``tide.fsdp.enable`` on the model right after torchtitan's ``parallelize_fn``,
with no change to torchtitan.

torchtitan 0.2.x (``--experimental.custom_import``): importing this module registers a train spec
``tide_<name>`` for every model ``<name>`` of ``torchtitan.models`` whose module imports (llama3,
llama3_ft, llama4, qwen3, gpt_oss, deepseek_v3; flux needs ``transformers``), the same spec with its
``parallelize_fn`` wrapped. Select it with ``--model.name``::

    torchrun --nproc-per-node 8 -m torchtitan.train --experimental.custom_import tide.torchtitan \\
        --model.name tide_llama3 --model.flavor 8B

A train spec of your own (registered by your module under ``NAME``): call ``tide.torchtitan.register(NAME)``
there and select ``tide_NAME``. torchtitan's experiments (``simple_fsdp``, ``autoparallel``, ...) are not
registered: they shard without FSDP2's ``fully_shard``.

torchtitan 0.3.x (``--module/--config``): this module is the config module; ``--config`` names the
upstream config function, which is called and returned with its ``model_spec.parallelize_fn`` wrapped::

    torchrun --nproc-per-node 8 -m torchtitan.train --module tide.torchtitan --config llama3_8b

``--config NAME`` is looked up in the ``config_registry`` of every model of ``torchtitan.models``
(``llama3_8b`` is ``--module llama3 --config llama3_8b`` with TIDE); ``--config MODULE.FUNCTION`` takes
``FUNCTION`` of ``MODULE``, where ``MODULE`` is what upstream's ``--module`` takes (a torchtitan short
name such as ``llama3`` or ``graph_trainer.llama3``, or any importable module, with or without its
``.config_registry``). Every other flag stays as upstream's. Both SPMD backends run on TIDE: under 0.3's
default, ``spmd_types``, FSDP2 keeps every parameter as a DTensor on the SPMD mesh, which TIDE serves
while every axis of that mesh is data parallel (``partial_dtensor`` gives it plain DTensor FSDP2).

0.3's graph trainer (``--config graph_trainer.llama3.graph_trainer_llama3_8b`` and the like: SimpleFSDP, no
FSDP2): this module registers the graph trainer's pass pipeline ``tide`` (``tide.torchtitan_graph``), which
its configs then select (``--compile.pass_pipeline tide``); their ``parallelize_fn`` stays upstream's.

Options, environment variables read at ``parallelize_fn`` time (every rank must set them alike; a bad
value raises ``ValueError`` naming the variable, already when this module is imported):

* ``TIDE_RS_MODE``: ``in_place`` (default) or ``slot_reuse`` (``enable``'s ``rs_mode``);
* ``TIDE_FSDP_TRANSPORT``: ``auto`` (default) or ``reference`` (``enable``'s ``transport``);

Why after ``parallelize_fn``: torchtitan's model converters run before it, when no FSDP2 module exists
yet; ``parallelize_fn`` applies ``fully_shard`` (with pipeline parallelism, once per stage: each stage is
enabled). ``enable`` only swaps the param groups' comms, so the parameters may still be on the meta
device; torchtitan's ``to_empty`` and ``init_weights`` follow. A model that ``parallelize_fn`` left
without FSDP2 module (no data-parallel sharding, for example) is logged and left alone.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging

import torch.nn as nn

import tide.fsdp
from tide import knobs

__all__ = ["PREFIX", "RS_MODE_ENV", "options", "wrap", "register", "with_tide"]

PREFIX = "tide_"
RS_MODE_ENV = "TIDE_RS_MODE"

log = logging.getLogger(__name__)


def options() -> dict:
    """``enable``'s options from the environment: ``rs_mode`` and ``transport``."""
    rs_mode = knobs.get(RS_MODE_ENV)
    return {"rs_mode": rs_mode, "transport": tide.fsdp.default_transport()}


def _enable(model) -> None:
    if not isinstance(model, nn.Module) or not tide.fsdp.param_groups(model):
        log.warning("parallelize_fn left %s without FSDP2 module (data parallel sharding off?); "
                    "TIDE is not enabled on it", type(model).__name__)
        return
    opts = options()
    tide.fsdp.enable(model, **opts)
    groups = tide.fsdp.param_groups(model)
    log.info("TIDE enabled on %d FSDP2 param groups of %s (rs_mode=%s, transport=%s)",
             len(groups), type(model).__name__, opts["rs_mode"], opts["transport"])


def wrap(parallelize_fn):
    """``parallelize_fn`` followed by ``tide.fsdp.enable`` on the model it returns (returned unchanged)."""
    if getattr(parallelize_fn, "__tide__", False):
        return parallelize_fn

    @functools.wraps(parallelize_fn)
    def parallelize_with_tide(model, *args, **kwargs):
        model = parallelize_fn(model, *args, **kwargs)
        _enable(model)
        return model

    parallelize_with_tide.__tide__ = True
    return parallelize_with_tide


# ---------------------------------------------------------------- torchtitan 0.2.x: train specs

def register(name: str) -> str:
    """Register ``tide_<name>``: the 0.2.x train spec ``name`` with its ``parallelize_fn`` wrapped."""
    from torchtitan.protocols import train_spec as specs

    tide_name = PREFIX + name
    if tide_name not in specs._extra_train_specs:
        spec = specs.get_train_spec(name)
        specs.register_train_spec(tide_name, dataclasses.replace(spec, parallelize_fn=wrap(spec.parallelize_fn)))
    return tide_name


def _register_models() -> None:
    try:
        from torchtitan.protocols import train_spec  # noqa: F401  (0.2.x only)
    except ImportError:
        return
    from torchtitan.models import _supported_models

    for name in sorted(_supported_models):
        try:
            register(name)
        except ImportError as e:  # a model whose own dependencies are not installed
            log.info("%s%s not registered (%s: %s)", PREFIX, name, type(e).__name__, e)


# ---------------------------------------------------------------- torchtitan 0.3.x: config functions

def with_tide(config):
    """A 0.3.x ``Trainer.Config`` whose ``model_spec.parallelize_fn`` is wrapped (modified in place); a graph
    trainer's config (SimpleFSDP, no FSDP2) gets the ``tide`` pass pipeline instead."""
    if _graph is not None and _graph.is_graph_trainer_config(config):
        config.compile.pass_pipeline = _graph.PIPELINE
        return config
    spec = getattr(config, "model_spec", None)
    if spec is None:
        raise ValueError(f"tide.torchtitan: the config ({type(config).__name__}) has no model_spec to wrap")
    config.model_spec = dataclasses.replace(spec, parallelize_fn=wrap(spec.parallelize_fn))
    return config


def _registry(module_name: str):
    """The module upstream's ``--module module_name`` would load."""
    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models

    if module_name in _supported_models | _supported_experiments:
        prefixes = ("torchtitan.models.", "torchtitan.experiments.", "torchtitan.experiments.rl.examples.")
        candidates = [f"{p}{module_name}.config_registry" for p in prefixes]
    else:
        candidates = [f"{module_name}.config_registry", module_name]
    for candidate in candidates:
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as e:
            if e.name is None or not (candidate == e.name or candidate.startswith(e.name + ".")):
                raise  # the candidate exists, but a module it imports does not
    raise ValueError(f"tide.torchtitan: no config module {module_name!r} (tried {', '.join(candidates)})")


def _own_function(module, name: str):
    fn = getattr(module, name, None)
    return fn if callable(fn) and getattr(fn, "__module__", None) == module.__name__ else None


def _find_config(name: str):
    """The upstream config function ``name``: ``MODULE.FUNCTION``, or ``FUNCTION`` of a model's registry."""
    if "." in name:
        module_name, fn_name = name.rsplit(".", 1)
        fn = getattr(_registry(module_name), fn_name, None)
        return fn if callable(fn) else None
    from torchtitan.models import _supported_models

    # Models whose name starts the config's name first (llama3_8b: llama3), longest first (qwen3_5 before qwen3).
    models = sorted(_supported_models, key=lambda m: (not name.startswith(m + "_"), -len(m), m))
    for model in models:
        try:
            fn = _own_function(_registry(f"torchtitan.models.{model}"), name)
        except ImportError:  # a model whose own dependencies are not installed
            if name.startswith(model + "_"):
                raise  # most likely the one asked for: say why it cannot be had
            continue
        if fn is not None:
            return fn
    return None


def __getattr__(name: str):
    """``getattr(tide.torchtitan, "llama3_8b")``, as 0.3.x's config manager does for ``--config``."""
    if name.startswith("_"):
        raise AttributeError(name)
    fn = _find_config(name)
    if fn is None:
        raise AttributeError(f"module 'tide.torchtitan' has no attribute {name!r} (no such torchtitan config function)")

    @functools.wraps(fn)
    def config_with_tide():
        return with_tide(fn())

    return config_with_tide


def __dir__() -> list:
    """This module's names and every config function of torchtitan's models (0.3.x's config manager
    lists them when ``--config`` names none)."""
    names = set(globals())
    try:
        from torchtitan.models import _supported_models
    except ImportError:
        return sorted(names)
    for model in _supported_models:
        try:
            module = _registry(f"torchtitan.models.{model}")
        except ImportError:
            continue
        names.update(n for n in dir(module) if not n.startswith("_") and _own_function(module, n) is not None)
    return sorted(names)


def _register_graph_pipeline():
    """``tide.torchtitan_graph`` registered with torchtitan 0.3's graph trainer, where it imports; else None."""
    try:
        from torchtitan.experiments.graph_trainer.registry import (  # noqa: F401
            register_pass_pipeline, register_post_init_hook)
    except ImportError as e:
        log.info("no 'tide' graph trainer pipeline (%s: %s)", type(e).__name__, e)
        return None
    from tide import torchtitan_graph

    torchtitan_graph.register()
    return torchtitan_graph


options()  # a bad value fails at import, before torchtitan builds anything
_register_models()
_graph = _register_graph_pipeline()
