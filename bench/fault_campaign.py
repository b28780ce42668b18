"""Fault campaign: many 2-rank runs, each with a random fault at a random point of a random op mix.

Every run picks a scenario (``fault_scenarios.py``: a peer dies in an all-gather or a reduce-scatter of an op
mix or of FSDP2 training in either reduce-scatter mode, dies between steps, skips a collective, or issues
another plan), a point (the op or step where rank 1 injects it) and a seed (the op mix). A run is a
**hang** when any rank is still running at the deadline (killed there); otherwise it counts how long
after the fault the last other rank ended, and whether every other rank ended in an error (an exception,
or the transport watchdog's exit). ``--timeout`` is the process group's timeout (gloo), which TIDE's
watchdog takes as its own, as in a real job. ``--device cpu`` exercises the reference backend,
``--device cuda`` the CUDA transport (ranks share one GPU or take one each). ``--kinds TEXT`` runs only
the kinds whose name contains TEXT; ``faults_runs.csv`` says how each surviving rank ended.

``--campaign`` (CPU) runs :func:`fault_rounds.campaign` instead: ``--runs`` runs at 2, 3 and 4 ranks in
turn, each of ``--rounds`` rounds of random faults on fresh groups (one rank's bad input, a stall, skipped
calls and steps, two threads on a group) and a kill, ``TIDE_TIMEOUT_S`` = ``--timeout``; it writes
``faults_campaign.csv`` (one row per run: rounds, hangs, wrong results, late or non-TIDE errors, the
slowest survivor's seconds from a fault to its error) and prints a SUMMARY line.

Writes ``faults.csv`` (``scenario, runs, hangs, median_s_to_error, max_s_to_error, gpus, date`` plus
failures and the device), ``faults_runs.csv`` (one row per run) and ``faults.png`` under ``--out``, and
prints one line per run as it ends. ``--parallel N`` runs N at a time (their ranks share the machine;
on CUDA they share the GPUs as well).
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out, pyplot, require_cuda, run_meta, write_csv  # noqa: E402

import fault_rounds  # noqa: E402
import fault_scenarios  # noqa: E402
from tide.launch import run_ranks_outcomes  # noqa: E402

KINDS = [("ops", s, None) for s in fault_scenarios.OP_SCENARIOS] + [
    ("fsdp", s, m) for s in fault_scenarios.STEP_SCENARIOS for m in ("in_place", "slot_reuse")]


def draw(i: int, rng: random.Random, kinds=KINDS) -> tuple:
    """Run i's scenario (every kind once first, then at random), op-mix seed and fault point."""
    kind, scenario, rs_mode = kinds[i] if i < len(kinds) else rng.choice(kinds)
    return kind, scenario, rs_mode, rng.randrange(1 << 30), rng.randint(0, 5) if kind == "ops" else rng.randint(1, 4)


def one_run(kind: str, scenario: str, rs_mode: str | None, seed: int, fault_at: int, device: str,
            timeout: float) -> dict:
    deadline = timeout + 15 + 60  # the bound, plus spawning, importing and building the model
    with tempfile.TemporaryDirectory() as tmp:
        fault_file = str(Path(tmp) / "fault")
        if kind == "ops":
            fn, args = fault_scenarios.op_sequence, (device, scenario, seed, fault_at, fault_file)
        else:
            steps = fault_at + 2  # the fault falls inside the run: an all-gather/reduce-scatter or step before the end
            fn, args = fault_scenarios.fsdp_steps, (device, scenario, rs_mode, fault_at, steps, fault_file)
        # TIDE's timeout is the process group's (as in a real job): one bound for TIDE's ops and stock's.
        outcomes = run_ranks_outcomes(fn, 2, *args, device_type=device, timeout=deadline, pg_timeout=timeout)
        verdict = fault_scenarios.judge(outcomes, fault_file)
    name = f"{kind}:{scenario}" + (f":{rs_mode}" if rs_mode else "")
    faulty = verdict["faulty"]
    survivor = next(o for o in outcomes if o.rank != faulty.rank)
    return {"scenario": name, "seed": seed, "fault_at": fault_at, "hung": len(verdict["hung"]) > 0,
            "errors": verdict["errors"], "s_to_error": verdict["s_to_error"],
            "faulty_rank": faulty.status if faulty.status == "error" else f"{faulty.status}:{faulty.detail}",
            "survivor_end": how_it_ended(survivor)}


def how_it_ended(outcome) -> str:
    """One line for how a rank ended: the first line of its final exception (a multi-line message, such as
    the watchdog's report, starts with what matters), or its exit code, or "hung"."""
    if outcome.status == "error":
        lines = str(outcome.detail).strip().splitlines()
        starts = [line for line in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", line)]
        return (starts[-1] if starts else lines[-1] if lines else "error")[:300]
    return outcome.status if outcome.status in ("ok", "hung") else f"{outcome.status}:{outcome.detail}"


def summarize(runs: list[dict], meta: dict) -> list[dict]:
    rows = []
    for name in sorted({r["scenario"] for r in runs}):
        mine = [r for r in runs if r["scenario"] == name]
        times = [r["s_to_error"] for r in mine if r["s_to_error"] is not None and not r["hung"]]
        rows.append({"scenario": name, "runs": len(mine), "hangs": sum(r["hung"] for r in mine),
                     "median_s_to_error": round(statistics.median(times), 2) if times else "",
                     "max_s_to_error": round(max(times), 2) if times else "",
                     "gpus": meta["gpus"], "date": meta["date"],
                     "not_all_errors": sum(not r["errors"] for r in mine), "device": meta["device"],
                     "timeout_s": meta["timeout_s"], "torch": meta["torch"]})
    return rows


def plot(rows: list[dict], path: Path, timeout: float) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r["scenario"] for r in rows]
    med = [r["median_s_to_error"] or 0 for r in rows]
    top = [r["max_s_to_error"] or 0 for r in rows]
    ax.barh(names, top, color="#c9d6ea", label="max")
    ax.barh(names, med, color="#3b6bb5", label="median")
    ax.axvline(timeout + 15, color="#b33", ls="--", label=f"bound: timeout + 15 s = {timeout + 15:g} s")
    for i, r in enumerate(rows):
        ax.text((r["max_s_to_error"] or 0) + 0.2, i, f"{r['runs']} runs, {r['hangs']} hangs", va="center", fontsize=8)
    ax.set_xlabel("seconds from the fault until the other rank ended in an error")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"Fault campaign on {rows[0]['device']} ({rows[0]['gpus']} GPUs), {sum(r['runs'] for r in rows)} runs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def campaign_runs(runs: int, rounds: int, timeout: float, seed: int, out: Path) -> int:
    """The CPU campaign (``--campaign``): one row per run, a SUMMARY line; 0 when every run was clean."""
    import time

    meta = run_meta(gpus=0, timeout_s=timeout)
    rows = []
    for i in range(runs):
        world_size, run_seed = (2, 3, 4)[i % 3], seed + i
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            fault_file = str(Path(tmp) / "fault")
            outcomes = run_ranks_outcomes(fault_rounds.campaign, world_size, run_seed, rounds, fault_file,
                                          timeout=rounds * (timeout + 10) + 60, pg_timeout=max(30.0, 3 * timeout),
                                          env={"TIDE_TIMEOUT_S": str(timeout)})
            v = fault_rounds.judge_campaign(outcomes, fault_file, timeout + 15)
        row = {"world_size": world_size, "seed": run_seed, "rounds": v["rounds"], "hangs": len(v["hung"]),
               "wrong": len(v["wrong"]), "late": len(v["late"]), "not_tide": len(v["not_tide"]),
               "failed_ranks": len(v["failed_ranks"]), "worst_s_to_error": round(v["worst_s"], 2),
               "wall_s": round(time.monotonic() - start, 1), "timeout_s": timeout, "date": meta["date"],
               "torch": meta["torch"]}
        rows.append(row)
        print(f"run {i + 1}/{runs} W={world_size} seed={run_seed}: {row}", flush=True)
    write_csv(out / "faults_campaign.csv", rows)
    bad = sum(r["hangs"] + r["wrong"] + r["late"] + r["not_tide"] + r["failed_ranks"] for r in rows)
    print(f"SUMMARY fault_campaign cpu campaign: {len(rows)} runs, {sum(r['rounds'] for r in rows)} rounds, "
          f"{sum(r['hangs'] for r in rows)} hangs, {sum(r['wrong'] for r in rows)} wrong results, "
          f"{sum(r['late'] for r in rows)} late, {sum(r['not_tide'] for r in rows)} non-TIDE errors, slowest "
          f"{max(r['worst_s_to_error'] for r in rows)} s from a fault to an error (bound {timeout + 15:g} s)")
    return 0 if bad == 0 else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds: the process group's timeout, which TIDE's is")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", type=int, default=1, help="runs at a time (each spawns 2 ranks)")
    p.add_argument("--kinds", default="", help="only the kinds whose name (e.g. 'fsdp:dies_in_all_gather:slot_reuse') "
                   "contains this text")
    p.add_argument("--out", type=Path, default=default_out())
    p.add_argument("--campaign", action="store_true", help="CPU: fault_rounds.campaign runs at 2-4 ranks (see above)")
    p.add_argument("--rounds", type=int, default=8, help="--campaign: soft-fault rounds per run (then a kill)")
    args = p.parse_args(argv)
    if args.campaign:
        if args.device != "cpu":
            p.error("--campaign runs on CPU (--device cpu)")
        return campaign_runs(args.runs, args.rounds, args.timeout, args.seed, args.out)
    kinds = [k for k in KINDS if args.kinds in ":".join(filter(None, k))]
    if not kinds:
        p.error(f"--kinds {args.kinds!r} matches none of {[':'.join(filter(None, k)) for k in KINDS]}")
    if args.runs < 1 or args.timeout <= 0 or args.parallel < 1:
        p.error("--runs and --parallel must be >= 1, --timeout > 0")
    if args.device == "cuda":
        require_cuda("fault_campaign.py")
    rng = random.Random(args.seed)
    meta = run_meta(gpus=torch.cuda.device_count() if args.device == "cuda" else 0, timeout_s=args.timeout)
    if args.device == "cpu":
        meta["device"] = "cpu (gloo, reference backend)"
    plan = [draw(i, rng, kinds) for i in range(args.runs)]
    runs = []
    with ThreadPoolExecutor(args.parallel) as pool:  # each run is its own 2 processes; threads only wait
        futures = [pool.submit(one_run, *d, args.device, args.timeout) for d in plan]
        for future in as_completed(futures):
            run = future.result()
            runs.append(run)
            took = "-" if run["s_to_error"] is None else f"{run['s_to_error']:.2f} s"
            print(f"run {len(runs)}/{args.runs} {run['scenario']} at {run['fault_at']}: "
                  f"{'HUNG' if run['hung'] else 'ended'}, other rank in error: {run['errors']}, {took} after the fault"
                  f" ({run['survivor_end'][:160]})", flush=True)
    rows = summarize(runs, meta)
    write_csv(args.out / "faults.csv", rows)
    write_csv(args.out / "faults_runs.csv", [{**r, "device": meta["device"], "date": meta["date"]} for r in runs])
    plot(rows, args.out / "faults.png", args.timeout)
    hangs = sum(r["hangs"] for r in rows)
    bad = sum(r["not_all_errors"] for r in rows)
    worst = max((r["max_s_to_error"] for r in rows if r["max_s_to_error"] != ""), default=float("nan"))
    print(f"SUMMARY fault_campaign {args.device}: {len(runs)} runs, {hangs} hangs, {bad} runs where another rank "
          f"did not end in an error, slowest end {worst} s after the fault (bound {args.timeout + 15:g} s)")
    return 0 if hangs == 0 and bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
