"""Torch-version shims for the FSDP2 seam: accepted torch 2.11 and 2.13 (``TESTED_TORCH``, the releases
it is tested on: 2.11 on the GPU machine, 2.13 in CI; pyproject.toml allows the same).

Differences handled here (from the FSDP2 sources of those versions):
* param groups: 2.13+ ``FSDPState._fsdp_param_groups`` (a list); 2.11 ``_fsdp_param_group`` (one or None);
* ``foreach_reduce`` returns 6 values on 2.11 and 7 on 2.13+ (``post_reduce_stream`` at index 2);
* 2.11 traceable FSDP2 (compiled autograd) is detected with ``_fsdp_common.compiled_autograd_enabled``.

The seam's wrappers take FSDP2's arguments by position, so :func:`check_signatures` compares their
parameter names with the stock functions' at install: a reordering upstream fails loudly instead of
binding arguments wrong.
"""
from __future__ import annotations

import inspect
import os
import re
import typing

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_common

TESTED_TORCH = ((2, 11), (2, 13))
FORCE_ENV = "TIDE_FORCE_TORCH_VERSION"


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (default: the running torch)."""
    m = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    if m is None:
        raise RuntimeError(f"tide.fsdp: cannot parse torch version {version or torch.__version__!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch_version(fn: str, force: bool, version: str | None = None) -> None:
    """Raise unless the torch version is tested, ``force`` is set or ``TIDE_FORCE_TORCH_VERSION=1``."""
    if torch_version(version) in TESTED_TORCH or force or os.environ.get(FORCE_ENV) == "1":
        return
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TORCH)
    raise RuntimeError(
        f"{fn}: torch {version or torch.__version__} is not a tested version for the FSDP2 seam (tested: {tested}); "
        f"the private FSDP2 functions it replaces may differ. Pass force=True or set {FORCE_ENV}=1 to try anyway."
    )


def param_groups(state) -> list:
    """All ``FSDPParamGroup`` objects of one ``FSDPState``."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def _reduce_arity() -> int:
    # The stock function's return annotation names every element on the tested versions.
    ann = inspect.signature(_fsdp_collectives.foreach_reduce).return_annotation
    n = len(typing.get_args(ann))
    if n in (6, 7):
        return n
    return 6 if torch_version() < (2, 12) else 7


REDUCE_ARITY = _reduce_arity()

_compiled_autograd_enabled = getattr(_fsdp_common, "compiled_autograd_enabled", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def is_tracing() -> bool:
    """Inside torch.compile tracing or (2.11) compiled-autograd traceable FSDP2."""
    if torch.compiler.is_compiling():
        return True
    return _compiled_autograd_enabled is not None and bool(_compiled_autograd_enabled())


def functorch_active() -> bool:
    return _functorch_active is not None and bool(_functorch_active())


def reduce_result(keep_alive, rs_event, rs_stream, post_event) -> tuple:
    """``foreach_reduce``'s return value for this torch (no all-reduce, no partial output)."""
    if REDUCE_ARITY == 7:
        return keep_alive, rs_event, rs_stream, post_event, None, None, None
    return keep_alive, rs_event, post_event, None, None, None


def check_signatures(wrappers: dict, fn: str = "tide.fsdp.enable") -> None:
    """Raise unless every wrapper's named positional parameters are the stock ``_fsdp_collectives``
    function's, in order (the wrapper may name fewer: a newer FSDP2's extra arguments reach it in
    ``*args`` / ``**kwargs`` and send that call to stock)."""
    for name, wrapper in wrappers.items():
        stock = list(inspect.signature(getattr(_fsdp_collectives, name)).parameters)
        ours = [p.name for p in inspect.signature(wrapper).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if stock[:len(ours)] != ours:
            raise RuntimeError(
                f"{fn}: torch {torch.__version__}'s FSDP2 {name} takes ({', '.join(stock)}), but TIDE's seam expects "
                f"({', '.join(ours)}); this torch is not supported")
