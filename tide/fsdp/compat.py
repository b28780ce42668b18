"""What differs between torch releases for the FSDP2 seam, decided by shape, never by a version table.

The seam replaces three private functions of ``_fsdp_collectives``. It offers one small wrapper per
signature those functions have had (``tide.fsdp.seam.SHAPES``); :func:`choose_wrappers` takes, for each
function, the wrapper whose parameters (names, order, kinds) are exactly the stock function's. When one
of the three has a signature no wrapper knows, TIDE takes no call at all: the seam installs pass-through
wrappers that count every collective as ``stock:untested_torch:<what differed>`` (logged once), so a
torch upgrade never breaks the user's training.

Shapes seen so far (torch 2.11 to 2.15):

* ``foreach_reduce``: through 2.14 it takes the group's ``orig_dtype``; 2.15 drops it, casts each reduced
  gradient to its param's ``sharded_grad_dtype`` and adds a keyword-only ``prepare_reduce_scatter_inputs``.
  It returns 6 values on 2.11-2.12 and 7 from 2.13 (``post_reduce_stream`` at index 2): read from its
  return annotation.
* ``foreach_all_gather_copy_out``: 2.15 adds a keyword-only ``all_gather_output_fn``.
* Param groups: ``FSDPState._fsdp_param_groups`` (a list, 2.13+) or ``_fsdp_param_group`` (one or None).
* Gradients accumulated without a reduce: through 2.14 FSDP moves them to ``unsharded_accumulated_grad``;
  from 2.15 they stay in the leaf's ``grad`` (that name is a property reading it).
"""
from __future__ import annotations

import inspect
import logging
import re
import typing
import warnings

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

from tide import registry

log = logging.getLogger("tide.fsdp")

# The releases the seam is tested on (CI runs tests/fsdp on each minor). A newer one whose signatures
# match still runs TIDE, after a one-time warning naming it.
TESTED_TORCH = ((2, 11), (2, 15))


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (default: the running torch)."""
    m = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    if m is None:
        raise RuntimeError(f"tide.fsdp: cannot parse torch version {version or torch.__version__!r}")
    return int(m.group(1)), int(m.group(2))


def is_tested(version: str | None = None) -> bool:
    low, high = TESTED_TORCH
    return low <= torch_version(version) <= high


def _shape(fn) -> list[tuple[str, str]]:
    return [(p.name, p.kind.name) for p in inspect.signature(fn).parameters.values()]


def _describe(shape: list[tuple[str, str]]) -> str:
    out, star = [], False
    for name, kind in shape:
        if kind == "KEYWORD_ONLY" and not star:
            out.append("*")
            star = True
        out.append(name)
    return ", ".join(out)


def choose_wrappers(shapes: dict[str, list], stock=_fsdp_collectives) -> tuple[dict | None, str | None]:
    """For each function name in ``shapes``, the candidate wrapper whose signature is the stock
    function's; returns ``(wrappers, None)``, or ``(None, reason)`` naming the first function no
    candidate fits (``"<name>(<its parameters>)"``)."""
    chosen = {}
    for name, candidates in shapes.items():
        theirs = _shape(getattr(stock, name))
        match = next((w for w in candidates if _shape(w) == theirs), None)
        if match is None:
            return None, f"{name}({_describe(theirs)})"
        chosen[name] = match
    if reduce_arity(stock) is None:
        return None, "foreach_reduce returns " + str(inspect.signature(stock.foreach_reduce).return_annotation)
    return chosen, None


def reduce_arity(stock=_fsdp_collectives) -> int | None:
    """How many values ``foreach_reduce`` returns (6 or 7), from its return annotation; None if unknown."""
    n = len(typing.get_args(inspect.signature(stock.foreach_reduce).return_annotation))
    return n if n in (6, 7) else None


REDUCE_ARITY = reduce_arity()


def reduce_result(keep_alive, rs_event, post_stream, post_event, *, all_reduce_input=None, all_reduce_event=None,
                  partial=None) -> tuple:
    """``foreach_reduce``'s return value for this torch: the reduce input to keep alive, the reduce-scatter's
    event, the stream and event after which the sharded gradients are ready, the all-reduce's buffer and
    event (HSDP, an all-reduce hook), and the partial output of a step without all-reduce."""
    if REDUCE_ARITY == 7:
        return keep_alive, rs_event, post_stream, post_event, all_reduce_input, all_reduce_event, partial
    return keep_alive, rs_event, post_event, all_reduce_input, all_reduce_event, partial


def warn_untested_once(fn: str) -> None:
    """One warning per process when TIDE runs on a torch newer (or older) than the tested range."""
    if is_tested() or torch.__version__ in registry.compat_warned:
        return
    registry.compat_warned.add(torch.__version__)
    low, high = TESTED_TORCH
    warnings.warn(f"{fn}: torch {torch.__version__} is outside the releases TIDE's FSDP2 seam is tested on "
                  f"({low[0]}.{low[1]} to {high[0]}.{high[1]}); its FSDP2 signatures match, so TIDE runs",
                  RuntimeWarning, stacklevel=3)


def param_groups(state) -> list:
    """All ``FSDPParamGroup`` objects of one ``FSDPState``."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


# From 2.15 the leaf's grad holds gradients accumulated without a reduce; the old attribute reads it.
_ACCUMULATES_IN_LEAF = isinstance(inspect.getattr_static(FSDPParam, "unsharded_accumulated_grad", None), property)


def holds_unreduced_accumulation(fsdp_param) -> bool:
    """Whether an earlier backward left a gradient outside the leaf's ``grad`` that this reduce adds."""
    return not _ACCUMULATES_IN_LEAF and fsdp_param.unsharded_accumulated_grad is not None


def reduce_dtype(fsdp_param) -> torch.dtype | None:
    """The dtype FSDP reduces this param's gradient in, None meaning the gradient's own: 2.15's
    ``unsharded_grad_dtype`` (the mixed-precision reduce dtype, else the original param dtype), else the
    param's ``reduce_dtype`` (None when it equals the param dtype)."""
    if hasattr(type(fsdp_param), "unsharded_grad_dtype"):
        return fsdp_param.unsharded_grad_dtype
    return fsdp_param.reduce_dtype
