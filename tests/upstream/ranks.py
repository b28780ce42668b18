"""What every process of an upstream FSDP2 test run does: the pytest process (whose threads are the ranks
of the multi-thread tests) and each rank process that PyTorch's ``MultiProcessTestCase`` spawns.

``install(mode, results)``:

- ``mode == "tide"``: ``fully_shard`` (every public alias the tests import) enables TIDE on what it sharded,
  so each FSDP2 module the tests build runs on TIDE from its first collective;
- on a CPU-only torch, ``FSDPTest``'s rank start stops asking for one accelerator per rank (it would skip
  every multi-process test on CPU; its multi-thread sibling already exempts CPU), in both modes alike;
- each test a rank process runs starts from cleared ``tide.stats()`` and leaves its ``tide.stats()["fsdp"]`` in
  ``results`` as ``<module>.<Class>.<test>/rank<r>-<pid>.json``, for the pytest process to merge.

Rank processes are started with the spawn method, so they get these hooks through ``sitecustomize``
(``tests/upstream/site``) reading ``TIDE_UPSTREAM_MODE`` and ``TIDE_UPSTREAM_RESULTS``.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from pathlib import Path

MODES = ("stock", "tide")
MODE_ENV = "TIDE_UPSTREAM_MODE"
RESULTS_ENV = "TIDE_UPSTREAM_RESULTS"
FULLY_SHARD_HOMES = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
                     "torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard")


def install_from_env() -> None:
    """``install`` with the mode and results folder the harness put in the environment (no-op without them)."""
    mode = os.environ.get(MODE_ENV)
    if mode:
        install(mode, Path(os.environ[RESULTS_ENV]))


_installed: list[str] = []


def install(mode: str, results: Path) -> None:
    """Once per process (``sitecustomize`` and the pytest plugin may both ask)."""
    if mode not in MODES:
        raise ValueError(f"tests.upstream.ranks.install: mode must be one of {MODES}, got {mode!r}")
    if _installed:
        return
    _installed.append(mode)
    if mode == "tide":
        _enable_tide_after_fully_shard()
    _lift_cpu_rank_check()
    _record_rank_stats(results)


def test_key(module: str, cls: str, test: str) -> str:
    """The folder name under the results folder for one test's rank files."""
    return f"{module}.{cls}.{test}"


def _enable_tide_after_fully_shard() -> None:
    import importlib

    import tide.fsdp

    stock = importlib.import_module(FULLY_SHARD_HOMES[0]).fully_shard

    @functools.wraps(stock)
    def fully_shard_then_enable(module, **kwargs):
        sharded = stock(module, **kwargs)
        for m in sharded if isinstance(sharded, list) else [sharded]:
            # a module without parameters (or with all of them ignored) has no group to opt in
            if tide.fsdp.param_groups(m):
                tide.fsdp.enable(m)
        return sharded

    for home in FULLY_SHARD_HOMES:
        setattr(importlib.import_module(home), "fully_shard", fully_shard_then_enable)


def _lift_cpu_rank_check() -> None:
    """``FSDPTest._run`` exits with a skip code when ``torch.accelerator.device_count()`` is below the world
    size; only that call is answered with the world size, and only when there is no accelerator."""
    import torch
    from torch.testing._internal.common_fsdp import FSDPTest

    if torch.accelerator.is_available():
        return
    rank_start = FSDPTest._run.__func__.__code__
    device_count = torch.accelerator.device_count

    def device_count_for_cpu_ranks() -> int:
        caller = sys._getframe(1)
        if caller.f_code is rank_start:
            return caller.f_locals["self"].world_size
        return device_count()

    torch.accelerator.device_count = device_count_for_cpu_ranks


def _record_rank_stats(results: Path) -> None:
    """Wrap the two places a rank process runs one test: ``MultiProcessTestCase.run_test`` (a process per
    test) and ``MultiProcContinuousTest._run_test_given_id`` (ranks that live across a class's tests)."""
    from torch.testing._internal.common_distributed import MultiProcContinuousTest, MultiProcessTestCase

    run_test = MultiProcessTestCase.run_test

    @functools.wraps(run_test)
    def run_test_and_record(self, test_name, *args, **kwargs):
        with _recorded(results, test_key(type(self).__module__, type(self).__name__, test_name), self.rank):
            return run_test(self, test_name, *args, **kwargs)

    run_given_id = MultiProcContinuousTest._run_test_given_id.__func__

    @functools.wraps(run_given_id)
    def run_given_id_and_record(cls, test_id, **kwargs):
        with _recorded(results, test_id, cls.rank):
            return run_given_id(cls, test_id, **kwargs)

    MultiProcessTestCase.run_test = run_test_and_record
    MultiProcContinuousTest._run_test_given_id = classmethod(run_given_id_and_record)


@contextlib.contextmanager
def _recorded(results: Path, key: str, rank: int):
    """Run one test of this rank from cleared counters and leave its ``tide.stats()["fsdp"]`` in ``results``."""
    import tide

    tide.reset_stats()
    try:
        yield
    finally:
        folder = results / key
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}-{os.getpid()}.json").write_text(json.dumps(tide.stats()["fsdp"]))
