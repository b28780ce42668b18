"""How the collectives' drivers enter the extension: a new plan agreed by every rank first, each call
watched from before it issues anything, and the flag report the watchdog prints when one never completes.

    agree_plan(arena, op, tensor_lists)  every rank reaches its next new plan with the same call
    watched(arena, op, call, captured, **kw)
                                         one extension call under the watchdog (eager, or captured into a
                                         CUDA graph with a replay mark): what it ran
    capturing()                          whether the current stream captures (where no gate said so)
    check_args(arena, op, check, *lists) raise the error of arguments the transport cannot take
    refuse(arena, op, check, *lists)     the same, for arguments the extension refused
"""
from __future__ import annotations

import functools
import logging
from typing import Iterator

import torch

from tide import agreement, trace
from tide.transport import board, flag_report, watchdog

log = logging.getLogger("tide.transport")


def agree_plan(arena, op: str, tensor_lists) -> None:
    """Every rank reaches its next new plan with the same call (its :class:`tide.agreement.CallRecord`, one
    store round trip per plan): ranks that issue another op, layout or dtype there raise, naming both calls."""
    arena.plans_agreed += 1
    call = agreement.CallRecord.of(op, arena.plans_agreed, tensor_lists)
    agreement.agree(arena.store, f"{arena.store_prefix}/plan{call.n}", arena.rank, arena.world_size, call.desc,
                    arena.timeout_s, f"tide.{op} (group {arena.label}, new plan #{call.n})")
    if call.n == 1:
        log.info("tide.transport: %r, %d bytes of symmetric memory, %d leased", arena, arena.symmetric_bytes,
                 arena.data_bytes)


def capturing() -> bool:
    """Whether the current stream captures a CUDA graph, for calls that no gate verdict came with (the ops'
    gate says ``capturing``)."""
    return torch.version.cuda is not None and torch.cuda.is_current_stream_capturing()


def watched(arena, op: str, call, captured: bool, **kw) -> str:
    """One call into the extension, watched from before it issues anything (the arena's in-flight list,
    csrc/transport/driver.h); its outcome's name. A ``captured`` call (its stream captures a CUDA graph)
    is issued with a replay mark, which the watchdog watches at every replay of the graph
    (tide/transport/watchdog.py)."""
    if captured:
        ext, device = arena.ext, arena.device.index
        mark = ext.replay_claim(device)
        ran, _ = call(mark=mark, **kw)
        if ran == "tide":
            watchdog.WATCHDOG.track_captured(ext.replay_states, device, mark, op, arena.label, arena.timeout_s,
                                             functools.partial(report, arena), owner=arena.store_prefix)
        return ran
    if trace.ENABLED:
        trace.event(f"watchdog: tracking {op} on group {arena.label}")
    ran, _ = call(**kw)  # the extension enters it in the arena's in-flight list, which the watchdog polls
    return ran


def check_args(arena, op: str, check, *named_lists) -> None:
    """Raise the error of arguments the transport cannot take: ``check()``'s (tide.meta.checks, which words
    every argument error of every backend), else the one condition the transport adds: every tensor on
    the arena's device."""
    check()
    for name, tensors in named_lists:
        for i, t in enumerate(tensors):
            if t.device != arena.device:
                raise ValueError(f"tide.{op}: {name}[{i}] is on {t.device} but the group's arena is on {arena.device}")


def refuse(arena, op: str, check, *named_lists) -> None:
    """Raise the error of arguments the extension refused (:func:`check_args`)."""
    check_args(arena, op, check, *named_lists)
    raise AssertionError(f"tide.{op}: the extension refused arguments that pass every check")


def report(arena, wait_s: float = 1.5) -> Iterator[str]:
    """The watchdog's report lines: what this rank and its peers have issued, and their processes' state
    (the issued board, tide/transport/board.py: no CUDA call), then which peers' flag words are behind it
    (tide/transport/flag_report.py), from a host copy of the words taken on a stream of the extension's
    own, without the GIL. That copy needs the driver, which a launch blocked on the stalled streams' full
    queue can hold: the lines that need no driver go out first."""
    progress = arena.native.progress()
    yield "  " + flag_report.issued(progress)
    if arena.board is not None:  # the peers' issued work and processes, read with no CUDA call
        yield from board.report(arena.board.records(), arena.rank, arena.ranks)
    status = arena.native.read_flags(arena.report_host, wait_s)
    if status != "ok":
        yield ("  flag words unreadable: " + (f"their copy to the host did not finish in {wait_s:g} s"
                                              if status == "timeout" else f"their copy failed: {status}"))
        return
    words = arena.report_host.tolist()
    yield flag_report.describe(words, arena.flag_index, progress, arena.rank, arena.ranks)
    yield flag_report.captured(words, arena.flag_index, arena.rank)
