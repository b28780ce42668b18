"""Run a function on N local ranks, each in its own spawned process with a process group.

Used by the tests, the benchmarks and ``tide.train``. Every failure surfaces in the caller: an
exception on any rank stops all ranks and is re-raised with that rank's traceback, a rank that exits
with a non-zero code is reported even after it has returned its result, and a run that outlives
``timeout`` is killed and reported (a hung collective never blocks the caller). Every rank killed, at the
deadline or because a peer raised, first prints its kernel state and every thread's stack on stderr.

CPU ranks start by a fork of a server process that imported torch once (multiprocessing's forkserver,
:data:`PRELOAD`): a fraction of a second per rank instead of several seconds of importing torch anew, and
still a fresh process with nothing of earlier runs in it. They get the caller's environment and its current
stdout and stderr, as spawned ranks would. CUDA ranks are spawned.

A rank ends with ``os._exit`` once its result is handed over and its process group destroyed: on torch
2.13 the interpreter's own teardown aborts in gloo now and then (SIGABRT after a clean run, stock
FSDP2 scripts alike), which would otherwise fail a run that succeeded.
"""
from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp

from tide import procfs


# Environment of CUDA ranks: NVLink multicast stays off (NCCL, torch symmetric memory, NVSHMEM), and
# several ranks may share one GPU through torch symmetric memory over a gloo group.
CUDA_RANK_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1",
}


# Sent to a rank that outlived its deadline, just before it is killed: it prints every thread's stack.
STACKS_SIGNAL = signal.SIGUSR1


def _thread_waits(pid: int) -> str:
    """Where each thread of a process waits in the kernel: name, wait channel and system call number (a
    thread blocked in the GPU driver shows an ioctl, one waiting for a lock a futex; no Python stack says)."""
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return "threads unknown"
    rows = []
    for tid in tids:
        comm, wchan, syscall = (procfs.text(f"/proc/{pid}/task/{tid}/{name}") for name in ("comm", "wchan", "syscall"))
        rows.append(f"{tid} {comm or '?'} wchan={wchan or '?'} syscall={syscall.split(' ')[0] if syscall else '?'}")
    return "; ".join(rows)


def _kill(procs) -> None:
    """Kill the ranks still alive, each printing its stacks first (a hang shows where it waited)."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:  # one at a time, so that their stacks do not interleave
        if not p.is_alive():  # it ended meanwhile
            continue
        print(f"tide.launch: rank process {p.pid} still running ({procfs.state(p.pid)}): its threads "
              f"[{_thread_waits(p.pid)}], its stacks, then kill", file=sys.stderr, flush=True)
        os.kill(p.pid, STACKS_SIGNAL)
        time.sleep(0.5)
    for p in alive:
        p.kill()
        p.join()


# What the server CPU ranks fork from imports once, before its first fork (its threads must not hold locks
# then: importing these starts none that run). They read what they read of the environment at import from
# the caller's environment when the server started (its first CPU run); tide is not among them, so that a
# run's ``env`` reaches every setting of TIDE's (``TIDE_TRACE`` is read at import).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo")


def _context(device_type: str):
    """Fork CPU ranks from the server (one per calling process, started by its first run); spawn CUDA ranks
    (a fork must not inherit a CUDA context, and a CUDA rank's start is short beside its set-up)."""
    if device_type == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class _Caller:
    """The caller's environment, stdout and stderr, handed to a rank it starts: a rank forked from the server
    would otherwise have the server's (pytest's capture of the caller's output at the time, say)."""

    def __init__(self, env=None, fds=None):
        self.env, self.fds = env, fds

    def __reduce__(self):
        from multiprocessing import reduction

        fds = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:  # closed in the caller: the rank keeps the server's
                fds.append(None)
            else:
                fds.append(reduction.DupFd(fd))
        return (_Caller, (dict(os.environ), tuple(fds)))

    def adopt(self) -> None:
        """In the rank: take over the caller's environment and its stdout and stderr."""
        os.environ.clear()
        os.environ.update(self.env)
        for target, fd in zip((1, 2), self.fds):
            if fd is None:
                continue
            fd = fd.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, backend, device_type, env, fn, args, results, pg_timeout_s, release, caller):
    import faulthandler

    caller.adopt()

    faulthandler.enable()  # a rank killed by a signal prints its Python stack on stderr
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # a hung rank's stacks, before it is killed

    import torch
    import torch.distributed as dist

    # torchrun's variables for one host; env may set LOCAL_WORLD_SIZE to emulate nodes of that many ranks.
    local_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank % local_size), LOCAL_WORLD_SIZE=str(local_size))
    os.environ.update(env)
    try:
        if device_type == "cuda":
            # One GPU per rank when there are enough; otherwise ranks share GPUs (gloo; run_ranks refuses NCCL).
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    try:
        # Rank 0 hosts the store: leaving before the parent has every rank's result would pull it from
        # under a peer still reading it (an exchange's last get, say, or the record of a call that raised
        # here and that the peer is about to raise on too).
        release.wait(pg_timeout_s)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    exit_cleanly(results)


def exit_cleanly(results=None) -> None:
    """Flush what this process hands over (stdout, stderr, a result queue) and end it with status 0,
    skipping the interpreter teardown that aborts in gloo now and then on torch 2.13."""
    import sys

    if results is not None:
        results.close()
        results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    device_type: str = "cpu",
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks, each a process of its own; return the
    per-rank results.

    ``fn`` must be importable by module path (it is pickled by name) and return something
    picklable. CUDA ranks get :data:`CUDA_RANK_ENV` (multicast off; ``env`` may add to it). Raises :class:`RankError` if
    any rank raised, :class:`TimeoutError` after ``timeout`` seconds (all ranks are killed either way).
    """
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size must be >= 1, got {world_size}")
    if device_type == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise RuntimeError("run_ranks: device_type='cuda' but no CUDA device is visible")
        if backend == "nccl" and world_size > gpus:
            raise ValueError(f"run_ranks: NCCL needs one GPU per rank: {world_size} ranks, {gpus} GPUs "
                             "(ranks can share a GPU over gloo)")
        env = {**CUDA_RANK_ENV, **(env or {})}
    ctx = _context(device_type)
    results, release = ctx.Queue(), ctx.Event()
    port = free_port()
    pg_timeout_s = max(10, int(timeout))
    procs = [
        ctx.Process(target=_rank_main, daemon=True,
                    args=(r, world_size, port, backend, device_type, dict(env or {}), fn, args, results,
                          pg_timeout_s, release, _Caller()))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outs: dict[int, Any] = {}
    try:
        while len(outs) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(outs))
                raise TimeoutError(f"run_ranks: ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outs]
                if dead:
                    raise RankError(f"run_ranks: rank {dead[0]} exited with code {procs[dead[0]].exitcode}")
                continue
            if status == "error":
                raise RankError(f"rank {rank} of {world_size} failed:\n{payload}")
            outs[rank] = payload
    finally:
        release.set()
        for p in procs:
            p.join(timeout=30 if len(outs) == world_size else 0.1)
        _kill(procs)
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise RankError("run_ranks: every rank returned its result, but " +
                        ", ".join(f"rank {r} exited with code {c}" for r, c in failed))
    return [outs[r] for r in range(world_size)]


@dataclass
class Outcome:
    """How one rank of :func:`run_ranks_outcomes` ended: ``"ok"`` (``detail``: its result), ``"error"`` (its
    traceback), ``"exited"`` (its exit code, nothing reported) or ``"hung"`` (killed at the deadline);
    ``seconds`` from the start of the run until it reported or ended, ``ended_at`` the same moment on the
    wall clock (``time.time()``)."""

    rank: int
    status: str
    detail: Any
    seconds: float
    ended_at: float


def run_ranks_outcomes(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                       device_type: str = "cpu", timeout: float = 120.0, pg_timeout: float = 10.0,
                       env: dict[str, str] | None = None) -> list[Outcome]:
    """Run ``fn(rank, world_size, *args)`` like :func:`run_ranks`, but let ranks fail or die on their own
    and report how every rank ended (fault tests: a rank that exits must not stop its peers from showing
    what they do). Ranks still running after ``timeout`` seconds are killed and reported ``"hung"``; the
    process groups' own timeout is ``pg_timeout``."""
    if device_type == "cuda":
        env = {**CUDA_RANK_ENV, **(env or {})}
    ctx = _context(device_type)
    results, release = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, port, backend, device_type, dict(env or {}), fn, args, results,
                               pg_timeout, release, _Caller()))
             for r in range(world_size)]
    start, start_wall = time.monotonic(), time.time()

    def outcome(rank: int, status: str, detail: Any) -> Outcome:
        seconds = time.monotonic() - start
        return Outcome(rank, status, detail, seconds, start_wall + seconds)

    for p in procs:
        p.start()
    outcomes: dict[int, Outcome] = {}
    while len(outcomes) < world_size and time.monotonic() - start < timeout:
        try:
            rank, status, payload = results.get(timeout=0.2)
            outcomes[rank] = outcome(rank, status, payload)
        except queue.Empty:
            for r, p in enumerate(procs):
                if r not in outcomes and p.exitcode is not None:
                    outcomes[r] = outcome(r, "exited", p.exitcode)
    release.set()
    for r, p in enumerate(procs):
        if r not in outcomes:
            outcomes[r] = outcome(r, "hung", None)
        p.join(timeout=0.5 if outcomes[r].status != "hung" else 0)
    _kill(procs)
    return [outcomes[r] for r in range(world_size)]
