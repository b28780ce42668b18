"""The ops' fp32 sum, in one place. Every reduce-scatter sums its terms as

    outs[j] (+)= scale * (x_0 + x_1 + ... + x_{K-1})[off_j : off_j + outs[j].numel()]

in fp32, term by term in order k = 0 .. K-1, each step one rounded fp32 operation, then the scale, then
the write (or the add into ``outs[j]``, ``accumulate``); off_j is the numel of ``outs[0..j)``. The terms are
the rows of ``rows`` (R x n), and, when ``owns`` are given, one more term at position ``own_row``:
``owns[j]`` (one per out, same dtype as the rows) read where they lie, so a rank's own contribution is
never copied into a staging row. The single-node reduce-scatter's terms are its W ranks' contributions
(rank order); the multi-node schedule's are a node's local contributions (local order), then a
destination's node partials (node order).

:func:`sum_rows_reference` is the reference: torch ops, any device, this order by construction. :func:`sum_rows`
is what the multi-node schedule calls: on CUDA the bounded-grid summing kernel of TIDE-RS
(csrc/ops/sum_contributions.cu, :func:`summing_ctas` CTAs), bit for bit the same; on CPU, or when the CUDA
extension cannot be built, the reference. ``tide.stats()["multinode"]`` counts which ran (``sum:kernel``,
``sum:torch``).
"""
from __future__ import annotations

import functools
import logging
from typing import Sequence

import torch

from tide import counters, knobs

log = logging.getLogger("tide")


def sum_rows_reference(outs: Sequence[torch.Tensor], rows: torch.Tensor, owns: Sequence[torch.Tensor] = (),
                       own_row: int = -1, scale: float = 1.0, accumulate: bool = False) -> None:
    """The reference of the sum above (torch ops): ``outs`` are fp32, ``rows`` is R x n with n the outs'
    numels summed; with ``owns`` the terms are K = R + 1, ``owns`` standing at ``own_row``."""
    k = rows.shape[0] + (1 if owns else 0)
    if (len(owns) != len(outs)) if owns else own_row != -1:
        raise ValueError(f"tide.sum_rows_reference: owns needs one tensor per out ({len(owns)} for {len(outs)}), and "
                         f"own_row = -1 without owns (got {own_row})")
    if owns and not 0 <= own_row < k:
        raise ValueError(f"tide.sum_rows_reference: own_row={own_row} not in [0, {k})")
    if any(o.dtype != rows.dtype for o in owns):
        raise ValueError(f"tide.sum_rows_reference: owns must have rows' dtype {rows.dtype}")
    own = None
    if owns:
        own = owns[0].reshape(-1) if len(owns) == 1 else torch.cat([o.reshape(-1) for o in owns])
    terms = [own if i == own_row else rows[i - 1 if owns and i > own_row else i] for i in range(k)]
    acc = terms[0].to(torch.float32, copy=True)
    for x in terms[1:]:
        acc.add_(x)
    acc.mul_(scale)
    dsts = [o.view(-1) for o in outs]
    pieces = list(acc.split([o.numel() for o in outs]))
    if accumulate:
        torch._foreach_add_(dsts, pieces)
    else:
        torch._foreach_copy_(dsts, pieces)


def summing_ctas(device: torch.device | int) -> int:
    """CTAs of TIDE-RS's summing kernel on ``device`` (the arena's and the multi-node sums'): ``TIDE_RS_CTAS``,
    else one per SM. Its cost is its SM time, not its CTA count: one short burst over every SM beats a long
    one on a few (docs/performance.md, "Summing grid")."""
    ctas = knobs.get("TIDE_RS_CTAS")
    return ctas if ctas is not None else torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _kernel():
    """The extension's ``sum_rows`` on :func:`summing_ctas` CTAs (read once, as the arena reads it), or None
    when the CUDA extension cannot be built here (logged once)."""
    from tide import extension

    knobs.get("TIDE_RS_CTAS")  # a bad value raises, here too, before anything is built
    try:
        return functools.partial(extension.load().sum_rows, ctas=summing_ctas(torch.cuda.current_device()))
    except Exception as e:  # no nvcc, a failed build: the reference computes the same bits, slower
        log.warning("tide: the summing kernel is unavailable (%s: %s); multi-node sums run as torch ops",
                    type(e).__name__, e)
        return None


def sum_rows(outs: Sequence[torch.Tensor], rows: torch.Tensor, owns: Sequence[torch.Tensor] = (), own_row: int = -1,
             scale: float = 1.0, accumulate: bool = False) -> None:
    """The sum above: the summing kernel on CUDA tensors, else :func:`sum_rows_reference` (counted either way)."""
    kernel = _kernel() if rows.is_cuda else None
    counters.count_multinode("sum:kernel" if kernel is not None else "sum:torch")
    if kernel is None:
        sum_rows_reference(outs, rows, owns, own_row, scale, accumulate)
        return
    kernel(outs=list(outs), rows=rows, owns=list(owns), own_row=own_row, scale=scale, accumulate=accumulate)
